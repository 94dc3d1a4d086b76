"""Attention over the paged KV cache in Triton: varlen causal prefill and decode, both split-K.

Same cache layout and contracts as ``paged_attention.py`` (the torch references): K and V caches
``[num_blocks, block_size, num_kv_heads, head_dim]``, sequence ``s``'s token ``t`` in block
``block_tables[s, t // block_size]``; every call returns ``(out [T, H, D], lse [T, H])`` with the
natural-log log-sum-exp in float32, so partial attentions merge exactly.

Both kernels are flash-attention style (online softmax in base 2, never materialising scores) and
read keys through the block table one ``BLOCK_N`` tile at a time: each key row's cache slot is
gathered, so any ``block_size`` works. Nothing here reads a device value on the host, so both paths
can be captured in a CUDA graph; launch grids depend only on host-side ints. A grid too small to
fill the GPU (a short turn after a long history, a decode batch) cuts each query tile's keys into
shares attended by programs of their own, merged by lse afterwards.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# a turn's attention gained from 8 splits of 16K+ keys and lost with 16 at every length (H100, NOTES.md)
_PREFILL_MAX_SPLITS = 8
_DECODE_BLOCK_N = 64
_PREFILL_SPLIT_WAVES = 8  # programs per SM a split prefill aims for (H100 timings: NOTES.md)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start_n, q_pos, kv_len,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, window, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, SLIDING: tl.constexpr,
    PREC: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) into the running softmax of the query rows ``q``.

    ``MASK`` applies the causal (and window) mask and the bound ``kv_len``; tiles that every query
    row sees in full skip it. ``q_pos`` [rows] are the queries' absolute positions.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK:
        n_valid = offs_n < kv_len
        page = tl.load(table_ptr + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[None, :] & d_mask[:, None]
    else:
        page = tl.load(table_ptr + offs_n // PAGE).to(tl.int64)
        kv_mask = d_mask[:, None]
    in_page = offs_n % PAGE
    k = tl.load(
        k_cache_ptr + page[None, :] * stride_kb + in_page[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
        mask=kv_mask, other=0.0,
    )
    qk = tl.dot(q, k, input_precision=PREC) * scale_log2
    if MASK:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if SLIDING:
            visible = visible & ((q_pos[:, None] - offs_n[None, :]) < window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # with a mask, a row may see none of this tile and nothing before it: keep exp2 off inf - inf
    m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASK else m_new
    p = tl.exp2(qk - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    v = tl.load(
        v_cache_ptr + page[:, None] * stride_vb + in_page[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=tl.trans(kv_mask), other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _tile_span(
    q_start, q_len, kv_len, m0, q_positions_ptr, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, HAS_POS: tl.constexpr,
):
    """Keys a query tile (rows ``m0..m0 + BLOCK_M`` of a sequence) attends to: ``[lo, hi)``, of
    which ``[lo, full_end)`` every row sees in full. ``lo`` and ``full_end`` are multiples of
    ``BLOCK_N``. Shared by the attention and the split-merge kernels, which must agree on it."""
    if HAS_POS:
        first = tl.load(q_positions_ptr + q_start + m0)
        last = tl.load(q_positions_ptr + q_start + tl.minimum(m0 + BLOCK_M, q_len) - 1)
    else:
        ctx = kv_len - q_len  # tokens already cached before this step's queries
        first = ctx + m0
        last = ctx + m0 + BLOCK_M - 1
    hi = tl.minimum(last + 1, kv_len)
    if SLIDING:  # every tile may cut a row's window: mask them all, start at the first row's window
        lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = lo
    else:  # keys before the tile's first query are visible to all its rows
        lo = first * 0
        full_end = (first // BLOCK_N) * BLOCK_N
    return lo, full_end, hi


@triton.jit
def _split_share(span, num_splits, min_share, BLOCK_N: tl.constexpr):
    """Keys per split of a tile's ``span`` keys: all or nothing. A span long enough for
    ``num_splits`` shares of at least ``min_share`` keys is cut into that many (each rounded up to
    whole ``BLOCK_N`` tiles); a shorter one stays whole. On an H100 a 257-token turn's attention
    gained only from 8 splits of a 16K+ history; fewer or shorter shares cost more to merge than
    they saved (kernels/NOTES.md). The tile uses ``cdiv(span, share)`` splits."""
    share = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    return tl.where(span >= num_splits * min_share, share, span)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_positions_ptr,
    scale_log2, window, num_splits, min_share,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
    stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr,
    HAS_POS: tl.constexpr, PACK: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Program (query tile x split, sequence, query head). Tiles past a sequence's query length exit.

    ``PACK``: the program is (query tile x split, sequence, KV head) instead, and its ``BLOCK_M`` rows
    are ``BLOCK_Q`` queries x the ``GROUP`` query heads of that KV head, so each K/V tile gathered
    through the page table serves every head that reads it (grouped-query models). ``BLOCK_Q`` is
    the tile's query count either way (``BLOCK_M`` unpacked).

    Split-K: a tile's keys are cut into up to ``num_splits`` shares (``_split_share``) attended by
    programs of their own; a tile that needs one share writes ``out``/``lse`` directly, one that
    needs several writes normalised partials and their lse to ``part_out``/``part_lse`` at
    [token, split, head] for ``_prefill_merge_kernel``; splits past the tile's count exit.

    ``HAS_POS``: the queries sit at the given ascending absolute positions (cache fusion's scattered
    recompute) instead of the last ``q_len`` positions of the sequence."""
    m_block = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    seq = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_Q
    if m0 >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    lo, full_end, hi = _tile_span(q_start, q_len, kv_len, m0, q_positions_ptr, window,
                                  BLOCK_Q, BLOCK_N, SLIDING, HAS_POS)
    share = _split_share(hi - lo, num_splits, min_share, BLOCK_N)
    parts = tl.cdiv(hi - lo, share)
    if split >= parts:
        return
    s_lo = lo + split * share
    s_hi = tl.minimum(s_lo + share, hi)
    s_full = tl.minimum(tl.maximum(full_end, s_lo), s_hi)
    offs_r = tl.arange(0, BLOCK_M)
    if PACK:  # row r: query m0 + r // GROUP, query head r % GROUP of this KV head
        kv_head = tl.program_id(2)
        offs_m = m0 + offs_r // GROUP
        heads = kv_head * GROUP + offs_r % GROUP
    else:
        kv_head = tl.program_id(2) // GROUP
        offs_m = m0 + offs_r
        heads = tl.program_id(2) + offs_r * 0
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.load(q_positions_ptr + rows, mask=row_mask, other=0) if HAS_POS else kv_len - q_len + offs_m
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(s_lo, s_full, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, kv_len, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, window,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, False, SLIDING, PREC,
        )
    for start_n in range(s_full, s_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, kv_len, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, window,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, SLIDING, PREC,
        )
    # rows past q_len saw nothing and are not stored; a row may see none of a split's keys: lse -inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    if parts == 1:
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
        tl.store(lse_ptr + rows * stride_lt + heads, lse, mask=row_mask)
    else:
        tl.store(part_out_ptr + rows[:, None] * stride_pt + split * stride_ps + heads[:, None] * stride_ph
                 + offs_d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + rows * stride_plt + split * stride_pls + heads, lse, mask=row_mask)


