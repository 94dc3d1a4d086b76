"""Stored KV into a layer's cache pages in Triton: same contracts as ``stored_kv``'s references.

``segment_shift_triton``: programs over blocks of the active rows (a few hundred to a few thousand)
sum the deviations of each segment the block holds, then one pass adds the blocks' sums in a fixed
order (no atomics: a graph replay gives the eager pass's bits). Active rows come in prompt order and
a segment is a run of positions, so a block of 64 rows holds one or two segments. On an H100, one
program per (segment, KV head) walking all rows took 79 us a layer (latency-bound dependent loads
over several waves), and a one-hot float32 matrix product per block 490 us.

``write_stored_kv_triton``: one program per stored row shifts K and V by the row's segment, rotates
K to its position and writes both to the row's slot, and, when asked, keeps the shifted K/V for the
check layer that compares them with the fresh ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 64  # active rows per program of the partial sums
_HALF_D = 64  # head_dim columns per program


@triton.jit
def _segment_partial_kernel(
    kn_ptr, vn_ptr, ks_ptr, vs_ptr, rows_ptr, seg_ptr, part_k_ptr, part_v_ptr, part_n_ptr, span_ptr,
    n_active, num_segments, n_heads, head_dim,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kst, stride_ksh, stride_vst, stride_vsh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row block, KV head, column block): per segment present in the block, the sums of
    (fresh - stored) K and V over its rows, to part_k/part_v [row block, segment, KVH, D], and its row
    count to part_n [row block, segment]; the block's segment range [lo, hi] to span [row block, 2]
    (the spare, rows without stored KV, left out)."""
    rb = tl.program_id(0)
    head = tl.program_id(1)
    cb = tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    spare = num_segments - 1
    seg = tl.load(seg_ptr + r, mask=r < n_active, other=spare)
    real = seg < spare
    lo = tl.min(tl.where(real, seg, num_segments), axis=0)
    hi = tl.max(tl.where(real, seg, -1), axis=0)
    first = (head == 0) & (cb == 0)
    if first:
        tl.store(span_ptr + 2 * rb, lo)
        tl.store(span_ptr + 2 * rb + 1, hi)
    row = tl.load(rows_ptr + r, mask=real, other=0).to(tl.int64)
    offs_d = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    m = real[:, None] & d_ok[None, :]
    r64 = r.to(tl.int64)
    kn = tl.load(kn_ptr + r64[:, None] * stride_knt + head * stride_knh + offs_d[None, :], mask=m, other=0.0)
    ks = tl.load(ks_ptr + row[:, None] * stride_kst + head * stride_ksh + offs_d[None, :], mask=m, other=0.0)
    vn = tl.load(vn_ptr + r64[:, None] * stride_vnt + head * stride_vnh + offs_d[None, :], mask=m, other=0.0)
    vs = tl.load(vs_ptr + row[:, None] * stride_vst + head * stride_vsh + offs_d[None, :], mask=m, other=0.0)
    dk = kn.to(tl.float32) - ks.to(tl.float32)
    dv = vn.to(tl.float32) - vs.to(tl.float32)
    for s in range(lo, hi + 1):
        mine = seg == s
        out = ((rb * num_segments + s) * n_heads + head) * head_dim + offs_d
        tl.store(part_k_ptr + out, tl.sum(tl.where(mine[:, None], dk, 0.0), axis=0), mask=d_ok)
        tl.store(part_v_ptr + out, tl.sum(tl.where(mine[:, None], dv, 0.0), axis=0), mask=d_ok)
        if first:
            tl.store(part_n_ptr + rb * num_segments + s, tl.sum(mine.to(tl.float32), axis=0))


