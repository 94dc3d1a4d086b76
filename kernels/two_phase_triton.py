"""Two-phase decode attention over shared KV blocks in Triton (torch reference: ``two_phase.py``).

Two launches per layer:

- ``_chunk_first_kernel``, program (item, KV head, query tile): the GROUP query heads of every
  sequence in the item's group, stacked as the rows of one query tile, attend to the item's shared
  keys. Each K/V tile is loaded once for up to ``BLOCK_M`` query rows (a ``tl.dot`` with M rows where
  the paged kernel has one sequence's GROUP rows), which is where the saving comes from. Normalised
  partials and their lse go to a float32 buffer [seq, slot, head, dim].
- ``_seq_first_kernel``, program (sequence, KV head): the sequence's own keys after its shared
  prefix, then the partials of its shared segments folded in by lse, and the final output written.

Key tiles reuse the paged kernel's ``_attend_tile`` (online softmax in base 2, page lookups per key),
so any block size works and shared segments need not start on a tile boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_triton import _LOG2E, _attend_tile, _cache_strides, _dot_precision
from .two_phase import TwoPhasePlan, chunk_first_tile

_BLOCK_N = 64


@triton.jit
def _chunk_first_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, items_ptr, order_ptr, scale_log2,
    stride_qt, stride_qh, stride_pt, stride_pp, stride_ph, stride_lt, stride_lp,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    row = items_ptr + item * 5
    lo = tl.load(row)
    hi = tl.load(row + 1)
    k0 = tl.load(row + 2)
    k1 = tl.load(row + 3)
    slot = tl.load(row + 4)
    if m0 >= (hi - lo) * GROUP:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    pos = lo + rows // GROUP
    valid = pos < hi
    seq = tl.load(order_ptr + pos, mask=valid, other=0).to(tl.int64)
    heads = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    io_mask = valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask,
                other=0.0)
    # the group shares these blocks: any member's block table finds them
    table_ptr = block_tables_ptr + tl.load(order_ptr + lo).to(tl.int64) * stride_bt
    q_pos = tl.full([BLOCK_M], 0, tl.int32) + k1 - 1  # decode queries see every shared key
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = k0 + ((k1 - k0) // BLOCK_N) * BLOCK_N
    for start_n in range(k0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, k1, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, 0,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, False, False, PREC,
        )
    for start_n in range(full_end, k1, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, k1, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, 0,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, False, PREC,
        )
    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(part_out_ptr + seq[:, None] * stride_pt + slot * stride_pp + heads[:, None] * stride_ph + offs_d[None, :],
             out, mask=io_mask)
    tl.store(part_lse_ptr + seq * stride_lt + slot * stride_lp + heads, lse, mask=valid)


@triton.jit
def _seq_first_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, shared_lens_ptr, num_parts_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ot_lse,
    stride_pt, stride_pp, stride_ph, stride_lt, stride_lp,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    kv_len = tl.load(seq_lens_ptr + seq)
    start = tl.load(shared_lens_ptr + seq)
    num_parts = tl.load(num_parts_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    io_mask = g_mask[:, None] & d_mask[None, :]
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + kv_len - 1
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, kv_len, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, kv_len, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, 0,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, False, PREC,
        )
    # fold in the shared segments' partials: a normalised partial with lse L is the state (m=L, l=1)
    for p in range(0, num_parts):
        part_lse = tl.load(part_lse_ptr + seq * stride_lt + p * stride_lp + heads, mask=g_mask,
                           other=float("-inf")) * 1.4426950408889634
        part = tl.load(part_out_ptr + seq * stride_pt + p * stride_pp + heads[:, None] * stride_ph + offs_d[None, :],
                       mask=io_mask, other=0.0)
        m_new = tl.maximum(m_i, part_lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(part_lse - m_safe)
        acc = acc * alpha[:, None] + part * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)
    tl.store(lse_ptr + seq * stride_ot_lse + heads,
             tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453), mask=g_mask)


def two_phase_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: TwoPhasePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``two_phase_decode_ref``; reads nothing back to the host."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=q.device)
    slots = max(plan.max_parts, 1)
    part_out = torch.empty((num_seqs, slots, num_heads, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, slots, num_heads), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    prec = _dot_precision(q.dtype)
    block_n = _BLOCK_N if q.is_cuda else 16
    k_strides, v_strides = _cache_strides(k_cache), _cache_strides(v_cache)
    if plan.num_items:
        rows = plan.max_item_seqs * group
        block_m = chunk_first_tile(rows, head_dim)
        _chunk_first_kernel[(plan.num_items, num_kv_heads, triton.cdiv(rows, block_m))](
            q, k_cache, v_cache, part_out, part_lse, block_tables, plan.items, plan.order, scale * _LOG2E,
            q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), *k_strides, *v_strides, block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=k_cache.shape[1], BLOCK_M=block_m,
            BLOCK_N=block_n, PREC=prec, num_warps=4, num_stages=3 if q.is_cuda else 1,
        )
    _seq_first_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, lse, part_out, part_lse, block_tables, seq_lens, plan.shared_lens,
        plan.num_parts, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        *k_strides, *v_strides, block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=k_cache.shape[1], BLOCK_N=block_n, PREC=prec, num_warps=4,
    )
    return out, lse
