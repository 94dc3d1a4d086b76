"""A/B of fuse@15% (CPU tier, random-weight SHAPE): graphs whose layers leave their outputs in the static buffers
(the residual summed in place, the hidden state written there by the down projection: shipped) against graphs
captured the way they were before (a new residual per norm, then a copy of the hidden state and of the residual
into the static buffers after each layer; check layers as shipped plus those two copies). A second shipped set is
the control. Variants in rotating order over 20 rounds, medians; full prefill after them.
Usage: inplace_ab.py [SHAPE]"""
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
from ragfuse.engine.fusion.layer_step import back  # noqa: E402


class CopyingGraphs(FusionGraphs):
    """The layers' outputs copied into the static buffers, as before (captured with norms that allocate)."""

    def _step(self, layer, mass_cap, cap):
        q, _, _, residual, _ = self._front_call(layer, cap.rows, cap, keep=False, mass_cap=mass_cap)
        self._back_call(layer, cap.rows, q, residual)

    def _first(self, shape, cap):
        q, _, _, residual, _ = self._front_call(shape.layer, shape.rows, cap, keep=False, shift=False)
        self._back_call(shape.layer, shape.rows, q, residual)

    def _back_call(self, layer, rows, q, residual=None):
        residual = self.residual[:rows] if residual is None else residual
        hidden, residual = back(self.model.model.layers[layer], self.kv_caches[layer], q, residual,
                                self.positions[:rows], self.table, 0, self.slots, self.bounds, None)
        self.hidden[:rows].copy_(hidden)
        self.residual[:rows].copy_(residual)


shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
pol = SelectionPolicy.default()
shipped_norm = ops.fused_add_rms_norm


def allocating_norm(x, residual, weight, eps, in_place=False):
    return shipped_norm(x, residual, weight, eps)


def graphs(cls):
    return cls(runner.model, runner.kv_cache.layers, runner.block_size, runner.max_model_len, runner.device,
               runner.graphs.pool)


variants = {"in_place": runner.fusion_graphs, "in_place2": graphs(FusionGraphs), "copies": graphs(CopyingGraphs)}
first = {}
for name, g in variants.items():
    runner.fusion_graphs = g
    ops.fused_add_rms_norm = allocating_norm if name == "copies" else shipped_norm
    prompt.run("cpu", "fuse", pol)  # captures
    ops.fused_add_rms_norm = shipped_norm
    out = prompt.run("cpu", "fuse", pol)
    first[name] = out.recomputed_positions.cpu()
same = {k: bool(torch.equal(v, first["in_place"])) for k, v in first.items()}
t = {k: [] for k in variants}
names = list(variants)
for r in range(20):
    for name in names[r % len(names):] + names[: r % len(names)]:
        runner.fusion_graphs = variants[name]
        t[name].append(prompt.run("cpu", "fuse", pol).total_s * 1e3)
runner.fusion_graphs = variants["in_place"]
t["full"] = [prompt.run("cpu", "full", pol).total_s * 1e3 for _ in range(7)]
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({"shape": shape, "median_ms": med, "vs_full": {k: round(med["full"] / v, 3) for k, v in med.items()},
                  "same_selection": same, "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
