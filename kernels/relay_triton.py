"""RelayAttention in Triton: system attention as one matrix-matrix product per KV head, and relay
decode, where the context and system partials are merged in one fused pass.

Same contracts as ``relay.py`` (the torch reference). A program takes one tile of query rows (the
tokens of one system prompt times the query heads of one KV head), one KV head and one share of the
system's keys (split-K over the system prompt, so a batch of a few requests still fills the GPU):
each system K/V tile is loaded once for all the rows of the tile, i.e. once per batch when a tile
holds the whole batch.

Relay decode computes the context's split-K partials (the paged decode kernel's programs) and the
system's partials in one launch, into one buffer, and reduces them all in a single kernel: the relay fusion
o = a*o_sys + (1-a)*o_ctx, a = 1/(1 + exp(lse_ctx - lse_sys)) is that reduction's two-sided case, so
it costs no pass of its own. Nothing reads device values on the host (CUDA-graph safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .paged_attention_triton import (
    _DECODE_BLOCK_N,
    _LOG2E,
    _MAX_SPLITS,
    _attend_tile,
    _cache_strides,
    _dot_precision,
    _sm_count,
    decode_num_splits,
    decode_partials_triton,
    decode_program,
    fold_partial,
    reduce_splits_triton,
    split_buffers,
)

_SYSTEM_BLOCK_N = 64


# Counts that vary from batch to batch are not specialised on (Triton would compile a new variant
# whenever one becomes divisible by 16, in the middle of serving).
@triton.jit(do_not_specialize=["num_splits", "split_offset"])
def _system_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    tile_tokens_ptr, tile_system_ptr, sys_tables_ptr, sys_lens_ptr,
    scale_log2, num_splits, split_offset,
    stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_st,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TILE_T: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """Program (tile, kv head, split): see ``_system_program``."""
    _system_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, tile_tokens_ptr, tile_system_ptr,
        sys_tables_ptr, sys_lens_ptr, scale_log2, num_splits, split_offset,
        stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_st,
        GROUP, BLOCK_G, TILE_T, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, PREC,
    )


@triton.jit
def _arrive_and_reduce(
    token, heads, ok, counts_ptr, num_heads, num_parts, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pt, stride_ps, stride_ph, stride_plt, stride_pls, stride_ot, stride_oh, stride_lt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Count this program's partials of rows (``token``, ``heads``) [R] as written; the program that
    writes the last of a row's ``num_parts`` partials reduces that row by lse into ``out``/``lse``
    and sets its count back to 0 for the next launch. So no program waits on another and no second
    launch is needed: whichever finishes a row last merges it (a context program, or a system
    program whose rows' contexts finished before it)."""
    tl.debug_barrier()  # every thread's partial stores precede the count (release, below)
    slot = counts_ptr + token * num_heads + heads
    old = tl.atomic_add(slot, 1, mask=ok, sem="acq_rel")
    last = ok & (old == num_parts - 1)
    if tl.max(last.to(tl.int32), 0) > 0:
        tl.debug_barrier()  # the acquiring threads' view reaches every thread that loads below
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        m = tl.full(heads.shape, float("-inf"), tl.float32)
        total = tl.zeros(heads.shape, tl.float32)
        acc = tl.zeros([heads.shape[0], BLOCK_D], tl.float32)
        for part in range(0, num_parts):
            lse_p = tl.load(part_lse_ptr + token * stride_plt + part * stride_pls + heads, mask=last,
                            other=float("-inf"), cache_modifier=".cg")
            out_p = tl.load(part_out_ptr + token[:, None] * stride_pt + part * stride_ps + heads[:, None] * stride_ph
                            + offs_d[None, :], mask=last[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
            m, total, acc = fold_partial(m, total, acc, lse_p, out_p)
        empty = total == 0.0
        total = tl.where(empty, 1.0, total)
        out = acc / total[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=last[:, None] & d_mask[None, :])
        tl.store(lse_ptr + token * stride_lt + heads, tl.where(empty, float("-inf"), m + tl.log(total)), mask=last)
        tl.store(slot, 0, mask=last)


@triton.jit(do_not_specialize=["sys_splits", "ctx_splits", "sys_programs"])
def _relay_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    tile_tokens_ptr, tile_system_ptr, sys_tables_ptr, sys_lens_ptr, block_tables_ptr, seq_lens_ptr,
    counts_ptr, out_ptr, lse_ptr,
    scale_log2, num_kv_heads, sys_splits, ctx_splits, sys_programs,
    stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_st, stride_bt,
    stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, CTX_G: tl.constexpr, TILE_T: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    CTX_N: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, FUSED: tl.constexpr,
):
    """System programs (the longer ones, first) and context programs in one launch, so the two
    parts share the GPU instead of each leaving a tail; partials land at splits [0, ctx_splits)
    (context) and [ctx_splits, ctx_splits + sys_splits) (system) for one reduction.

    ``FUSED``: that reduction happens in this launch, by whichever program completes a row
    (``_arrive_and_reduce``). ``PDL``: the separate reduction (a programmatic dependent launch) may
    be scheduled from the start."""
    pid = tl.program_id(0)
    num_heads = num_kv_heads * GROUP
    num_parts = sys_splits + ctx_splits
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if pid < sys_programs:
        per_tile = num_kv_heads * sys_splits
        rem = pid % per_tile
        _system_program(
            pid // per_tile, rem // sys_splits, rem % sys_splits,
            q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, tile_tokens_ptr, tile_system_ptr,
            sys_tables_ptr, sys_lens_ptr, scale_log2, sys_splits, ctx_splits,
            stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_st,
            GROUP, BLOCK_G, TILE_T, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, PREC,
        )
        if FUSED:  # the tile's rows, as _system_program lays them out
            tile = pid // per_tile
            offs_r = tl.arange(0, TILE_T * BLOCK_G)
            g = offs_r % BLOCK_G
            row_token = tl.load(tile_tokens_ptr + tile * TILE_T + offs_r // BLOCK_G).to(tl.int64)
            _arrive_and_reduce(
                tl.maximum(row_token, 0), (rem // sys_splits) * GROUP + g, (row_token >= 0) & (g < GROUP), counts_ptr,
                num_heads, num_parts, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
                stride_pt, stride_ps, stride_ph, stride_plt, stride_pls, stride_ot, stride_oh, stride_lt,
                HEAD_DIM, BLOCK_D,
            )
    else:
        p = pid - sys_programs
        per_seq = num_kv_heads * ctx_splits
        rem = p % per_seq
        seq = p // per_seq
        decode_program(
            seq, rem // ctx_splits, rem % ctx_splits,
            q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
            scale_log2, 0, ctx_splits, stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            GROUP, CTX_G, HEAD_DIM, BLOCK_D, PAGE, CTX_N, False, PREC,
        )
        if FUSED:  # a padding row of a captured batch (no tokens, in no tile) counts nothing
            offs_g = tl.arange(0, CTX_G)
            seq_rows = tl.full([CTX_G], 0, tl.int64) + seq
            has_tokens = (tl.full([CTX_G], 0, tl.int32) + tl.load(seq_lens_ptr + seq)) > 0
            _arrive_and_reduce(
                seq_rows, (rem // ctx_splits) * GROUP + offs_g, (offs_g < GROUP) & has_tokens,
                counts_ptr, num_heads, num_parts, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
                stride_pt, stride_ps, stride_ph, stride_plt, stride_pls, stride_ot, stride_oh, stride_lt,
                HEAD_DIM, BLOCK_D,
            )


@triton.jit
def _system_program(
    tile, kv_head, split,
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    tile_tokens_ptr, tile_system_ptr, sys_tables_ptr, sys_lens_ptr,
    scale_log2, num_splits, split_offset,
    stride_qt, stride_qh, stride_pt, stride_ps, stride_ph, stride_plt, stride_pls,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_st,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TILE_T: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """The tile's rows (token slot r // BLOCK_G, query head kv_head * GROUP + r % BLOCK_G) attend to
    share ``split`` of their system prompt's keys, all visible. Writes normalised partials at split
    ``split_offset + split``; an empty share writes out 0, lse -inf (a token behind no system prompt
    gets only empty shares)."""
    system = tl.load(tile_system_ptr + tile)
    has_system = system >= 0
    system = tl.maximum(system, 0)
    sys_len = tl.where(has_system, tl.load(sys_lens_ptr + system), 0)
    share = tl.cdiv(tl.cdiv(sys_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * share
    end = tl.minimum(start + share, sys_len)
    offs_r = tl.arange(0, TILE_T * BLOCK_G)
    g = offs_r % BLOCK_G
    token = tl.load(tile_tokens_ptr + tile * TILE_T + offs_r // BLOCK_G).to(tl.int64)
    row_ok = (token >= 0) & (g < GROUP)
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    table_ptr = sys_tables_ptr + system.to(tl.int64) * stride_st
    q_pos = tl.full([TILE_T * BLOCK_G], 0, tl.int32) + end - 1  # every key of the share is visible
    m_i = tl.full([TILE_T * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_T * BLOCK_G], tl.float32)
    acc = tl.zeros([TILE_T * BLOCK_G, BLOCK_D], tl.float32)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for start_n in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, 0,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, False, False, PREC,
        )
    for start_n in range(full_end, end, BLOCK_N):  # the system's last, partial key tile
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, q_pos, end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, 0,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, False, PREC,
        )
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    at = split_offset + split
    tl.store(part_out_ptr + token[:, None] * stride_pt + at * stride_ps + heads[:, None] * stride_ph + offs_d[None, :],
             out.to(part_out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + token * stride_plt + at * stride_pls + heads, lse, mask=row_ok)


# Programs per multiprocessor that relay decode's context split count aims at (before the minimum
# below): on an H100 one beat two (kernels/NOTES.md): fewer partials to write and reduce, longer runs
# over the keys per program.
RELAY_PROGRAMS_PER_SM = 1.0
# The same for the system part's shares, by how long the sequences' own contexts may be. The system
# kernel runs on a side stream beside the context programs. With contexts of up to
# ``RELAY_SHORT_CONTEXT`` tokens (the op benchmark's 128-256) the system part is the longer one and
# one program per multiprocessor is best; where contexts may run longer (the engine's decode graphs,
# sized for any length; ShareGPT-length prompts and answers) the context programs fill the GPU, and
# fewer, longer system programs, with fewer partials to reduce, win: on an H100, Mistral-7B end to end
# at s=2K, 64 ShareGPT requests, 0.5 (3 shares at 64 sequences instead of 5) made relay 1.2% faster
# than 1.0 in two A/B runs, 0.25 2.4% slower; at the op's b=32, c=128 it was 20% slower (NOTES.md).
RELAY_SYSTEM_PROGRAMS_PER_SM = 0.5
RELAY_SHORT_CONTEXT = 256
# Context splits relay decode launches at least. A batch's own contexts are ragged (ShareGPT prompts run
# from 4 to 512 tokens), and with one program per (sequence, KV head) the longest contexts set the
# launch's time. On an H100 (Mistral-7B layout, 2K system prompt, ShareGPT-like lengths; kernels/NOTES.md)
# 3 splits made relay's attention 13-22% faster at 16 to 64 sequences than the per-SM rule's 1-2.
RELAY_MIN_CONTEXT_SPLITS = 3


def relay_system_programs_per_sm(max_seq_len: int) -> float:
    """Programs per multiprocessor the system shares aim at, for own contexts of up to ``max_seq_len``."""
    return RELAY_PROGRAMS_PER_SM if max_seq_len <= RELAY_SHORT_CONTEXT else RELAY_SYSTEM_PROGRAMS_PER_SM


def relay_context_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of each sequence's own keys in relay decode: the per-SM rule, but at least
    ``RELAY_MIN_CONTEXT_SPLITS`` where the context may be that long (host ints, as for graphs)."""
    rule = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, device, RELAY_PROGRAMS_PER_SM)
    return max(rule, min(RELAY_MIN_CONTEXT_SPLITS, math.ceil(max(1, max_seq_len) / _DECODE_BLOCK_N)))


def system_num_splits(
    num_tiles: int, num_kv_heads: int, max_sys_len: int, device: torch.device, per_sm: float = 2.0
) -> int:
    """Shares of the system keys so the grid has about ``per_sm`` programs per multiprocessor; from
    host ints only, so a captured graph's count stays valid for every system prompt it replays with."""
    want = math.ceil(per_sm * _sm_count(device) / max(1, num_tiles * num_kv_heads))
    return max(1, min(_MAX_SPLITS, want, math.ceil(max(1, max_sys_len) / _SYSTEM_BLOCK_N)))


def system_partials_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sys_tables: torch.Tensor,
    sys_lens: torch.Tensor,
    tile_tokens: torch.Tensor,
    tile_system: torch.Tensor,
    scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    split_offset: int = 0,
    launch: dict[str, int] | None = None,
) -> None:
    """Write the system partials of every token into splits ``[split_offset, split_offset +
    num_splits)`` of ``part_out`` [tokens, splits, heads, head_dim] / ``part_lse``. ``launch``:
    ``block_n``, ``num_warps``, ``num_stages`` (relay decode passes its tuning's).

    ``tile_tokens`` [tiles * tokens_per_tile] int32 (-1 padded) and ``tile_system`` [tiles] int32
    come from ``relay.system_tiles``; ``sys_tables`` [systems, blocks] int32, ``sys_lens`` [systems].
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    num_tiles = tile_system.shape[0]
    tile_t = tile_tokens.shape[0] // max(1, num_tiles)
    if num_tiles == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    launch = launch or {}
    _system_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, tile_tokens, tile_system, sys_tables, sys_lens,
        scale * _LOG2E, num_splits, split_offset,
        q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        *_cache_strides(k_cache), *_cache_strides(v_cache), sys_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, TILE_T=tile_t, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1], BLOCK_N=launch.get("block_n", _SYSTEM_BLOCK_N) if q.is_cuda else 16,
        PREC=_dot_precision(q.dtype), num_warps=launch.get("num_warps", 4),
        **({"num_stages": launch["num_stages"]} if "num_stages" in launch and q.is_cuda else {}),
    )


def system_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sys_tables: torch.Tensor,
    sys_lens: torch.Tensor,
    tile_tokens: torch.Tensor,
    tile_system: torch.Tensor,
    scale: float,
    max_sys_len: int,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``relay.system_attention_ref`` (the tiles stand for its ``token_system``).

    ``max_sys_len`` (a host int) only bounds the default split count.
    """
    tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((tokens, num_heads), dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    if num_splits is None:
        num_splits = system_num_splits(tile_system.shape[0], k_cache.shape[2], max_sys_len, q.device)
    if num_splits == 1:
        part_out, part_lse = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        part_out, part_lse = split_buffers(tokens, num_splits, num_heads, head_dim, q.device)
    system_partials_triton(q, k_cache, v_cache, sys_tables, sys_lens, tile_tokens, tile_system, scale,
                           part_out, part_lse, num_splits)
    if num_splits > 1:
        reduce_splits_triton(part_out, part_lse, out, lse)
    return out, lse


@dataclass(frozen=True)
class RelayTuning:
    """Launch parameters of relay decode; the defaults are the best measured on an H100
    (kernels/NOTES.md, ``python -m ragfuse.bench.relay_profile``)."""

    num_warps: int = 4
    num_stages: int = 2  # 3 (Triton's default) holds more shared memory: fewer programs per multiprocessor
    sys_block_n: int = _SYSTEM_BLOCK_N
    ctx_block_n: int = _DECODE_BLOCK_N
    half_partials: bool = False  # partials stored in the model's 16-bit dtype: half the bytes of float32
    pdl: bool = False  # the reduction launched as a programmatic dependent of the partials (Hopper+)
    fused_reduce: bool = False  # no reduction launch: the program completing a row merges it
    streams: int = 2  # system and context partials as two kernels on two streams, each its own footprint (1: one)


DEFAULT_TUNING = RelayTuning()


def relay_partials_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sys_tables: torch.Tensor,
    sys_lens: torch.Tensor,
    tile_tokens: torch.Tensor,
    tile_system: torch.Tensor,
    scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    num_splits: int,
    sys_splits: int,
    tuning: RelayTuning,
    only: str | None = None,
    fused: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The context partials (splits ``[0, num_splits)``) and the system partials (the
    ``sys_splits`` after them) of relay decode, in one launch. ``only`` ("system" or "context")
    launches just that part's programs: for timing where the time goes, not for results.
    ``fused`` = (out, lse): the launch also reduces the partials into them (``_arrive_and_reduce``);
    every sequence with tokens must then sit in exactly one tile."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_tiles = tile_system.shape[0]
    sys_programs = num_tiles * num_kv_heads * sys_splits
    ctx_programs = num_seqs * num_kv_heads * num_splits
    if only == "context":
        sys_programs = 0
    elif only == "system":
        ctx_programs = 0
    if q.stride(-1) != 1:
        q = q.contiguous()
    cuda = q.is_cuda
    out, lse = fused if fused is not None else (part_out, part_lse)  # unused without fusion
    counts = _row_counts(num_seqs * num_heads, q.device) if fused is not None else seq_lens
    _relay_decode_kernel[(sys_programs + ctx_programs,)](
        q, k_cache, v_cache, part_out, part_lse, tile_tokens, tile_system, sys_tables, sys_lens, block_tables,
        seq_lens, counts, out, lse, scale * _LOG2E, num_kv_heads, sys_splits, num_splits, sys_programs,
        q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        *_cache_strides(k_cache), *_cache_strides(v_cache), sys_tables.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), CTX_G=max(16, triton.next_power_of_2(group)),
        TILE_T=tile_tokens.shape[0] // max(1, num_tiles), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1], BLOCK_N=tuning.sys_block_n if cuda else 16, CTX_N=tuning.ctx_block_n if cuda else 16,
        PREC=_dot_precision(q.dtype), PDL=tuning.pdl and cuda and fused is None, FUSED=fused is not None,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages if cuda else 1,
    )


def relay_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sys_tables: torch.Tensor,
    sys_lens: torch.Tensor,
    tile_tokens: torch.Tensor,
    tile_system: torch.Tensor,
    scale: float,
    max_seq_len: int,
    max_sys_len: int,
    num_splits: int | None = None,
    sys_splits: int | None = None,
    tuning: RelayTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence over its system prompt and its own paged context, exactly:
    equals ``merge_attention_ref(system_attention_ref(...), paged_decode_attention_ref(...))``.

    ``seq_lens`` count each sequence's own tokens (its context, after the system prompt). By default
    two launches: the context and system partials together, then one reduction of both (the relay
    fusion). ``tuning`` may fold the reduction into the first launch (``fused_reduce``: every sequence
    with tokens must then sit in exactly one tile, as ``relay.system_tiles`` makes them) or run the two
    parts as two kernels on two streams (``streams=2``); kernels/NOTES.md has their H100 timings.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out, lse
    tuning = tuning or DEFAULT_TUNING
    if num_splits is None:
        num_splits = relay_context_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    if sys_splits is None:
        sys_splits = system_num_splits(tile_system.shape[0], num_kv_heads, max_sys_len, q.device,
                                       relay_system_programs_per_sm(max_seq_len))
    part_out, part_lse = split_buffers(num_seqs, num_splits + sys_splits, num_heads, head_dim, q.device,
                                       q.dtype if tuning.half_partials and q.dtype != torch.float32 else None)
    if tuning.streams == 2 and q.is_cuda:  # each part its own kernel and footprint, side by side
        current = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device)
        side.wait_stream(current)
        # the tuning's stages and warps hold here too: with Triton's default 3 stages these two kernels
        # made Mistral-7B's end-to-end relay run 2.9% slower on an H200 (kernels/NOTES.md)
        common = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
        with torch.cuda.stream(side):
            system_partials_triton(q, k_cache, v_cache, sys_tables, sys_lens, tile_tokens, tile_system, scale,
                                   part_out, part_lse, sys_splits, split_offset=num_splits,
                                   launch={**common, "block_n": tuning.sys_block_n})
        decode_partials_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, None, part_out, part_lse,
                               num_splits, launch={**common, "block_n": tuning.ctx_block_n})
        current.wait_stream(side)
    else:
        relay_partials_triton(q, k_cache, v_cache, block_tables, seq_lens, sys_tables, sys_lens, tile_tokens,
                              tile_system, scale, part_out, part_lse, num_splits, sys_splits, tuning,
                              fused=(out, lse) if tuning.fused_reduce else None)
        if tuning.fused_reduce:
            return out, lse
    reduce_splits_triton(part_out, part_lse, out, lse, pdl=tuning.pdl and q.is_cuda)
    return out, lse


_COUNTS: dict[torch.device, list[torch.Tensor]] = {}
_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _row_counts(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for ``n`` (token, head) rows, kept between launches (each launch leaves
    them at zero). Buffers are never freed: captured graphs keep their addresses."""
    held = _COUNTS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("relay counters must exist before graph capture: run the batch once first")
        held.append(torch.zeros(max(n, 1 << 15), dtype=torch.int32, device=device))
    return held[-1]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]
