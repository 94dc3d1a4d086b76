"""Rotary embedding in Triton: q and k of a step rotated in one launch, each token's cos/sin row
read once for all its heads.

Same rotate-half layout and contract as ``rope.apply_rope_ref``. Because rotations compose, the same
kernel moves stored K to a new offset: call it with ``positions`` = per-token position deltas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_token(
    x_ptr, out_ptr, token, n_heads, stride_xt, stride_xh, stride_ot, stride_oh, c, s, offs_d, d_mask,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate every head of one token; ``c``/``s`` are that token's [BLOCK_HALF] cos/sin."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < n_heads) & d_mask[None, :]
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * c[None, :] - x2 * s[None, :]).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    n_q_heads, n_k_heads,
    stride_qt, stride_qh, stride_qot, stride_qoh,
    stride_kt, stride_kh, stride_kot, stride_koh,
    stride_cos,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (token, which): which 0 rotates q's heads, 1 rotates k's (grid axis 1 has size 1 or 2)."""
    token = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if which == 0:
        _rotate_token(q_ptr, q_out_ptr, token, n_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
                      c, s, offs_d, d_mask, HALF, BLOCK_H)
    else:
        _rotate_token(k_ptr, k_out_ptr, token, n_k_heads, stride_kt, stride_kh, stride_kot, stride_koh,
                      c, s, offs_d, d_mask, HALF, BLOCK_H)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rope_qk_triton(
    q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, H, D] and, if given, k [T, KVH, D] to ``positions`` [T] in one launch.

    Inputs may be strided views (the q/k column slices of a packed qkv projection); outputs are new
    contiguous tensors, so the caller keeps the unrotated K (the KV hooks need it).
    """
    q = _unit_last(q)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_in = _unit_last(k) if k is not None else q
    k_out = torch.empty(k_in.shape, dtype=k_in.dtype, device=k_in.device) if k is not None else q_out
    tokens, _, head_dim = q.shape
    if not cos.is_contiguous():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    if tokens:
        _rope_kernel[(tokens, 2 if k is not None else 1)](
            q, q_out, k_in, k_out, positions, cos, sin,
            q.shape[1], k_in.shape[1],
            q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
            k_in.stride(0), k_in.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_H=triton.next_power_of_2(max(q.shape[1], k_in.shape[1])), num_warps=4,
        )
    return q_out, (k_out if k is not None else None)


def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as ``apply_rope_ref``; also re-rotates stored K when ``positions`` are deltas."""
    out, _ = apply_rope_qk_triton(x, None, positions, cos, sin)
    return out
