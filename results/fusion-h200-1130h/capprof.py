"""Where the mass cap's time goes: GPU kernels of fuse@15% from the CPU tier with and without it
(random-weight shape, bf16, 6 x 512 + 32), by torch.profiler. Usage: capprof.py SHAPE (run beside capcost.py)"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from ragfuse.engine.fusion import SelectionPolicy

sys.path.insert(0, str(Path(__file__).parent))
from capcost import cpu_tier_prompt  # noqa: E402

prompt = cpu_tier_prompt(sys.argv[1])
on = SelectionPolicy.default()
for name, pol in (("cap", on), ("nocap", replace(on, k_mass_cap=0.0))):
    for _ in range(3):
        prompt.run("cpu", "fuse", pol)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            prompt.run("cpu", "fuse", pol)
    print("=====", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
