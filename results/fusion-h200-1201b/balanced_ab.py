"""Attention of cache fusion's passes, the shipped per-tile grid against key steps balanced over the programs
(``kernels/balanced_prefill_triton.py``, forced with ``balance=True``), each call in a CUDA graph timed by
triton's do_bench (L2 flushed before every replay, medians). Mistral-7B layout (32 query heads, 8 KV heads,
head_dim 128, bf16, pages of 16), a 3104-token prompt whose first 512 tokens are an exact prefix: the rows of
fuse@15%'s layers (2592 contiguous, then 1184 ... 416 scattered), prefix (2592), full (3104, no positions)
and reuse (32).
Usage: balanced_ab.py OUT.json"""
from __future__ import annotations

import functools
import json
import sys

import torch
import triton.testing

from ragfuse.kernels.balanced_prefill_triton import sequence_prefill_attention_triton
from ragfuse.kernels.paged_attention_triton import _sm_count, paged_prefill_attention_triton

torch.manual_seed(0)
dev = torch.device("cuda")
N, H, KVH, D, PAGE = 3104, 32, 8, 128, 16
blocks = N // PAGE + 8
k_cache = torch.randn(blocks, PAGE, KVH, D, dtype=torch.bfloat16, device=dev)
v_cache = torch.randn_like(k_cache)
table = torch.randperm(blocks, device=dev)[: N // PAGE + 1].to(torch.int32)[None]
lens = torch.tensor([N], dtype=torch.int32, device=dev)
sms = _sm_count(dev)


def positions(rows: int) -> torch.Tensor | None:
    if rows == N:
        return None
    if rows in (2592, 32):
        return torch.arange(N - rows, N, device=dev)
    picks = torch.randperm(N - 32 - 512, device=dev)[: rows - 32] + 512
    return torch.cat([picks.sort().values, torch.arange(N - 32, N, device=dev)])


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def variants(rows: int) -> dict:
    q = torch.randn(rows, H, D, dtype=torch.bfloat16, device=dev)
    common = (q, k_cache, v_cache, table, lens, torch.tensor([0, rows], dtype=torch.int32, device=dev), D**-0.5, None)
    at = {"max_query_len": rows, "q_positions": positions(rows)}
    out = {"shipped": functools.partial(paged_prefill_attention_triton, *common, max_seq_len=N, **at)}
    for programs, steps in [(sms, 4), (sms, 2), (sms, 8), (2 * sms, 4)]:
        out[f"balanced p={programs} min={steps}"] = functools.partial(
            sequence_prefill_attention_triton, *common, balance=True, num_programs=programs,
            min_steps=steps, **at)
    return out


result = {}
for rows in [32, 416, 608, 800, 992, 1184, 2592, 3104]:
    row = {}
    ref = None
    for name, fn in variants(rows).items():
        g, (out, lse) = graphed(fn)
        g.replay()
        torch.cuda.synchronize()
        if ref is None:
            ref = (out.float().clone(), lse.clone())
        err = float((out.float() - ref[0]).abs().max()), float((lse - ref[1]).abs().max())
        times = [triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3
                 for _ in range(3)]
        row[name] = {"us": round(sorted(times)[1], 2), "max_abs_out": err[0], "max_abs_lse": err[1]}
        print(rows, name, row[name], flush=True)
    result[rows] = row
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
