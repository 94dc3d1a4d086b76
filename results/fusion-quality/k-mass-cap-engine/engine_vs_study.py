"""The engine's mass cap on the CPU against the study's cap2 rows (k-shift-mass-cap/musique-rest-cap2.jsonl):
fuse@15% kl_tf per case with the shipped policy (cap on) and with the cap off, through the eval's own measure.

    OMP_NUM_THREADS=2 .venv/bin/python results/fusion-quality/k-mass-cap-engine/engine_vs_study.py 50,51,52
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.quality import mode_kl

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from study_cases import study_cases  # noqa: E402

engine, cases = study_cases("musique_dev.json", sys.argv[1])
policy = SelectionPolicy.default()
for i, case in cases:
    on = mode_kl(engine, case, "fuse", policy)[1]
    off = mode_kl(engine, case, "fuse", replace(policy, k_mass_cap=0.0))[1]
    print(json.dumps({"case": i, "kl_tf": {"engine_cap": round(on, 5), "engine_no_cap": round(off, 5)}}), flush=True)
