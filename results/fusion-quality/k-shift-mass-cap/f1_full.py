"""How musique-cap2-f1.jsonl was measured: the mass-capped stale shift's (cap2) greedy answers on MuSiQue, by the
eval's own `run_mode` with `scripts/k_shift_mass_cap.py`'s `front`, scored by token F1 against full prefill's answer;
the shipped selection's per-case F1 comes from the all-case eval (results/fusion-quality/musique-all-noise-floor).

    OMP_NUM_THREADS=1 nice .venv/bin/python results/fusion-quality/k-shift-mass-cap/f1_full.py 0,1,2 > OUT.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import load_dataset, run_mode, token_f1
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import build_case
from ragfuse.shared_data import shared_data

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import k_shift_mass_cap  # noqa: E402  (a script, not a module of the package)


def main() -> None:
    shipped = json.loads((ROOT / "results/fusion-quality/musique-all-noise-floor/results.json").read_text())["cases"]
    examples = load_dataset(shared_data("musique_dev.json"), 75, 6)
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", device="cpu"))
    builder = RagPromptBuilder(engine.tokenizer)
    k_shift_mass_cap.install()
    k_shift_mass_cap.STATE.update(cfg="cap2", diag=None)
    policy = SelectionPolicy.default().with_ratio(0.15)
    for i in [int(x) for x in sys.argv[1].split(",")]:
        case = build_case(engine, builder, examples[i].passages, examples[i].question, 16)
        full_answer = engine.tokenizer.decode(case.answer_ids, skip_special_tokens=True).strip()
        k_shift_mass_cap.STATE["layer"] = 0
        out = run_mode(engine, case, "fuse", policy, 16)
        ref = shipped[i]
        print(json.dumps({"case": i, "full_same_as_eval": full_answer == ref["full_answer"],
                          "kl_tf": out["kl_tf"], "cap2_answer": out["answer"],
                          "f1_full_cap2": token_f1(out["answer"], full_answer),
                          "f1_full_shipped": token_f1(ref["modes"]["fuse"]["answer"], ref["full_answer"])}), flush=True)


if __name__ == "__main__":
    main()
