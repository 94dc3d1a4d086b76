"""Matrix-vector product for one row of input, in Triton: a decode step at batch 1 reads every weight
once and does almost no arithmetic, so it runs at the speed weights stream from memory.

cuBLAS's kernels for one row leave bandwidth unused on some of a 7B model's shapes: on an H100, in a
real decode step (weights cold in L2), the 4096x4096 output projection ran at 1.6 TB/s, because its
kernel gave the 132 SMs too few tiles. Here each program owns ``BLOCK_N`` output rows and walks the
whole K dimension (no split-K, so no second reduction kernel), so an N of 4096 makes 512 programs.
Tile sizes were picked on the H100 by ``scripts/profile_engine.py`` (kernels/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # reduced once at the end, not per tile
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_mask)


def gemv_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), measured best on an H100 per Mistral-7B shape: long rows
    (the down projection's K of 14336) and wide outputs (the 32000-row head) take narrower, longer
    tiles; the rest 8 rows of 512."""
    return (4, 1024, 4, 4) if k > 8192 or n >= 32000 else (8, 512, 4, 3)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as ``gemv_ref``: ``x`` holds a single row of K values."""
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv takes one row of {k} values, got shape {tuple(x.shape)}")
    xv = x.reshape(k)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block_n, block_k, warps, stages = gemv_tiles(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        xv, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return y
