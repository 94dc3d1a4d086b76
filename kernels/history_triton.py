"""``write_history_ref`` in one Triton launch: each token's stored K rotated to its position and
written with its V into the cache pages, slot and position computed in the kernel.

A session turn writes one layer of history this way before each layer of its forward, from the host
loop that launches the layers' graphs; as a rotation (a launch, a fresh output tensor), a slot
computation and a write it cost the loop two Triton launches, an allocation and ~20 MB of extra
traffic a layer at a 4K history (the rotated K written out and read back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_history_kernel(
    kv_ptr, rows_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, table_ptr, n_heads,
    stride_kvs, stride_kvt, stride_kvh, stride_cos, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    """Program (token): all heads of token ``t``'s K (rotated to position ``t``) and V."""
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + token).to(tl.int64) if HAS_ROWS else token
    page = tl.load(table_ptr + token // PAGE).to(tl.int64)
    in_page = token % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < n_heads) & d_mask[None, :]
    c = tl.load(cos_ptr + token * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + token * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    src = kv_ptr + row * stride_kvt + offs_h[:, None] * stride_kvh + offs_d[None, :]
    k1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(src + stride_kvs, mask=mask, other=0.0)
    v2 = tl.load(src + stride_kvs + HALF, mask=mask, other=0.0)
    dst_k = k_cache_ptr + page * stride_kb + in_page * stride_ks + offs_h[:, None] * stride_kh + offs_d[None, :]
    dst_v = v_cache_ptr + page * stride_vb + in_page * stride_vs + offs_h[:, None] * stride_vh + offs_d[None, :]
    ty = k_cache_ptr.dtype.element_ty
    tl.store(dst_k, (k1 * c - k2 * s).to(ty), mask=mask)
    tl.store(dst_k + HALF, (k2 * c + k1 * s).to(ty), mask=mask)
    tl.store(dst_v, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_history_triton(
    kv: torch.Tensor, num_tokens: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor | None = None,
) -> None:
    """Same contract as ``write_history_ref``."""
    _, _, heads, head_dim = kv.shape
    if num_tokens == 0:
        return
    if kv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("stored KV and the cache must have a unit stride over head_dim")
    if not cos.is_contiguous():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    _write_history_kernel[(num_tokens,)](
        kv, rows if rows is not None else block_table, cos, sin, k_cache, v_cache, block_table, heads,
        kv.stride(0), kv.stride(1), kv.stride(2), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        PAGE=k_cache.shape[1], HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(heads), HAS_ROWS=rows is not None, num_warps=4,
    )
