"""Matmul of a few rows (a batched decode step, 2 to 64 sequences) by a linear layer's weight, in Triton.

At such row counts a decode step still reads every weight once and does little arithmetic per byte,
so its matmuls run at the speed the weights stream from memory. cuBLAS's kernels for 16-64 rows leave
some of that speed unused on a 7B model's shapes (on an H100, weights cold in L2: the 32000-row head
at 2.5-2.7 TB/s, the down projection at 2.4-2.6), while one program per ``BLOCK_N`` output columns,
walking the whole K dimension with every row in one tile, streams them at up to 2.9 TB/s. No split of
K, so no second reduction and no atomics: a CUDA graph replay gives the eager call's bits.

Tiles come from ``scripts/skinny_gemm_sweep.py`` on an H100 (kernels/NOTES.md) and are kept only for
the (shape, row count) pairs where they beat cuBLAS by 2% or more; everything else stays on cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .paged_attention_triton import _dot_precision

MAX_ROWS = 64  # more rows are matmul work enough for cuBLAS's own kernels

# (N, K) of the weight -> {rows bucket: (BLOCK_N, BLOCK_K, warps, stages)}; a bucket holds the row
# counts up to it (16, 32, 64). Mistral-7B and Llama-2-7B (Llama-3-8B shares Mistral's layers) first.
_TILES: dict[tuple[int, int], dict[int, tuple[int, int, int, int]]] = {
    (6144, 4096): {16: (64, 128, 4, 6), 32: (64, 128, 4, 6)},  # qkv, 8 KV heads
    (12288, 4096): {32: (128, 128, 4, 4)},  # qkv, 32 KV heads
    (4096, 4096): {16: (32, 256, 4, 4)},  # o
    (28672, 4096): {32: (128, 128, 4, 4), 64: (128, 128, 4, 3)},  # gate_up, 14336
    (22016, 4096): {16: (64, 128, 4, 3), 64: (32, 128, 4, 3)},  # gate_up, 11008
    (4096, 14336): {16: (32, 256, 4, 6), 32: (32, 256, 4, 6), 64: (32, 256, 4, 4)},  # down, 14336
    (4096, 11008): {16: (32, 256, 4, 4), 32: (32, 256, 4, 4), 64: (32, 256, 4, 4)},  # down, 11008
    (32000, 4096): {16: (128, 128, 4, 3), 32: (128, 128, 4, 4), 64: (128, 128, 4, 3)},  # head
    (128256, 4096): {16: (64, 256, 4, 4), 32: (128, 128, 4, 4), 64: (128, 128, 4, 3)},  # Llama-3 head
    # Qwen2-7B's bias-free layers (its qkv has a bias: cuBLAS)
    (3584, 3584): {16: (32, 128, 4, 6)},
    (37888, 3584): {16: (64, 128, 4, 4), 32: (32, 256, 4, 3), 64: (64, 128, 4, 6)},
    (3584, 18944): {16: (32, 256, 4, 6), 32: (32, 256, 4, 6), 64: (32, 128, 4, 6)},
    (152064, 3584): {16: (128, 256, 4, 3), 32: (128, 128, 4, 4), 64: (128, 128, 4, 4)},
    # Yi-34B (its qkv stays on cuBLAS, 1-3% faster there)
    (7168, 7168): {16: (64, 256, 4, 4)},
    (40960, 7168): {16: (64, 256, 4, 4), 32: (64, 256, 4, 4), 64: (64, 128, 4, 6)},
    (7168, 20480): {16: (64, 256, 4, 4), 32: (64, 256, 4, 4), 64: (64, 128, 4, 6)},
    (64000, 7168): {16: (32, 256, 4, 6), 32: (128, 128, 4, 4), 64: (64, 128, 4, 3)},
}


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def rows_bucket(m: int) -> int:
    """The tile table's bucket for ``m`` rows: 16, 32 or 64 (the kernel's row tile)."""
    return max(16, triton.next_power_of_2(m))


@functools.cache
def _measured_here(device_index: int) -> bool:
    """The table was measured on Hopper (H100; the H200 is the same chip): elsewhere cuBLAS stays."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def skinny_tiles(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int] | None:
    """Measured tiles for ``x @ weight.T`` on this device, or None where cuBLAS is as fast or unmeasured."""
    m = x.numel() // x.shape[-1]
    if not 2 <= m <= MAX_ROWS or weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return None
    by_rows = _TILES.get(tuple(weight.shape))
    if by_rows is None or not x.is_cuda or not _measured_here(x.device.index or 0):
        return None
    return by_rows.get(rows_bucket(m))


def skinny_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [..., K] of 1 to ``MAX_ROWS`` rows (``gemv_ref``'s contract with more
    rows), with ``tiles`` (BLOCK_N, BLOCK_K, warps, stages), by default ``skinny_tiles``'s."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if x.shape[-1] != k or not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows of {k} values, got shape {tuple(x.shape)}")
    tiles = tiles or skinny_tiles(x, weight) or (64, 64, 4, 3)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block_n, block_k, warps, stages = tiles
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        rows, weight, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=rows_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k,
        PREC=_dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    return y.view(*x.shape[:-1], n)