@triton.jit
def _segment_mean_kernel(
    part_k_ptr, part_v_ptr, part_n_ptr, span_ptr, share_ptr, mk_ptr, mv_ptr, n_blocks, num_segments, n_heads,
    head_dim, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (KV head, column block): each segment's sums over the row blocks that hold it, added in
    block order (the same bits on every run, eager or replayed), times share / rows (K's share, then
    V's, at ``share_ptr``); zero for the spare and for segments without active rows."""
    head = tl.program_id(0)
    cb = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    offs_d = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = (offs_d < head_dim)[None, :]
    acc_k = tl.zeros([S_PAD, BLOCK_D], tl.float32)
    acc_v = tl.zeros([S_PAD, BLOCK_D], tl.float32)
    n = tl.zeros([S_PAD], tl.float32)
    for rb in range(0, n_blocks):
        have = (s >= tl.load(span_ptr + 2 * rb)) & (s <= tl.load(span_ptr + 2 * rb + 1))
        at = ((rb * num_segments + s[:, None]) * n_heads + head) * head_dim + offs_d[None, :]
        acc_k += tl.load(part_k_ptr + at, mask=have[:, None] & d_ok, other=0.0)
        acc_v += tl.load(part_v_ptr + at, mask=have[:, None] & d_ok, other=0.0)
        n += tl.load(part_n_ptr + rb * num_segments + s, mask=have, other=0.0)
    scale = tl.where(s < num_segments - 1, 1.0 / tl.maximum(n, 1.0), 0.0)[:, None]
    out = (s[:, None] * n_heads + head) * head_dim + offs_d[None, :]
    o_mask = d_ok & (s[:, None] < num_segments)
    tl.store(mk_ptr + out, acc_k * (scale * tl.load(share_ptr)), mask=o_mask)
    tl.store(mv_ptr + out, acc_v * (scale * tl.load(share_ptr + 1)), mask=o_mask)


def segment_shift_triton(
    k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor, v_st: torch.Tensor, active_rows: torch.Tensor,
    active_segment: torch.Tensor, share: torch.Tensor, num_segments: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``segment_shift_ref``: partial sums per block of rows, then their ordered sum
    (two launches, no atomics); fastest with each segment's rows in one run, as the fusor has them."""
    n_active, n_heads, head_dim = k_new.shape
    device = k_new.device
    mk = torch.empty((num_segments, n_heads, head_dim), dtype=torch.float32, device=device)
    mv = torch.empty_like(mk)
    blocks = max(1, triton.cdiv(n_active, _ROWS))
    # written only where a block holds the segment (``span``): no zero-fill pass
    part_k = torch.empty((blocks, num_segments, n_heads, head_dim), dtype=torch.float32, device=device)
    part_v = torch.empty_like(part_k)
    part_n = torch.empty((blocks, num_segments), dtype=torch.float32, device=device)
    span = torch.empty((blocks, 2), dtype=torch.int32, device=device)
    k_new, v_new, k_st, v_st = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new, k_st, v_st))
    cols = triton.cdiv(head_dim, _HALF_D)
    _segment_partial_kernel[(blocks, n_heads, cols)](
        k_new, v_new, k_st, v_st, active_rows, active_segment, part_k, part_v, part_n, span,
        n_active, num_segments, n_heads, head_dim,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_st.stride(0), k_st.stride(1), v_st.stride(0), v_st.stride(1),
        BLOCK_R=_ROWS, BLOCK_D=_HALF_D, num_warps=4,
    )
    _segment_mean_kernel[(n_heads, cols)](
        part_k, part_v, part_n, span, share, mk, mv, blocks, num_segments, n_heads, head_dim,
        S_PAD=triton.next_power_of_2(num_segments), BLOCK_D=_HALF_D, num_warps=4,
    )
    return mk, mv


@triton.jit
def _write_stored_kernel(
    k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, mk_ptr, mv_ptr, seg_ptr, ko_ptr, vo_ptr,
    n_heads, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_kc, stride_kch, stride_vc, stride_vch,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, SHIFT: tl.constexpr, KEEP: tl.constexpr,
):
    """Program (stored row): shift (``SHIFT``), keep the shifted rows (``KEEP``, contiguous outputs),
    rotate K to the row's position and write K and V at its slot (none when the slot is negative)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    hd = offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # [head, d] in a contiguous [KVH, D] row
    kp = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    vp = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k1, k2 = tl.load(kp, mask=mask, other=0.0), tl.load(kp + HALF, mask=mask, other=0.0)
    v1, v2 = tl.load(vp, mask=mask, other=0.0), tl.load(vp + HALF, mask=mask, other=0.0)
    if SHIFT:  # moved in float32, rounded to the stored dtype as the reference rounds it
        base = tl.load(seg_ptr + t).to(tl.int64) * n_heads * (2 * HALF) + hd
        ty = k_ptr.dtype.element_ty
        k1 = (k1.to(tl.float32) + tl.load(mk_ptr + base, mask=mask, other=0.0)).to(ty)
        k2 = (k2.to(tl.float32) + tl.load(mk_ptr + base + HALF, mask=mask, other=0.0)).to(ty)
        v1 = (v1.to(tl.float32) + tl.load(mv_ptr + base, mask=mask, other=0.0)).to(ty)
        v2 = (v2.to(tl.float32) + tl.load(mv_ptr + base + HALF, mask=mask, other=0.0)).to(ty)
    if KEEP:
        row = t * n_heads * (2 * HALF) + hd
        tl.store(ko_ptr + row, k1, mask=mask)
        tl.store(ko_ptr + row + HALF, k2, mask=mask)
        tl.store(vo_ptr + row, v1, mask=mask)
        tl.store(vo_ptr + row + HALF, v2, mask=mask)
    if slot >= 0:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        x1, x2 = k1.to(tl.float32), k2.to(tl.float32)
        kc = kc_ptr + slot * stride_kc + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + slot * stride_vc + offs_h[:, None] * stride_vch + offs_d[None, :]
        cty = kc_ptr.dtype.element_ty
        tl.store(kc, (x1 * c - x2 * s).to(cty), mask=mask)
        tl.store(kc + HALF, (x2 * c + x1 * s).to(cty), mask=mask)
        tl.store(vc, v1.to(cty), mask=mask)
        tl.store(vc + HALF, v2.to(cty), mask=mask)


def write_stored_kv_triton(
    k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    shift: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Same contract as ``write_stored_kv_ref``."""
    tokens, heads, head_dim = k.shape
    if shift is None or not keep:
        ko, vo = k, v  # never written (KEEP off), or the inputs as the written rows
    else:
        ko, vo = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype,
                                                                                   device=v.device)
    if tokens:
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        mk, mv, segment = shift if shift is not None else (k, v, slots)  # unread without SHIFT
        if not cos.is_contiguous():
            cos, sin = cos.contiguous(), sin.contiguous()
        kc, vc = k_cache.view(-1, heads, head_dim), v_cache.view(-1, heads, head_dim)
        _write_stored_kernel[(tokens,)](
            k, v, positions, cos, sin, kc, vc, slots, mk, mv, segment, ko, vo,
            heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_H=triton.next_power_of_2(heads), SHIFT=shift is not None, KEEP=shift is not None and keep,
            num_warps=4,
        )
    return (ko, vo) if keep else None
