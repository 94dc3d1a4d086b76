"""A/B in one process of fuse@15% and full prefill (CPU tier, random-weight SHAPE, 6 x 512 + 32 tokens): one
sequence's attention as ``attend`` calls it (shipped: key steps balanced over the multiprocessors where the
per-tile grid is under 1.5 waves; a first run balanced every grid) against the per-tile grid
before it (``paged_prefill_attention_triton`` as ``attend`` called it), each with graphs of its own, a second
shipped set as control, and (``eager_embed``) the shipped attention with the tokens embedded eagerly before layer
0's graph, as before it embedded them itself (the fusor's source with those lines put back, graphs without the
embedding); rotating order over 20 rounds, medians. Usage: pass_ab.py [SHAPE]"""
from __future__ import annotations

import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine import model_runner  # noqa: E402
from ragfuse.engine.attention import layer  # noqa: E402
from ragfuse.engine.fusion import (
    SelectionPolicy,  # noqa: E402
    fusor,  # noqa: E402
)
from ragfuse.engine.fusion.graphs import FirstShape, FusionGraphs  # noqa: E402
from ragfuse.engine.fusion.graphs import _Capacity as Capacity  # noqa: E402
from ragfuse.kernels.paged_attention_triton import paged_prefill_attention_triton  # noqa: E402

shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
prompt = cpu_tier_prompt(shape)
runner = prompt.engine.runner
pol = SelectionPolicy.default()
balanced = layer.sequence_prefill_attention_triton


def per_tile(q, k_cache, v_cache, table, lens, cu, scale, window, max_query_len, q_positions):
    # one split, as before at these prompts: graphs passed no length (0) and 3104 keys never split
    return paged_prefill_attention_triton(q, k_cache, v_cache, table, lens, cu, scale, window,
                                          max_query_len=max_query_len, q_positions=q_positions)


class EagerEmbedGraphs(FusionGraphs):
    """Layer 0's graph without the embedding; ``begin`` stages the eagerly embedded tokens, as before."""

    def _first(self, shape: FirstShape, cap: Capacity) -> None:
        q, *_ = self._front_call(shape.layer, shape.rows, cap, keep=False, shift=False)
        self._back_call(shape.layer, shape.rows, q)

    def begin(self, hidden: torch.Tensor) -> None:
        self.hidden[: hidden.shape[0]].copy_(hidden)
        self.residual[: hidden.shape[0]].zero_()


def eager_embed_fusor():
    """``fuse_prefill`` as it was before layer 0's graph embedded the tokens."""
    src = Path(fusor.__file__).read_text()
    for old, new in [
        ('hidden = block.embed_tokens(dev["ids"]) if graph_from > 0 else None',
         'hidden = block.embed_tokens(dev["ids"])'),
        ('dev["bounds"], dev["fusable"] = graphs.first_inputs(first)',
         'dev["bounds"], dev["fusable"] = graphs.first_inputs(first)\n'
         '                dev["ids"] = graphs.staged.device["ids"][: len(first.ids)]'),
        ("            early = [*first_shapes, *check_shapes]",
         "            if graph_from == 0:\n                graphs.begin(hidden)\n"
         "            early = [*first_shapes, *check_shapes]"),
    ]:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    mod = types.ModuleType("ragfuse.engine.fusion.fusor_eager_embed")
    mod.__package__ = "ragfuse.engine.fusion"
    sys.modules[mod.__name__] = mod
    exec(compile(src, fusor.__file__, "exec"), mod.__dict__)
    return mod.fuse_prefill


def graphs(cls=FusionGraphs):
    return cls(runner.model, runner.kv_cache.layers, runner.block_size, runner.max_model_len, runner.device,
               runner.graphs.pool)


shipped_fusor = model_runner.fuse_prefill
kernels = {"balanced": balanced, "balanced2": balanced, "per_tile": per_tile, "eager_embed": balanced}
fusors = {"eager_embed": eager_embed_fusor()}
sets = {"balanced": runner.fusion_graphs, "balanced2": graphs(), "per_tile": graphs(),
        "eager_embed": graphs(EagerEmbedGraphs)}


def run(name: str, mode: str):
    layer.sequence_prefill_attention_triton = kernels[name]
    model_runner.fuse_prefill = fusors.get(name, shipped_fusor)
    runner.fusion_graphs = sets[name]
    try:
        return prompt.run("cpu", mode, pol)
    finally:
        layer.sequence_prefill_attention_triton = balanced
        model_runner.fuse_prefill = shipped_fusor


first = {}
for name in sets:
    run(name, "fuse")  # captures
    first[name] = run(name, "fuse").recomputed_positions.cpu()
same = {k: bool(torch.equal(v, first["per_tile"])) for k, v in first.items()}
t = {k: [] for k in sets}
names = list(sets)
for r in range(20):
    for name in names[r % len(names):] + names[: r % len(names)]:
        t[name].append(run(name, "fuse").total_s * 1e3)
for name in ("balanced", "per_tile"):
    run(name, "full")
for r in range(6):
    for name in ("balanced", "per_tile")[r % 2:] + ("balanced", "per_tile")[: r % 2]:
        t.setdefault(f"full {name}", []).append(run(name, "full").total_s * 1e3)
med = {k: round(statistics.median(v), 2) for k, v in t.items()}
print(json.dumps({"shape": shape, "median_ms": med, "same_selection_as_per_tile": same,
                  "runs": {k: [round(x, 2) for x in v] for k, v in t.items()}}), flush=True)
