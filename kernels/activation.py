"""SwiGLU's gate: ``silu(gate) * up`` of a packed [..., 2 * intermediate] gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` holds gate in the first half of its last dimension and up
    in the second (the layout of the packed gate/up matmul). SiLU is rounded to the input dtype
    before the multiply, as torch's two kernels (and HF's MLP) round it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
