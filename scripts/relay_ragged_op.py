"""Relay decode's attention at a point like the end-to-end run's, against our paged kernel over the
shared system blocks: Mistral-7B layout (32 query / 8 KV heads), a 2048-token system prompt, ``B``
sequences whose own lengths are ShareGPT first-turn prompts plus a random part of their answers (ragged,
4 to 640 tokens), the K/V out of L2 at every call (4 data copies cycled), medians of CUDA-graph replays.
Also relay under other context/system split counts and launch parameters (results/relay-h100-1126c).

Run on a CUDA machine: ``python scripts/relay_ragged_op.py OUT.json SHAREGPT.jsonl [--batch 64]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch
import triton.testing

from ragfuse.bench.relay import cycling, rel_err, workload
from ragfuse.engine.attention import RelayMetadata
from ragfuse.kernels.paged_attention_triton import paged_decode_attention_triton
from ragfuse.kernels.relay import tile_tokens_for
from ragfuse.kernels.relay_triton import DEFAULT_TUNING, relay_context_splits, relay_decode_attention_triton

HEADS, KV_HEADS, HEAD_DIM, SYSTEM, PAGE = 32, 8, 128, 2048, 16
BOUND = 2700  # the engine's context bound in the end-to-end run: split counts come from it
VARIANTS: dict[str, dict[str, Any]] = {
    "context splits 1": {"num_splits": 1}, "context splits 2": {"num_splits": 2},
    "context splits 4": {"num_splits": 4}, "context tiles 128": {"ctx_block_n": 128},
    "context tiles 32": {"ctx_block_n": 32}, "system splits 2": {"sys_splits": 2},
    "system splits 8": {"sys_splits": 8}, "system tiles 128": {"sys_block_n": 128},
    "3 stages": {"num_stages": 3}, "8 warps": {"num_warps": 8}, "one stream": {"streams": 1},
}


class Batch:
    """One copy of the cache data: system blocks shared by every sequence, then each one's own."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        own = [-(-n // PAGE) for n in lens]
        sys_blocks, width = SYSTEM // PAGE, max(own)
        blocks = sys_blocks + sum(own)
        self.k = torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        perm = torch.randperm(blocks, device=device, dtype=torch.int32)
        self.own = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
        start = sys_blocks
        for i, n in enumerate(own):
            self.own[i, :n] = perm[start : start + n]
            start += n
        self.full = torch.cat([perm[:sys_blocks].expand(len(lens), -1), self.own], dim=1).contiguous()
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = torch.randn(len(lens), HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.meta = RelayMetadata.build([0] * len(lens), tile_tokens_for(HEADS // KV_HEADS),
                                        perm[:sys_blocks][None].contiguous(),
                                        torch.tensor([SYSTEM], dtype=torch.int32, device=device), SYSTEM, device)
        self.scale = HEAD_DIM**-0.5

    def paged(self) -> Any:
        return paged_decode_attention_triton(self.q, self.k, self.v, self.full, self.lens + SYSTEM, self.scale,
                                             max_seq_len=BOUND)

    def relay(self, num_splits: int | None = None, sys_splits: int | None = None, **tuning: Any) -> Any:
        m = self.meta
        return relay_decode_attention_triton(
            self.q, self.k, self.v, self.own, self.lens, m.sys_tables, m.sys_lens, m.tile_tokens, m.tile_system,
            self.scale, BOUND, SYSTEM, num_splits=num_splits, sys_splits=sys_splits,
            tuning=dataclasses.replace(DEFAULT_TUNING, **tuning))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("data")
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    lens = [n + int(torch.randint(0, o, (1,), generator=g)) for n, o in workload(a.data, a.batch, 512, 128)]
    copies = [Batch(lens, device) for _ in range(4)]
    want = copies[0].paged()
    rows: list[dict[str, Any]] = []

    def record(name: str, call: Any) -> None:
        ms = float(triton.testing.do_bench_cudagraph(cycling([lambda b=b: call(b) for b in copies]), rep=30,
                                                    return_mode="median"))
        rows.append({"variant": name, "us": round(ms * 1e3, 2), "rel_err": rel_err(call(copies[0]), want)})
        print(rows[-1], flush=True)

    record("paged, shared system blocks", Batch.paged)
    record(f"relay (context splits {relay_context_splits(a.batch, KV_HEADS, BOUND, device)})", Batch.relay)
    for name, options in VARIANTS.items():
        record(f"relay, {name}", lambda b, o=options: b.relay(**o))
    with open(a.out, "w") as f:
        json.dump({"batch": a.batch, "lens": lens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
