"""RMSNorm and residual-add + RMSNorm in Triton: one pass over each row instead of torch's five
element-wise kernels (add, square, mean, rsqrt-multiply, weight-multiply).

Rounding follows ``norm.py`` exactly: the residual sum is rounded to the input dtype, the row is
normalised in float32, cast back to the input dtype, then multiplied by the weight, so bf16 outputs
match the reference bit for bit up to the last multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_cols, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, hidden] with a unit last stride (the kernel addresses rows by one stride)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(n_rows, n_cols)
    res2 = _rows(residual) if residual is not None else x2
    res_out = (residual if in_place else torch.empty_like(x)) if residual is not None else None
    # in place: each program reads its row of the residual before it writes the sum over it; a view (never
    # a copy, whose sums would be lost), which a residual laid out otherwise refuses
    res_out2 = res_out.view(n_rows, n_cols) if res_out is not None else x2
    block = triton.next_power_of_2(n_cols)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, res2, weight, out2, res_out2,
            n_cols, x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_ref``: normalise the last dimension of ``x`` and scale by ``weight``."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``fused_add_rms_norm_ref``: ``(rms_norm(x + residual), x + residual)``."""
    if in_place and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"an in-place residual must have x's shape {tuple(x.shape)} and a unit last stride")
    out, res_out = _launch(x, residual, weight, eps, in_place)
    assert res_out is not None
    return out, res_out
