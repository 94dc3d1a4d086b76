"""Scratch: cuBLAS at M in {384, 416, 448, 512} rows for Mistral-7B's four weight shapes (bf16, weights
L2-cold by cycling copies), and a plain Triton GEMM (x @ W^T) at 416 rows over a few tilings."""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "results/fusion-h200-1130k")
from gemm_libraries import COPIES, bench, dev, shapes  # noqa: E402


@triton.jit
def _mm(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    gid = pid // per_group
    first_m = gid * GROUP
    gsize = min(n_m - first_m, GROUP)
    pm = first_m + (pid % per_group) % gsize
    pn = (pid % per_group) // gsize
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * stride_am + rk[None, :]
    w = w_ptr + rn[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K, BK):
        x = tl.load(a, mask=rm[:, None] < M, other=0.0)
        y = tl.load(w)
        acc = tl.dot(x, y, acc)
        a += BK
        w += BK
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=rm[:, None] < M)


def mm(a, w, out, bm, bn, bk, group, warps, stages):
    M, K = a.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _mm[grid](a, w, out, M, N, K, a.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=group,
              num_warps=warps, num_stages=stages)
    return out


for name, (K, N) in shapes.items():
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    for M in (384, 416, 448, 512):
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        us = bench(lambda i=0, a=a, ws=ws: torch.nn.functional.linear(a, ws[i]))
        print(json.dumps({"shape": name, "M": M, "impl": "cublas", "us": round(us, 1),
                          "tflops_real": round(2 * M * N * K / us / 1e6, 1)}), flush=True)
    M = 416
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(a, ws[0]).float()
    best = None
    for bm, bn, bk, warps, stages, group in itertools.product((64, 128), (128, 256), (64,), (4, 8), (3, 4), (8,)):
        if bm == 128 and bn == 256 and warps == 4:
            continue
        try:
            mm(a, ws[0], out, bm, bn, bk, group, warps, stages)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            us = bench(lambda i=0, a=a, ws=ws, out=out, c=(bm, bn, bk, group, warps, stages): mm(a, ws[i], out, *c))
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"shape": name, "cfg": [bm, bn, bk, warps, stages], "error": str(e)[:120]}))
            continue
        row = {"shape": name, "M": M, "impl": "triton", "cfg": [bm, bn, bk, warps, stages, group], "us": round(us, 1),
               "tflops_real": round(2 * M * N * K / us / 1e6, 1), "err": round(err, 4)}
        if best is None or us < best["us"]:
            best = row
        print(json.dumps(row), flush=True)
    print("BEST", json.dumps(best), flush=True)
