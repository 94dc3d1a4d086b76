"""One sequence's prefill attention, its key steps dealt out evenly over the GPU's programs where
the per-tile grid would leave the device partly idle.

``paged_prefill_attention_triton`` gives each query tile a program that walks every key the tile
sees. Causal queries see more keys the later they sit, so those programs differ in length: cache
fusion's steady layers (416 queries scattered over a 3104-token prompt, grouped heads packed 32
queries x 4 heads a tile) are 13 tiles x 8 KV heads = 104 programs on an H200's 132
multiprocessors, walking 6 to 25 key steps of 128 keys, and the layer's attention lasts as long as
the longest walk. Splitting each tile's keys into equal shares does not help: the grid outgrows one
wave while the long tiles stay long (kernels/NOTES.md, round 7).

Here the work is counted in key steps (one ``BLOCK_N`` tile of keys for one query tile and head):
every program works out, on the device, each query tile's keys (so a CUDA graph replays it for any
positions), lays the steps of all tiles and heads end to end, and takes an equal run of them. A run
crosses tiles: a tile wholly inside a run is written directly, the pieces of a tile cut by a run's
edge are written as normalised partials with their log-sum-exp (at most two a program: the piece
continuing an earlier program's tile, the piece a later program continues), and a second launch
merges each cut tile's pieces in order (``fold_partial``, as the split-K kernels do).

That pays where the per-tile grid is small (a short question after a long prompt; the few hundred
queries of fusion's steady layers); a large grid keeps one program a tile, since the hardware then
spreads uneven programs well and the partials would cost more than they balance (``PER_TILE_FROM``).
Same contract as ``paged_prefill_attention_triton`` for one sequence; the torch references are
``paged_attention.paged_prefill_attention_ref`` and ``paged_attention_at_positions_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_triton import (
    _LOG2E,
    _attend_tile,
    _cache_strides,
    _dot_precision,
    _prefill_tiles,
    _sm_count,
    _tile_span,
    fold_partial,
    paged_prefill_attention_triton,
    prefill_packs,
)

# fewest key steps a program takes: each piece costs a query load and a partial written and merged
# again, so a run shorter than a few steps costs more than it balances
MIN_STEPS = 4
# the per-tile grid is kept from this many programs per multiprocessor on: the hardware then spreads
# its uneven programs well enough, and the pieces' partials cost more than they balance. On an H200
# (Mistral-7B layout, 3104 keys; results/fusion-h200-1201b/balanced-ab.json) balanced vs per-tile:
# 32 queries (8 programs) 47 vs 92 us, 416 (104) 88 vs 93, 608 (152) 117 vs 122, 800 (200) 136 vs
# 140, 992 (248) 157 vs 156, 1184 (296) 191 vs 169, 2592 (648) 360 vs 298
PER_TILE_FROM = 1.5


@triton.jit
def _tile_steps(
    cu_seqlens_q_ptr, seq_lens_ptr, q_positions_ptr, window, num_programs, min_steps,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, HAS_POS: tl.constexpr,
    MAX_TILES: tl.constexpr, GRID_HEADS: tl.constexpr,
):
    """Every query tile's keys ``[lo, hi)`` (``[lo, full_end)`` seen by all its rows) as vectors over
    the tiles, their key steps, where each tile's steps end when laid end to end, the steps of one
    head, and the run each program takes. The attention and the merge launches must agree on all of
    it, so both call this."""
    q_start = tl.load(cu_seqlens_q_ptr)
    q_len = tl.load(cu_seqlens_q_ptr + 1) - q_start
    kv_len = tl.load(seq_lens_ptr)
    tiles = tl.arange(0, MAX_TILES)
    real = tiles * BLOCK_Q < q_len
    # tiles past the queries read the last real row and take no steps; with no query at all (a graph's
    # capture run) they read the first, which the buffers hold: never an address before them
    some = tl.maximum(q_len, 1)
    m0 = tl.minimum(tiles * BLOCK_Q, some - 1)
    lo, full_end, hi = _tile_span(q_start, some, kv_len, m0, q_positions_ptr, window, BLOCK_Q, BLOCK_N,
                                  SLIDING, HAS_POS)
    steps = tl.where(real, tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), 0)
    ends = tl.cumsum(steps, 0)
    per_head = tl.sum(steps, 0)
    run = tl.maximum(tl.cdiv(per_head * GRID_HEADS, num_programs), min_steps)
    return q_start, q_len, kv_len, tiles, lo, full_end, hi, steps, ends, per_head, run


@triton.jit
def _pick(tiles, t, values):
    """``values[t]`` of a vector over the tiles."""
    return tl.sum(tl.where(tiles == t, values, 0), 0)


@triton.jit
def _rows(t, head, offs_r, q_len, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, PACK: tl.constexpr):
    """Query rows, query heads and KV head of tile ``t`` for grid head ``head``: packed, row r is
    query ``r // GROUP`` of the tile at query head ``r % GROUP`` of KV head ``head``."""
    if PACK:
        offs_m = t * BLOCK_Q + offs_r // GROUP
        heads = head * GROUP + offs_r % GROUP
        kv_head = head
    else:
        offs_m = t * BLOCK_Q + offs_r
        heads = head + offs_r * 0
        kv_head = head // GROUP
    return offs_m, heads, kv_head, offs_m < q_len


