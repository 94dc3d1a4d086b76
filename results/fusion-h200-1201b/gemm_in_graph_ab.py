"""A/B in one process of fuse@15% (CPU tier, random-weight SHAPE, 6 x 512 + 32 tokens): graphs whose products'
BLAS libraries were chosen by timing each library's call captured in a graph (shipped) against graphs whose
choices were timed as eager calls (``gemm_library._measure`` before, kept here as ``eager_measure``), and a
second set with the shipped choices as control; rotating order over 20 rounds, medians. Prints each set's
choices (rows, out, in -> library). Usage: gemm_in_graph_ab.py [SHAPE]"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine import gemm_library  # noqa: E402
from ragfuse.engine.fusion import SelectionPolicy  # noqa: E402
from ragfuse.engine.fusion.graphs import FusionGraphs  # noqa: E402


def eager_measure(x, weight, bias):
    """The choice as made before: each library's eager call timed L2-cold, alternating, medians of 7."""
    flush = torch.empty(2 * torch.cuda.get_device_properties(x.device).L2_cache_size, dtype=torch.uint8,
                        device=x.device)
    try:
        with gemm_library._library("cublaslt"):
            F.linear(x, weight, bias)
    except RuntimeError:
        return "cublas"
    times = {"cublas": [], "cublaslt": []}
    for i in range(8):
        for name, taken in times.items():
            with gemm_library._library(name):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                F.linear(x, weight, bias)
                end.record()
                end.synchronize()
            if i:
                taken.append(start.elapsed_time(end))
    lt = statistics.median(times["cublaslt"]) <= gemm_library.MARGIN * statistics.median(times["cublas"])
    return "cublaslt" if lt else "cublas"


shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
pol = SelectionPolicy.default()


def graphs():
    return FusionGraphs(runner.model, runner.kv_cache.layers, runner.block_size, runner.max_model_len, runner.device,
                        runner.graphs.pool)


sets, choices, first = {}, {}, {}
shipped_measure = gemm_library._measure
for name, measure in (("in_graph", shipped_measure), ("eager", eager_measure), ("in_graph2", None)):
    gemm_library._chosen.clear()  # every size measured again the variant's way (other graphs are captured already)
    if measure is None:  # the control: the first set's choices, not measured again
        gemm_library._chosen.update(choices["in_graph"])
    else:
        gemm_library._measure = measure
    sets[name] = runner.fusion_graphs = graphs()
    prompt.run("cpu", "fuse", pol)  # captures, measuring what is new
    gemm_library._measure = shipped_measure
    choices[name] = dict(gemm_library._chosen)
    first[name] = prompt.run("cpu", "fuse", pol).recomputed_positions.cpu()
t = {k: [] for k in sets}
names = list(sets)
for r in range(20):
    for name in names[r % len(names):] + names[: r % len(names)]:
        runner.fusion_graphs = sets[name]
        t[name].append(prompt.run("cpu", "fuse", pol).total_s * 1e3)
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({
    "shape": shape, "median_ms": med,
    "same_selection": {k: bool(torch.equal(v, first["in_graph"])) for k, v in first.items()},
    "choices": {k: sorted(f"{key[1]}x{key[2]}x{key[3]}:{lib}" for key, lib in v.items()) for k, v in choices.items()},
    "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
