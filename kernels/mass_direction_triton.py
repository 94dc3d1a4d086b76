"""The K shift's mass direction per segment and its cap, in Triton (contract: ``mass_direction.py``).

A program per (KV head, block of 64 query rows) and share of the segments walks each of its segments'
stored rows once, 32 a step: rotates their K to their positions, scores the rows' queries against them, and
keeps a running (online-softmax) max, sum and softmax-weighted sums of the rows' cos and sin, so no score
tensor is ever in memory. It writes its rows' sum of ``u`` per segment to its own slot; a torch sum over the
row blocks finishes (no atomics: a CUDA graph and the eager pass get the same values); for the cap, one
program per (segment, KV head) sums them and caps the shift (one launch for ~20 torch ops). The torch ops
this replaces were ~0.6 ms a layer on an H200 (Mistral-7B shape, 6 x 512 stored tokens, 64 question
rows), half the fused pass's time; scattering the segments' max and sum hit a few addresses with
thousands of atomics each. Tiles of a segment's rows as programs of their own, in two passes (each row's
max and sum per tile, then its softmax over the segment), took longer than this walk: many short programs,
each one latency chain (kernels/NOTES.md, Round 10); how the launch was tuned: Round 11.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_triton import _LOG2E, _dot_precision

# 64 rows x 64-row steps, 4 warps, no software pipelining: 28.8 us a layer in a CUDA graph on an H200 at the
# Mistral-7B shape with 16 segment programs (32-row steps: 32.0-32.7; 16: 40; the next step's loads issued
# before this step's math: slower), 44 with Triton's default 3 stages, 71 with 8 warps
_BLOCK_R = 64  # query rows (question tokens x the group's heads) a program holds
_BLOCK_T = 64  # stored rows a step
_WARPS = 4
_STAGES = 1
# programs per (KV head, row block) sharing out the segments: a graph's 64 segments as 64 programs each cost
# about as much as the real walks (22 of 34 us with no segment to walk); a pass seldom has more real ones
_SEGMENT_PROGRAMS = 16


@triton.jit
def _mass_direction_kernel(
    q_ptr, ok_ptr, k_ptr, at_ptr, cos_ptr, sin_ptr, bounds_ptr, out_ptr, W, segments, scale_log2,
    stride_qw, stride_qh, stride_kt, stride_kh, stride_cos,
    GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    PREC: tl.constexpr,
):
    g = tl.program_id(0)
    rb = tl.program_id(1)
    kv_heads = tl.num_programs(0)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    j = offs_r // GROUP
    row_ok = j < W
    row_ok = row_ok & (tl.load(ok_ptr + j, mask=row_ok, other=0) != 0)
    # a block of padding rows only (a graph's question window past the real question) walks nothing
    any_row = tl.max(row_ok.to(tl.int32), 0) > 0
    f = tl.arange(0, BLOCK_H)  # a head_dim / 2 short of a power of two is padded with zeros
    f_ok = f < HALF
    q_at = q_ptr + j[:, None] * stride_qw + (g * GROUP + offs_r % GROUP)[:, None] * stride_qh + f[None, :]
    # the products run in the model's dtype (float32 ones stay exact: PREC is "ieee" for them)
    dt = q_ptr.dtype.element_ty
    q1 = tl.load(q_at, mask=row_ok[:, None] & f_ok[None, :], other=0.0)
    q2 = tl.load(q_at + HALF, mask=row_ok[:, None] & f_ok[None, :], other=0.0)
    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    # the segments s = this program's index + a multiple of the programs (a graph's 64 segments are
    # mostly empty: one program each, with its own q, cost more than the real walks)
    for s in range(tl.program_id(2), segments, tl.num_programs(2)):
        start = tl.load(bounds_ptr + s)
        end = tl.load(bounds_ptr + s + 1)
        stop = tl.where(any_row, end, start)
        su1 = tl.zeros([BLOCK_H], tl.float32)  # a segment without rows, or no real row: zeros
        su2 = tl.zeros([BLOCK_H], tl.float32)
        if stop > start:
            m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_R], tl.float32)
            acc_c = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
            acc_s = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
            for t0 in range(start, stop, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                t_ok = t < end
                tf_ok = t_ok[:, None] & f_ok[None, :]
                pos = tl.load(at_ptr + t, mask=t_ok, other=0).to(tl.int64)
                c = tl.load(cos_ptr + pos[:, None] * stride_cos + f[None, :], mask=tf_ok, other=0.0)
                sn = tl.load(sin_ptr + pos[:, None] * stride_cos + f[None, :], mask=tf_ok, other=0.0)
                k_at = k_ptr + t.to(tl.int64)[:, None] * stride_kt + g * stride_kh + f[None, :]
                k1 = tl.load(k_at, mask=tf_ok, other=0.0).to(tl.float32)
                k2 = tl.load(k_at + HALF, mask=tf_ok, other=0.0).to(tl.float32)
                r1 = (k1 * c - k2 * sn).to(dt)  # K rotated to its position, as the cache holds it
                r2 = (k2 * c + k1 * sn).to(dt)
                sc = tl.dot(q1, tl.trans(r1), input_precision=PREC) + tl.dot(q2, tl.trans(r2), input_precision=PREC)
                sc = tl.where(t_ok[None, :], sc * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: every step has a real row
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc_c = acc_c * alpha[:, None] + tl.dot(p.to(dt), c.to(dt), input_precision=PREC)
                acc_s = acc_s * alpha[:, None] + tl.dot(p.to(dt), sn.to(dt), input_precision=PREC)
                m_i = m_new
            inv = 1.0 / l_i
            cw = acc_c * inv[:, None]
            sw = acc_s * inv[:, None]
            su1 = tl.sum(tl.where(row_ok[:, None], q1f * cw + q2f * sw, 0.0), 0)
            su2 = tl.sum(tl.where(row_ok[:, None], q2f * cw - q1f * sw, 0.0), 0)
        out = out_ptr + ((rb * segments + s) * kv_heads + g) * (2 * HALF) + f
        tl.store(out, su1, mask=f_ok)
        tl.store(out + HALF, su2, mask=f_ok)


def mass_parts_triton(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bounds: torch.Tensor, scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cap's first launch: each row block's sum of ``u`` [row blocks, segments, KVH, D] float32,
    into ``out`` where given (``mass_parts_like``). It reads no shift, so it may run beside the work that
    makes one (``ops.begin_k_mass_cap``)."""
    w_rows, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    group = heads // kv_heads
    q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    segments = bounds.shape[0] - 1
    parts = mass_parts_like(q, k, bounds) if out is None else out
    _mass_direction_kernel[(kv_heads, parts.shape[0], min(segments, _SEGMENT_PROGRAMS))](
        q, ok, k, at, cos, sin, bounds, parts, w_rows, segments, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        GROUP=group, HALF=half, BLOCK_H=max(16, triton.next_power_of_2(half)), BLOCK_R=_BLOCK_R, BLOCK_T=_BLOCK_T,
        PREC=_dot_precision(q.dtype), num_warps=_WARPS, num_stages=_STAGES,
    )
    return parts


