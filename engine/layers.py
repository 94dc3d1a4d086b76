"""Building blocks shared by every Llama-family model: RMSNorm, RoPE and the SwiGLU MLP.

Each block calls one op from ``ragfuse.kernels`` through ``ops`` so the Triton versions replace the
torch references on CUDA without the model code changing.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .config import ModelConfig, RopeConfig
from .errors import ModelError


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) whose product goes through ``ops.linear``."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, out)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, in_place: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normed ``x``. With it: (normed ``x + residual``, ``x + residual``),
        the sum written over ``residual`` where ``in_place``."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, in_place)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (float32) for every position the model supports, built once per model."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        if rope.scaling_type == "dynamic" and max_positions > rope.original_max_position:
            raise ModelError(f"dynamic NTK RoPE scaling changes the frequencies past {rope.original_max_position} "
                             f"positions, which cached KV cannot follow: the context must end there, not at "
                             f"{max_positions}")
        self.head_dim, self.rope, self.max_positions = head_dim, rope, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":  # a model built on "meta" gets its tables once it has memory
            self.build_tables(self.cos.device)  # (there, their math imported torch._dynamo)

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device`` in float32, whatever dtype the model is cast to. Pure
        rotations: YaRN's attention factor is in the attention scale (``ModelConfig.attention_scale``)."""
        from ragfuse.kernels.rope import cos_sin_table

        cos, sin = cos_sin_table(self.rope.inv_frequencies(self.head_dim), self.max_positions)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ops.apply_rope(x, positions, self.cos, self.sin)

    def rotate_qk(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated to ``positions`` (new tensors): one launch on CUDA, where a decode step's
        ~10 small kernels a layer cost about as much as its matmuls' weight reads."""
        return ops.apply_rope_qk(q, k, positions, self.cos, self.sin)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up packed into one matmul and the SiLU-and-multiply
    one pass over its output (``ops.silu_mul``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)), out)