@triton.jit
def _balanced_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_positions_ptr,
    scale_log2, window, num_programs, min_steps,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr,
    HAS_POS: tl.constexpr, PACK: tl.constexpr, BLOCK_Q: tl.constexpr, MAX_TILES: tl.constexpr,
    GRID_HEADS: tl.constexpr,
):
    """Program ``p`` attends key steps ``[p * run, (p + 1) * run)`` of all heads' tiles laid end to
    end (head-major), one tile piece at a time."""
    pid = tl.program_id(0)
    q_start, q_len, kv_len, tiles, lo_v, full_v, hi_v, steps, ends, per_head, run = _tile_steps(
        cu_seqlens_q_ptr, seq_lens_ptr, q_positions_ptr, window, num_programs, min_steps,
        BLOCK_Q, BLOCK_N, SLIDING, HAS_POS, MAX_TILES, GRID_HEADS)
    u = pid * run
    stop = tl.minimum(u + run, per_head * GRID_HEADS)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part_rows = (pid * 2 * BLOCK_M + offs_r).to(tl.int64)  # slot 0; slot 1 is BLOCK_M rows on
    while u < stop:
        head = u // per_head
        step = u - head * per_head
        t = tl.sum((ends <= step).to(tl.int32), 0)  # the tile whose steps hold ``step``
        n_t = _pick(tiles, t, steps)
        s0 = step - (_pick(tiles, t, ends) - n_t)
        s1 = tl.minimum(n_t, s0 + stop - u)
        lo, full_end, hi = _pick(tiles, t, lo_v), _pick(tiles, t, full_v), _pick(tiles, t, hi_v)
        offs_m, heads, kv_head, row_mask = _rows(t, head, offs_r, q_len, GROUP, BLOCK_Q, PACK)
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = tl.load(q_positions_ptr + rows, mask=row_mask, other=0) if HAS_POS else kv_len - q_len + offs_m
        a = lo + s0 * BLOCK_N
        b = tl.minimum(lo + s1 * BLOCK_N, hi)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(a, tl.minimum(b, full_end), BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start_n, q_pos, kv_len, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                window, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d,
                d_mask, PAGE, BLOCK_N, False, SLIDING, PREC,
            )
        for start_n in range(tl.maximum(a, full_end), b, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start_n, q_pos, kv_len, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                window, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d,
                d_mask, PAGE, BLOCK_N, True, SLIDING, PREC,
            )
        # a row may see none of a piece's keys: lse -inf, which the merge skips
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        cut_before, cut_after = s0 > 0, s1 < n_t
        if cut_before | cut_after:  # slot 0: continues an earlier run's tile; 1: continued by a later run
            slot_rows = part_rows + tl.where(cut_before, 0, BLOCK_M)
            tl.store(part_out_ptr + slot_rows[:, None] * BLOCK_D + offs_d[None, :], out)
            tl.store(part_lse_ptr + slot_rows, lse)
        else:
            tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
            tl.store(lse_ptr + rows * stride_lt + heads, lse, mask=row_mask)
        u += s1 - s0


