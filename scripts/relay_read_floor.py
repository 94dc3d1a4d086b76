"""How fast can any kernel merely read relay's bytes? A lower bound for issue 6's attention-op goal.

The goal asks relay (b=32, s=2K, c=128) to run at 90% of p = (s+c+2g)/(s/b+c+7g) times our paged
kernel over per-request copies. Relay must read at least its bytes (the system K/V once, every
request's own K/V). This script times, in one process and on the same data sizes, with the L2 cache
cold at every call (the copies cycle as ``ragfuse bench relay`` cycles its cases):

- the paged kernel over per-request copies (the goal's baseline) and relay, as ``bench relay`` does;
- a pure read of relay's bytes: the fastest of a sweep of a streaming-sum Triton kernel's launch
  parameters, and ``torch.sum``. Nothing that reads those bytes can be faster than this;
- the time the goal allows relay (baseline / (0.9 p)).

Where the pure read alone takes longer than the goal allows, no relay kernel can reach the goal on
this GPU. Run on the GPU machine: ``python scripts/relay_read_floor.py OUT.json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import triton
import triton.language as tl

from ragfuse.bench.relay import _timer, cases, cycling, rotations, theoretical_speedup

LAYOUTS = {"llama-2-7b": (32, 32), "mistral-7b": (32, 8)}  # (query heads, KV heads), head dim 128


@triton.jit
def _stream_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS consecutive blocks of BLOCK elements (the result is written, so the
    loads are not dropped)."""
    start = tl.program_id(0) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def stream_sum(x: torch.Tensor, out: torch.Tensor, block: int, iters: int, warps: int) -> torch.Tensor:
    grid = (triton.cdiv(x.numel(), block * iters),)
    _stream_sum[grid](x, out, x.numel(), BLOCK=block, ITERS=iters, num_warps=warps)
    return out


def read_floor(nbytes: int, timer: Any, device: torch.device) -> dict[str, Any]:
    """The fastest full read of ``nbytes`` (bf16), L2-cold at every call: (microseconds, how)."""
    n = nbytes // 2
    bufs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(max(2, rotations(nbytes, device)))]
    want = float(bufs[0].float().sum())
    best: dict[str, Any] = {"us": float("inf")}
    for block in (1024, 2048, 4096, 8192):
        for iters in (1, 2, 4, 8):
            for warps in (4, 8):
                out = torch.empty(triton.cdiv(n, block * iters), device=device, dtype=torch.float32)
                got = float(stream_sum(bufs[0], out, block, iters, warps).sum())
                assert abs(got - want) <= 1e-3 * max(1.0, abs(want)) + 1.0, (got, want)
                us = 1e3 * timer(cycling([lambda b=b, o=out, k=block, i=iters, w=warps: stream_sum(b, o, k, i, w)
                                          for b in bufs]))
                if us < best["us"]:
                    best = {"us": us, "how": f"triton stream sum, block {block}, {iters} blocks/program, {warps} warps"}
    us = 1e3 * timer(cycling([lambda b=b: b.sum(dtype=torch.float32) for b in bufs]))
    if us < best["us"]:
        best = {"us": us, "how": "torch.sum"}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--point", default="2048:128:32", help="s:c:b")
    args = ap.parse_args()
    s, c, b = (int(x) for x in args.point.split(":"))
    device = torch.device("cuda")
    timer = _timer(device)
    rows = []
    for shape, (heads, kvh) in LAYOUTS.items():
        shared, with_copies = cases(heads, kvh, 128, s, c, b, device, torch.bfloat16)
        one = shared[0]
        g = heads // kvh
        p = theoretical_speedup(s, c, b, g)
        copies_us = 1e3 * timer(cycling([x.paged_copies for x in with_copies]))
        relay_us = 1e3 * timer(cycling([x.relay for x in shared]))
        floor = read_floor(one.relay_bytes, timer, device)
        allowed = copies_us / (0.9 * p)
        row = {"shape": shape, "s": s, "c": c, "b": b, "p": round(p, 3), "relay_bytes": one.relay_bytes,
               "paged_copies_us": round(copies_us, 2), "relay_us": round(relay_us, 2),
               "goal_allows_us": round(allowed, 2), "read_floor_us": round(floor["us"], 2),
               "read_floor_how": floor["how"], "read_floor_tb_s": round(one.relay_bytes / floor["us"] / 1e6, 3),
               "floor_within_goal": floor["us"] <= allowed,
               "speedup": round(copies_us / relay_us, 3), "share_of_p": round(copies_us / relay_us / p, 3),
               "best_possible_share_of_p": round(copies_us / floor["us"] / p, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
