"""A linear layer's matmul for a single row of input (decode at batch 1): ``x @ weight.T``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] with one row in all, ``weight`` [N, K] -> [..., N], as ``nn.Linear`` without bias."""
    return F.linear(x, weight)
