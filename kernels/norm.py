"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, the order HF Llama uses (so fp32 parity is exact)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the normed input and the new residual.
    ``in_place``: the new residual is written over ``residual`` (and returned), so a CUDA graph whose
    next replay reads the residual at a fixed address needs no copy into it."""
    residual = torch.add(x, residual, out=residual) if in_place else x + residual
    return rms_norm_ref(residual, weight, eps), residual
