"""A/B in one process of fuse@15% (CPU tier, random-weight SHAPE, 6 x 512 + 32 tokens): the K mass cap's walk
on a side stream beside the stale shift's segment means (shipped: ``ops.begin_k_mass_cap``), against both
launched after the means on the one stream as before (``sequential``), each with graphs of its own, a second
shipped set as control; rotating order over 20 rounds, medians. Usage: cap_overlap_ab.py [SHAPE]"""
from __future__ import annotations

import json
import statistics
import sys

import torch

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine.fusion import SelectionPolicy, layer_step  # noqa: E402
from ragfuse.engine.fusion.graphs import FusionGraphs  # noqa: E402
from ragfuse.kernels.mass_direction_triton import cap_k_shift_triton  # noqa: E402


def sequential(index, q, k_st, at, rotary, scale):
    """The cap's two launches after the means, on the one stream."""
    cap = index.cap
    return lambda mk: cap_k_shift_triton(mk, q.index_select(0, cap.rows), cap.ok, k_st, at, rotary.cos, rotary.sin,
                                         cap.bounds, cap.limit, scale)


shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
pol = SelectionPolicy.default()
shipped = layer_step.begin_k_mass_cap


def graphs():
    return FusionGraphs(runner.model, runner.kv_cache.layers, runner.block_size, runner.max_model_len, runner.device,
                        runner.graphs.pool)


capping = {"overlapped": shipped, "overlapped2": shipped, "sequential": sequential}
sets = {"overlapped": runner.fusion_graphs, "overlapped2": graphs(), "sequential": graphs()}


def run(name: str):
    layer_step.begin_k_mass_cap = capping[name]
    runner.fusion_graphs = sets[name]
    try:
        return prompt.run("cpu", "fuse", pol)
    finally:
        layer_step.begin_k_mass_cap = shipped


first = {}
for name in sets:
    run(name)  # captures
    first[name] = run(name).recomputed_positions.cpu()
t = {k: [] for k in sets}
names = list(sets)
for r in range(20):
    for name in names[r % len(names):] + names[: r % len(names)]:
        t[name].append(run(name).total_s * 1e3)
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({"shape": shape, "median_ms": med,
                  "same_selection": {k: bool(torch.equal(v, first["sequential"])) for k, v in first.items()},
                  "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