def mass_parts_like(q: torch.Tensor, k: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """An empty buffer for ``mass_parts_triton``'s row-block sums of queries ``q`` [W, H, D] over stored
    K ``k`` [T, KVH, D] in ``bounds.shape[0] - 1`` segments."""
    w_rows, heads, dim = q.shape
    row_blocks = triton.cdiv(w_rows * (heads // k.shape[1]), _BLOCK_R)
    return torch.empty(row_blocks, bounds.shape[0] - 1, k.shape[1], dim, dtype=torch.float32, device=q.device)


def mass_direction_triton(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bounds: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as ``mass_direction.mass_direction_ref``, any even head_dim. Launch sizes depend on
    the shapes alone and nothing is read on the host: CUDA-graph safe."""
    parts = mass_parts_triton(q, ok, k, at, cos, sin, bounds, scale)
    return parts.sum(0) / (ok.sum() * (q.shape[1] // k.shape[1])).clamp(min=1)


@triton.jit
def _cap_kernel(
    parts_ptr, mk_ptr, ok_ptr, limit_ptr, out_ptr, W, row_blocks, per_block, group, scale,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    sg = tl.program_id(0)  # segment x KV head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    for rb in range(0, row_blocks):
        acc += tl.load(parts_ptr + rb * per_block + sg * DIM + d, mask=d_ok, other=0.0)
    w = tl.arange(0, BLOCK_W)
    real = (tl.load(ok_ptr + w, mask=w < W, other=0) != 0).to(tl.float32)
    ub = acc / tl.maximum(tl.sum(real, 0) * group, 1.0)
    delta = tl.load(mk_ptr + sg * DIM + d, mask=d_ok, other=0.0)
    move = scale * tl.sum(ub * delta, 0)
    over = tl.abs(move) - tl.load(limit_ptr)
    norm = tl.maximum(scale * tl.sum(ub * ub, 0), 1e-30)
    cut = tl.where(over > 0, over * tl.where(move > 0, 1.0, -1.0) / norm, 0.0)
    tl.store(out_ptr + sg * DIM + d, delta - cut * ub, mask=d_ok)


def cap_from_parts_triton(
    parts: torch.Tensor, mk: torch.Tensor, ok: torch.Tensor, limit: torch.Tensor, scale: float, group: int,
) -> torch.Tensor:
    """The cap's second launch: ``mk`` [segments, KVH, D] capped with the row blocks' sums ``parts``
    (``mass_parts_triton``) of ``ok.shape[0]`` question rows over ``group`` query heads a KV head."""
    segments, kv_heads, dim = mk.shape
    out = torch.empty_like(mk)
    _cap_kernel[(segments * kv_heads,)](
        parts, mk.contiguous(), ok, limit, out, ok.shape[0], parts.shape[0], segments * kv_heads * dim,
        group, scale, DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_W=max(16, triton.next_power_of_2(ok.shape[0])), num_warps=1,
    )
    return out


def cap_k_shift_triton(
    mk: torch.Tensor, q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, bounds: torch.Tensor, limit: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as ``mass_direction.cap_k_shift_ref``: two launches."""
    parts = mass_parts_triton(q, ok, k, at, cos, sin, bounds, scale)
    return cap_from_parts_triton(parts, mk, ok, limit, scale, q.shape[1] // mk.shape[1])