@triton.jit
def _balanced_merge_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_positions_ptr,
    window, num_programs, min_steps, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, HAS_POS: tl.constexpr, PACK: tl.constexpr,
    BLOCK_Q: tl.constexpr, MAX_TILES: tl.constexpr, GRID_HEADS: tl.constexpr,
):
    """Program (tile, grid head): if runs cut the tile, fold its pieces in run order (the first
    run's piece is in its slot 1, every later run's in its slot 0) and write the tile."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    q_start, q_len, kv_len, tiles, lo_v, full_v, hi_v, steps, ends, per_head, run = _tile_steps(
        cu_seqlens_q_ptr, seq_lens_ptr, q_positions_ptr, window, num_programs, min_steps,
        BLOCK_Q, BLOCK_N, SLIDING, HAS_POS, MAX_TILES, GRID_HEADS)
    n_t = _pick(tiles, t, steps)
    first = head * per_head + _pick(tiles, t, ends) - n_t
    p_first = first // run
    p_last = (first + n_t - 1) // run
    if n_t == 0 or p_first == p_last:
        return
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for p in range(p_first, p_last + 1):
        slot_rows = ((p * 2 + (p == p_first).to(tl.int32)) * BLOCK_M + offs_r).to(tl.int64)
        lse_p = tl.load(part_lse_ptr + slot_rows)
        part = tl.load(part_out_ptr + slot_rows[:, None] * BLOCK_D + offs_d[None, :])
        m, total, acc = fold_partial(m, total, acc, lse_p, part)
    offs_m, heads, _, row_mask = _rows(t, head, offs_r, q_len, GROUP, BLOCK_Q, PACK)
    rows = (q_start + offs_m).to(tl.int64)
    t_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             (acc / t_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + rows * stride_lt + heads, m + tl.log(t_safe), mask=row_mask)


def sequence_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    q_positions: torch.Tensor | None = None,
    pack: bool | None = None,
    balance: bool | None = None,
    num_programs: int | None = None,
    min_steps: int = MIN_STEPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_prefill_attention_triton``'s contract for one sequence (``block_table`` [1, blocks],
    ``seq_lens`` [1], ``cu_seqlens_q`` [2], all on the device). ``max_query_len`` (a host bound on the
    queries, default ``len(q)``) sizes the grids: the real count is read on the device, so a CUDA
    graph replays any count up to it.

    ``balance`` None: the key steps are dealt out over ``num_programs`` programs (default one per
    multiprocessor) of at least ``min_steps`` steps where the per-tile grid would fill the device less
    than ``PER_TILE_FROM`` times, else each tile is one program (``paged_prefill_attention_triton``,
    keys unsplit); True or False forces either."""
    total, num_heads, head_dim = q.shape
    if seq_lens.shape[0] != 1:
        raise ValueError(f"expected one sequence, got {seq_lens.shape[0]}")
    group = num_heads // k_cache.shape[2]
    if pack is None:
        pack = prefill_packs(group)
    block_m, block_n, warps, stages = _prefill_tiles(head_dim, q.device, pack, q_positions is not None,
                                                     q.element_size())
    block_q = block_m // group if pack else block_m
    tiles = triton.cdiv(max_query_len if max_query_len is not None else total, block_q)
    grid_heads = k_cache.shape[2] if pack else num_heads
    if balance is None:
        balance = tiles * grid_heads < PER_TILE_FROM * _sm_count(q.device)
    if not balance:
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                                              sliding_window, max_query_len=max_query_len, q_positions=q_positions,
                                              num_splits=1, pack=pack)
    out = torch.empty_like(q)
    lse = torch.empty((total, num_heads), dtype=torch.float32, device=q.device)
    if total == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if pack and block_m % group:
        raise ValueError(f"cannot pack {group} query heads per KV head into {block_m}-row tiles")
    programs = num_programs or _sm_count(q.device)
    if min_steps < 1:
        raise ValueError(f"min_steps must be at least 1, got {min_steps}")
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty((programs, 2, block_m, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((programs, 2, block_m), dtype=torch.float32, device=q.device)
    positions = q_positions if q_positions is not None else cu_seqlens_q
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                  SLIDING=sliding_window is not None, HAS_POS=q_positions is not None, PACK=pack, BLOCK_Q=block_q,
                  MAX_TILES=triton.next_power_of_2(tiles), GRID_HEADS=grid_heads)
    window = sliding_window or 0
    _balanced_kernel[(programs,)](
        q, k_cache, v_cache, out, lse, part_out, part_lse, block_table, seq_lens, cu_seqlens_q, positions,
        scale * _LOG2E, window, programs, min_steps, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), *_cache_strides(k_cache), *_cache_strides(v_cache),
        PAGE=k_cache.shape[1], PREC=_dot_precision(q.dtype), num_warps=warps, num_stages=stages, **common,
    )
    _balanced_merge_kernel[(tiles, grid_heads)](
        out, lse, part_out, part_lse, seq_lens, cu_seqlens_q, positions, window, programs, min_steps,
        out.stride(0), out.stride(1), lse.stride(0), num_warps=8, **common,
    )
    return out, lse