@triton.jit
def fold_partial(m, total, acc, lse_p, part):
    """One step of merging normalised partial attentions online by their lse (natural log): the
    state is the running max lse ``m``, ``total`` = sum of exp(lse - m), and ``acc`` = the partials
    weighted alike; a partial with lse -inf adds nothing. Shared by every split-K reduction that
    walks its partials in one loop, so they all treat empty rows the same way."""
    m_new = tl.maximum(m, lse_p)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_p - m_safe)
    return m_new, total * alpha + w, acc * alpha[:, None] + part.to(tl.float32) * w[:, None]


@triton.jit
def _prefill_merge_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, cu_seqlens_q_ptr, q_positions_ptr,
    window, num_splits, min_share,
    stride_ot, stride_oh, stride_lt, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, HAS_POS: tl.constexpr,
):
    """Program (query tile, sequence, query head): merge the tile's split partials by their lse,
    online over the splits. Tiles of one split were written directly and are skipped."""
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    lo, full_end, hi = _tile_span(q_start, q_len, kv_len, m0, q_positions_ptr, window,
                                  BLOCK_M, BLOCK_N, SLIDING, HAS_POS)
    parts = tl.cdiv(hi - lo, _split_share(hi - lo, num_splits, min_share, BLOCK_N))
    if parts == 1:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < q_len
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, parts):
        lse_s = tl.load(part_lse_ptr + rows * stride_plt + s * stride_pls + head, mask=row_mask,
                        other=float("-inf"))
        part = tl.load(part_out_ptr + rows[:, None] * stride_pt + s * stride_ps + head * stride_ph + offs_d[None, :],
                       mask=mask, other=0.0)
        m, total, acc = fold_partial(m, total, acc, lse_s, part)
    t_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             (acc / t_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows * stride_lt + head, m + tl.log(t_safe), mask=row_mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, scale_log2, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr,
):
    """Program (sequence, kv head, split): see ``decode_program``."""
    decode_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr, scale_log2, window,
        num_splits, stride_qt, stride_qh, stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, SLIDING, PREC,
    )


