"""A/B of fuse@15% (CPU tier, random-weight SHAPE) with its graphs captured under cuBLAS (two sets: a control),
under cuBLASLt for every product, and under cuBLASLt for given weight shapes only; the variants in rotating
order over 20 rounds, medians; full prefill after them (FULL=1: full in the rounds too). Run at 5031e94, before
``engine/gemm_library.py``, which now makes this choice itself at each capture.
Usage: fuse_ab_libraries.py SHAPE "OUTxIN,OUTxIN;OUTxIN" (each ;-separated set one cuBLASLt variant)"""
from __future__ import annotations

import json
import statistics
import sys

import torch

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine import ops  # noqa: E402
from ragfuse.engine.fusion import SelectionPolicy  # noqa: E402
from ragfuse.engine.fusion.graphs import FusionGraphs  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
pol = SelectionPolicy.default()
orig_linear = ops.linear
SETS = [{tuple(int(x) for x in s.split("x")) for s in group.split(",")} for group in
        (sys.argv[2].split(";") if len(sys.argv) > 2 else [])]


def lt_for(shapes):
    def linear(x, weight, bias):
        if tuple(weight.shape) in shapes and x.dim() == 2 and x.shape[0] > 64:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                return torch.nn.functional.linear(x, weight, bias)
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
        return orig_linear(x, weight, bias)
    return linear


def new_graphs():
    return FusionGraphs(runner.model, runner.kv_cache.layers, runner.block_size, runner.max_model_len, runner.device,
                        runner.graphs.pool)


weights = {tuple(p.shape) for n, p in runner.model.named_parameters() if p.dim() == 2}
print("weight shapes", sorted(weights), flush=True)
variants = {"cublas": (runner.fusion_graphs, None), "cublas2": (new_graphs(), None)}
all_shapes = weights
variants["lt_all"] = (new_graphs(), all_shapes)
for i, shapes in enumerate(SETS):
    variants[f"lt_{i}"] = (new_graphs(), shapes)
for g, shapes in variants.values():
    runner.fusion_graphs = g
    if shapes is not None:
        ops.linear = lt_for(shapes)
    prompt.run("cpu", "fuse", pol)  # captures
    ops.linear = orig_linear
t = {k: [] for k in [*variants, "full"]}
for _ in range(2):
    for g, _ in variants.values():
        runner.fusion_graphs = g
        prompt.run("cpu", "fuse", pol)
    prompt.run("cpu", "full", pol)
names = [*variants, *(["full"] if "FULL" in __import__("os").environ else [])]
for r in range(20):
    for name in names[r % len(names):] + names[: r % len(names)]:
        if name == "full":
            t["full"].append(prompt.run("cpu", "full", pol).total_s * 1e3)
            continue
        runner.fusion_graphs = variants[name][0]
        t[name].append(prompt.run("cpu", "fuse", pol).total_s * 1e3)
t = {k: v for k, v in t.items() if v}
if "full" not in t:
    t["full"] = [prompt.run("cpu", "full", pol).total_s * 1e3 for _ in range(7)]
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({"shape": shape, "median_ms": med, "vs_full": {k: round(med["full"] / v, 3) for k, v in med.items()},
                  "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
