"""Fused passes whose active set passes 1024 rows (fuse at r = 50% and 70%, prefix: 2592 rows), CPU tier,
random-weight SHAPE, 6 x 512 + 32 tokens: replayed from the fusion graphs (now that their steady capacities go to
4096 rows) against the same pass run eagerly (no graphs: as every pass past 1024 rows ran before), in rotating
order over 9 rounds, medians; fuse at 15% and full prefill beside them. Also the selections' agreement and the
GPU memory the allocator holds before and after the larger captures. Usage: large_active_ab.py [SHAPE]"""
from __future__ import annotations

import json
import statistics
import sys

import torch

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine.fusion import SelectionPolicy  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
graphs = runner.fusion_graphs
pol = SelectionPolicy.default()
cases = {"fuse@50%": ("fuse", 0.5), "fuse@70%": ("fuse", 0.7), "prefix": ("prefix", 0.0)}
prompt.run("cpu", "fuse", pol.with_ratio(0.15))
mem = {"reserved_before_GiB": torch.cuda.memory_reserved() / 2**30}
same = {}
for name, (mode, r) in cases.items():
    runner.fusion_graphs = graphs
    replays = graphs.replays
    prompt.run("cpu", mode, pol.with_ratio(r))  # captures
    g = prompt.run("cpu", mode, pol.with_ratio(r))
    mem[f"{name}_replayed_layers"] = graphs.replays - replays
    runner.fusion_graphs = None
    e = prompt.run("cpu", mode, pol.with_ratio(r))
    if g.recomputed_positions is not None and e.recomputed_positions is not None:
        a, b = set(g.recomputed_positions.tolist()), set(e.recomputed_positions.tolist())
        same[name] = round(len(a & b) / max(1, len(a | b)), 4)
mem["reserved_after_GiB"] = torch.cuda.memory_reserved() / 2**30
variants = [(f"{name} {how}", mode, r, how) for name, (mode, r) in cases.items() for how in ("graphs", "eager")]
variants += [("fuse@15% graphs", "fuse", 0.15, "graphs")]
t = {v[0]: [] for v in variants}
for i in range(9):
    for name, mode, r, how in variants[i % len(variants):] + variants[: i % len(variants)]:
        runner.fusion_graphs = graphs if how == "graphs" else None
        t[name].append(prompt.run("cpu", mode, pol.with_ratio(r)).total_s * 1e3)
runner.fusion_graphs = graphs
t["full"] = [prompt.run("cpu", "full", pol).total_s * 1e3 for _ in range(5)]
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({"shape": shape, "median_ms": med, "selection_jaccard_graphs_vs_eager": same, "memory": mem,
                  "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