@triton.jit
def decode_program(
    seq, kv_head, split,
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, scale_log2, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr,
):
    """One decode program: the GROUP query heads of KV head ``kv_head`` of sequence ``seq`` attend
    to share ``split`` of its keys, so each K/V tile is read once for the whole group. (A function
    of its own so relay decode can run these programs in the same launch as its system programs.)

    Writes normalised partial outputs and their lse to ``out``/``lse`` at [seq, split, head]; with
    one split those are the final results. An empty share writes out = 0, lse = -inf.
    """
    kv_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(kv_len - window, 0)
    share = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, kv_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # every query row sits at the last position, so the causal test only bounds keys by ``end``
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + end - 1
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, window,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, False, PREC,
        )
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    base = seq.to(tl.int64) * stride_ot + split * stride_os
    tl.store(out_ptr + base + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + seq.to(tl.int64) * stride_lt + split * stride_ls + heads, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_splits, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls, stride_ot, stride_oh, stride_lt,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence, head): merge the ``num_splits`` partial attentions by their lse.

    ``PDL``: launched as a programmatic dependent of the kernel writing the partials, it is
    scheduled while that one drains and waits for its results here."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_plt + offs_s * stride_pls + head, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    part = tl.load(part_out_ptr + seq * stride_pt + offs_s[:, None] * stride_ps + head * stride_ph + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part.to(tl.float32) * (w / total_safe)[:, None], 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(lse_ptr + seq * stride_lt + head, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total)))


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 models stay exact ("ieee"): tf32's 1e-3 error would break fp32 parity with the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on CPU: small, but enough to exercise several splits


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, per_sm: float = 2.0
) -> int:
    """Splits per sequence so the grid has about ``per_sm`` programs per multiprocessor.

    Depends only on host ints: a CUDA graph captured with ``max_seq_len`` = the model's context
    keeps a valid split count for every shorter sequence it later replays.
    """
    want = math.ceil(per_sm * _sm_count(device) / max(1, num_seqs * num_kv_heads))
    return max(1, min(_MAX_SPLITS, want, math.ceil(max_seq_len / _DECODE_BLOCK_N)))


