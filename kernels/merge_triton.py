"""Merge of two partial attentions by log-sum-exp, in one Triton pass (the reference makes ~8
element-wise kernels and float32 temporaries of the whole output). Same contract as
``merge.merge_attention_ref``; a side with lse = -inf contributes nothing, and two empty sides give
out = 0, lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr,
    n_heads, head_dim,
    stride_oat, stride_oah, stride_obt, stride_obh, stride_ot, stride_oh,
    stride_lat, stride_lbt, stride_lt,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < n_heads
    mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
    la = tl.load(la_ptr + token * stride_lat + offs_h, mask=h_mask, other=float("-inf"))
    lb = tl.load(lb_ptr + token * stride_lbt + offs_h, mask=h_mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    empty = total == 0.0
    inv = 1.0 / tl.where(empty, 1.0, total)
    oa = tl.load(oa_ptr + token * stride_oat + offs_h[:, None] * stride_oah + offs_d[None, :], mask=mask, other=0.0)
    ob = tl.load(ob_ptr + token * stride_obt + offs_h[:, None] * stride_obh + offs_d[None, :], mask=mask, other=0.0)
    out = oa.to(tl.float32) * (wa * inv)[:, None] + ob.to(tl.float32) * (wb * inv)[:, None]
    tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + token * stride_lt + offs_h, tl.where(empty, float("-inf"), m_safe + tl.log(total)), mask=h_mask)


def merge_attention_triton(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out_*`` [tokens, heads, head_dim], ``lse_*`` [tokens, heads] float32 -> merged (out, lse)."""
    tokens, heads, head_dim = out_a.shape
    if out_a.stride(-1) != 1:
        out_a = out_a.contiguous()
    if out_b.stride(-1) != 1:
        out_b = out_b.contiguous()
    lse_a, lse_b = lse_a.float(), lse_b.float()
    if lse_a.stride(-1) != 1:
        lse_a = lse_a.contiguous()
    if lse_b.stride(-1) != 1:
        lse_b = lse_b.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=out_a.device)
    if tokens:
        _merge_kernel[(tokens,)](
            out_a, lse_a, out_b, lse_b, out, lse,
            heads, head_dim,
            out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
            lse_a.stride(0), lse_b.stride(0), lse.stride(0),
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )
    return out, lse
