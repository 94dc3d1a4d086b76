"""Scratch variants of the mass-direction walk (not shipped): FUSED = one score dot over the whole head_dim
(K and its RoPE partner loaded full width) and one dot for cos|sin; knobs for warps and stages."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragfuse.kernels.paged_attention_triton import _LOG2E, _dot_precision
from ragfuse.kernels import mass_direction_triton as shipped

_BLOCK_R, _BLOCK_T, _WARPS, _STAGES, _FUSED = 64, 32, 4, 3, 1


@triton.jit
def _fused_kernel(
    q_ptr, ok_ptr, k_ptr, at_ptr, cos_ptr, sin_ptr, bounds_ptr, out_ptr, W, scale_log2,
    stride_qw, stride_qh, stride_kt, stride_kh, stride_cos,
    GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    PREC: tl.constexpr,
):
    g = tl.program_id(0)
    rb = tl.program_id(1)
    s = tl.program_id(2)
    kv_heads = tl.num_programs(0)
    segments = tl.num_programs(2)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    j = offs_r // GROUP
    row_ok = j < W
    row_ok = row_ok & (tl.load(ok_ptr + j, mask=row_ok, other=0) != 0)
    d = tl.arange(0, 2 * BLOCK_H)
    f = d % BLOCK_H
    first = d < BLOCK_H
    f_ok = f < HALF
    dim = f + tl.where(first, 0, HALF)
    partner = f + tl.where(first, HALF, 0)
    sign = tl.where(first, -1.0, 1.0)
    dt = q_ptr.dtype.element_ty
    q_at = q_ptr + j[:, None] * stride_qw + (g * GROUP + offs_r % GROUP)[:, None] * stride_qh
    q = tl.load(q_at + dim[None, :], mask=row_ok[:, None] & f_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, 2 * BLOCK_H], tl.float32)  # columns: C | S
    stop = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, end, start)
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        tf_ok = t_ok[:, None] & f_ok[None, :]
        pos = tl.load(at_ptr + t, mask=t_ok, other=0).to(tl.int64)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + f[None, :], mask=tf_ok, other=0.0)
        sn = tl.load(sin_ptr + pos[:, None] * stride_cos + f[None, :], mask=tf_ok, other=0.0)
        k_at = k_ptr + t.to(tl.int64)[:, None] * stride_kt + g * stride_kh
        k = tl.load(k_at + dim[None, :], mask=tf_ok, other=0.0).to(tl.float32)
        kp = tl.load(k_at + partner[None, :], mask=tf_ok, other=0.0).to(tl.float32)
        r = (k * c + kp * sn * sign[None, :]).to(dt)
        sc = tl.dot(q, tl.trans(r), input_precision=PREC)
        sc = tl.where(t_ok[None, :], sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        cs = tl.where(first[None, :], c, sn).to(dt)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), cs, input_precision=PREC)
        m_i = m_new
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    acc = acc * inv[:, None]
    cw, sw = tl.split(tl.permute(tl.reshape(acc, [BLOCK_R, 2, BLOCK_H]), [0, 2, 1]))
    q1, q2 = tl.split(tl.permute(tl.reshape(q.to(tl.float32), [BLOCK_R, 2, BLOCK_H]), [0, 2, 1]))
    u1 = tl.where(row_ok[:, None], q1 * cw + q2 * sw, 0.0)
    u2 = tl.where(row_ok[:, None], q2 * cw - q1 * sw, 0.0)
    fh = tl.arange(0, BLOCK_H)
    out = out_ptr + ((rb * segments + s) * kv_heads + g) * (2 * HALF) + fh
    tl.store(out, tl.sum(u1, 0), mask=fh < HALF)
    tl.store(out + HALF, tl.sum(u2, 0), mask=fh < HALF)


@triton.jit
def _lean_kernel(
    q_ptr, ok_ptr, k_ptr, at_ptr, cos_ptr, sin_ptr, bounds_ptr, out_ptr, W, scale_log2,
    stride_qw, stride_qh, stride_kt, stride_kh, stride_cos,
    GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    PREC: tl.constexpr,
):
    g = tl.program_id(0)
    rb = tl.program_id(1)
    s = tl.program_id(2)
    kv_heads = tl.num_programs(0)
    segments = tl.num_programs(2)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    j = offs_r // GROUP
    row_ok = j < W
    row_ok = row_ok & (tl.load(ok_ptr + j, mask=row_ok, other=0) != 0)
    row_ok = row_ok & (tl.zeros([BLOCK_R], tl.int32) + (end - start) > 0)  # an empty segment (most of a graph's 64) loads nothing
    f = tl.arange(0, BLOCK_H)  # a head_dim / 2 short of a power of two is padded with zeros
    f_ok = f < HALF
    q_at = q_ptr + j[:, None] * stride_qw + (g * GROUP + offs_r % GROUP)[:, None] * stride_qh + f[None, :]
    # the products run in the model's dtype (float32 ones stay exact: PREC is "ieee" for them)
    dt = q_ptr.dtype.element_ty
    q1 = tl.load(q_at, mask=row_ok[:, None] & f_ok[None, :], other=0.0)
    q2 = tl.load(q_at + HALF, mask=row_ok[:, None] & f_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc_c = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    acc_s = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    # a block of padding rows only (a graph's question window past the real question) skips the walk
    stop = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, end, start)
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
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # a segment without rows: zeros
    cw = acc_c * inv[:, None]
    sw = acc_s * inv[:, None]
    u1 = tl.where(row_ok[:, None], q1 * cw + q2 * sw, 0.0)
    u2 = tl.where(row_ok[:, None], q2 * cw - q1 * sw, 0.0)
    out = out_ptr + ((rb * segments + s) * kv_heads + g) * (2 * HALF) + f
    tl.store(out, tl.sum(u1, 0), mask=f_ok)
    tl.store(out + HALF, tl.sum(u2, 0), mask=f_ok)



def _mass_parts(q, ok, k, at, cos, sin, bounds, scale):
    num_segments = bounds.shape[0] - 1
    w_rows, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    group = heads // kv_heads
    q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    row_blocks = triton.cdiv(w_rows * group, _BLOCK_R)
    parts = torch.empty(row_blocks, num_segments, kv_heads, dim, dtype=torch.float32, device=q.device)
    kern = {0: shipped._mass_direction_kernel, 1: _fused_kernel, 2: _lean_kernel}[_FUSED]
    kern[(kv_heads, row_blocks, num_segments)](
        q, ok, k, at, cos, sin, bounds, parts, w_rows, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        GROUP=group, HALF=half, BLOCK_H=max(16, triton.next_power_of_2(half)), BLOCK_R=_BLOCK_R, BLOCK_T=_BLOCK_T,
        PREC=_dot_precision(q.dtype), num_warps=_WARPS, num_stages=_STAGES,
    )
    return parts


def cap_k_shift_triton(mk, q, ok, k, at, cos, sin, bounds, limit, scale):
    segments, kv_heads, dim = mk.shape
    parts = _mass_parts(q, ok, k, at, cos, sin, bounds, scale)
    out = torch.empty_like(mk)
    shipped._cap_kernel[(segments * kv_heads,)](
        parts, mk.contiguous(), ok, limit, out, q.shape[0], parts.shape[0], segments * kv_heads * dim,
        q.shape[1] // kv_heads, scale, DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_W=max(16, triton.next_power_of_2(q.shape[0])), num_warps=1,
    )
    return out