def _shared_memory(device: torch.device) -> int:
    """Shared memory one program may take on ``device`` (bytes; 0 when torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _prefill_tiles(
    head_dim: int, device: torch.device, pack: bool = False, scattered: bool = False, elem_bytes: int = 2
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); the interpreter gets small tiles (fast, and tests
    cross many tile boundaries). Packed tiles of head_dim 128 take 128 rows (32 queries x 4 heads) and
    8 warps: on an H100 a 257-token turn's attention after 1K-4K of history ran 8-20% faster than with
    64-row tiles, as did fusion's scattered recompute of 416 queries (kernels/NOTES.md). Queries at
    given positions (``scattered``: cache fusion's recompute) also take 128 keys a step: on an H200,
    of 36 tilings it was the best or within 3% for 416-2592 of 3104 positions, 4-8% faster than 64.
    Those tiles take ~224 KiB of shared memory at head_dim 128 in 16-bit (an H100/H200 has 227):
    smaller GPUs and float32 keep 64 keys a step."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    if head_dim <= 64:
        return 128, 64, 4, 3
    if pack:
        need = (128 + 3 * 2 * 128) * triton.next_power_of_2(head_dim) * elem_bytes  # Q, 3 stages of K and V
        wide = scattered and _shared_memory(device) >= need
        return (128, 128, 8, 3) if wide else (128, 64, 8, 3)
    return 64, 64, 4, 3  # best of five tilings on H100 at 512..8K tokens, prefix or not (NOTES.md)


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    if cache.stride(-1) != 1:
        raise ValueError("KV cache must have a unit stride over head_dim")
    return cache.stride(0), cache.stride(1), cache.stride(2)


def prefill_num_splits(
    num_programs: int, max_seq_len: int, device: torch.device
) -> int:
    """Key splits per query tile for a prefill grid of ``num_programs`` (tiles x sequences x heads).

    A short turn after a long history is a few query tiles per head, each walking the whole
    history: 257 queries x 32 heads is 160 programs on an H100's 132 multiprocessors. Splitting the
    keys gives every multiprocessor several programs (about ``_PREFILL_SPLIT_WAVES`` per SM, as a
    power of two); grids that already fill the GPU twice over are left whole. Host ints only, as for
    decode: a graph captured with ``max_seq_len`` = the model's context keeps a valid count, and on
    the device a tile splits only when its keys fill every share (``_split_share``).
    """
    sms = _sm_count(device)
    if num_programs >= 2 * sms:
        return 1
    want = math.ceil(_PREFILL_SPLIT_WAVES * sms / max(1, num_programs))
    splits = min(_PREFILL_MAX_SPLITS, 1 << (want - 1).bit_length())
    return splits if max_seq_len >= splits * _prefill_min_share(device) else 1


def prefill_packs(group: int) -> bool:
    """Whether a prefill tile holds all query heads of a KV head: for grouped-query models whose
    group is 2, 4 or 8 (every tiling's rows divide by it). On an H100 (kernels/NOTES.md) packing sped
    up a 257-token turn's attention 2-12% and fusion's scattered recompute 1.5-7% at equal tiles, and
    cost a fresh prompt 2-3%, a small share of its prefill: one rule serves all."""
    return group in (2, 4, 8)


def prefill_split_span(device: torch.device) -> int:
    """Fewest keys at which a prefill tile splits (the most splits times the fewest keys a split
    takes): a graph captured for shorter sequences is captured with fewer keys than this, gets one
    split, and launches no programs that would only exit (2.5 us of a 4K turn's 0.13 ms a layer)."""
    return _PREFILL_MAX_SPLITS * _prefill_min_share(device)


def _prefill_min_share(device: torch.device) -> int:
    """Fewest keys a split takes (a multiple of the key tile); the interpreter's is small so tests
    exercise several splits on short sequences."""
    return 2048 if device.type == "cuda" else 16


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    q_positions: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    pack: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``paged_prefill_attention_ref``.

    ``max_query_len`` sizes the grid; pass it (the metadata has it) to avoid reading
    ``cu_seqlens_q`` back to the host. ``q_positions`` [total] (ascending within each sequence)
    places the queries at arbitrary positions, each seeing the keys at or before its own.
    ``max_seq_len`` (a host bound on the sequences' lengths) lets a small grid split its keys
    (``prefill_num_splits``); ``num_splits`` forces the split count. ``pack`` puts a KV head's query
    heads in one tile (``_prefill_kernel``); None lets ``prefill_packs`` choose.
    """
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((total, num_heads), dtype=torch.float32, device=q.device)
    num_seqs = seq_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    if pack is None:
        pack = prefill_packs(group)
    block_m, block_n, warps, stages = _prefill_tiles(head_dim, q.device, pack, q_positions is not None,
                                                     q.element_size())
    if pack and block_m % group:
        raise ValueError(f"cannot pack {group} query heads per KV head into {block_m}-row tiles")
    block_q = block_m // group if pack else block_m  # queries per tile
    tiles = triton.cdiv(max_query_len, block_q)
    grid_heads = num_kv_heads if pack else num_heads
    if num_splits is None:
        num_splits = 1 if max_seq_len is None else prefill_num_splits(tiles * num_seqs * grid_heads, max_seq_len,
                                                                      q.device)
    if num_splits > 1:
        part_out, part_lse = split_buffers(total, num_splits, num_heads, head_dim, q.device)
    else:  # never written: every tile is one split
        part_out, part_lse = out.unsqueeze(1), lse.unsqueeze(1)
    min_share = max(block_n, _prefill_min_share(q.device) // block_n * block_n)
    positions = q_positions if q_positions is not None else cu_seqlens_q
    common = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
                  SLIDING=sliding_window is not None, HAS_POS=q_positions is not None)
    part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    _prefill_kernel[(tiles * num_splits, num_seqs, grid_heads)](
        q, k_cache, v_cache, out, lse, part_out, part_lse, block_tables, seq_lens, cu_seqlens_q, positions,
        scale * _LOG2E, sliding_window or 0, num_splits, min_share,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), *part_strides,
        *_cache_strides(k_cache), *_cache_strides(v_cache), block_tables.stride(0),
        GROUP=group, PAGE=k_cache.shape[1], PREC=_dot_precision(q.dtype), PACK=pack, BLOCK_Q=block_q,
        num_warps=warps, num_stages=stages, **common,
    )
    if num_splits > 1:  # per query head, over the same query tiles (so the same key spans and shares)
        _prefill_merge_kernel[(tiles, num_seqs, num_heads)](
            out, lse, part_out, part_lse, seq_lens, cu_seqlens_q, positions, sliding_window or 0, num_splits,
            min_share, out.stride(0), out.stride(1), lse.stride(0), *part_strides, num_warps=4,
            **{**common, "BLOCK_M": block_q},
        )
    return out, lse


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``paged_decode_attention_ref``, computed split-K: each sequence's keys are
    cut into ``num_splits`` shares attended in parallel, then merged by lse.

    ``max_seq_len`` (a host int; the metadata has it) only bounds the default split count.
    """
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out, lse
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        num_splits = decode_num_splits(num_seqs, k_cache.shape[2], bound, q.device)
    if num_splits == 1:  # the single share is the answer: write it in place, no reduction pass
        part_out, part_lse = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        part_out, part_lse = split_buffers(num_seqs, num_splits, num_heads, head_dim, q.device)
    decode_partials_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, part_out, part_lse,
                           num_splits)
    if num_splits > 1:
        reduce_splits_triton(part_out, part_lse, out, lse)
    return out, lse


def split_buffers(
    tokens: int, splits: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [tokens, splits, heads, head_dim] (float32 unless ``dtype``) and their float32
    lse [tokens, splits, heads]."""
    return (torch.empty((tokens, splits, heads, head_dim), dtype=dtype or torch.float32, device=device),
            torch.empty((tokens, splits, heads), dtype=torch.float32, device=device))


def decode_partials_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    launch: dict[str, int] | None = None,
) -> None:
    """Write each sequence's ``num_splits`` decode partials into splits ``[0, num_splits)`` of
    ``part_out``/``part_lse`` ([tokens, splits, heads(, head_dim)]); the buffers may hold more splits
    (relay attention puts the system partials after them and reduces all in one pass, with its own
    ``launch`` parameters: ``block_n``, ``num_warps``, ``num_stages``)."""
    launch = launch or {}
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, block_tables, seq_lens,
        scale * _LOG2E, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        *_cache_strides(k_cache), *_cache_strides(v_cache), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1],
        BLOCK_N=launch.get("block_n", _DECODE_BLOCK_N) if q.is_cuda else 16,
        SLIDING=sliding_window is not None, PREC=_dot_precision(q.dtype), num_warps=launch.get("num_warps", 4),
        **({"num_stages": launch["num_stages"]} if "num_stages" in launch and q.is_cuda else {}),
    )


def reduce_splits_triton(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, pdl: bool = False
) -> None:
    """Merge every split of ``part_out``/``part_lse`` by lse into ``out`` [tokens, heads, head_dim]
    and ``lse`` [tokens, heads]: an empty split (lse = -inf) contributes nothing."""
    tokens, num_splits, num_heads, head_dim = part_out.shape
    _reduce_splits_kernel[(tokens, num_heads)](
        part_out, part_lse, out, lse, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, n_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kc, stride_kch, stride_vc, stride_vch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding rows of a captured batch write nowhere
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' K/V [T, KVH, D] at their slots in one launch; a negative slot is skipped
    (the padding rows of a CUDA-graph batch), which ``index_copy_`` cannot do."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kc = k_cache.view(-1, heads, head_dim)
    vc = v_cache.view(-1, heads, head_dim)
    _write_kv_kernel[(tokens,)](
        k, v, kc, vc, slot_mapping, heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
