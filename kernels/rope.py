"""Rotary position embedding (rotate-half layout, as Llama/Mistral/Qwen2 checkpoints expect).

RoPE is a rotation per frequency pair with angle ``position * inv_freq``, so rotating by ``a`` then
by ``b`` equals rotating by ``a + b``. That is why stored K can be moved to a new offset by rotating
it again by the difference (the fusion and session paths rely on this).
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(
    head_dim: int,
    theta: float,
    scaling_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """Inverse frequencies, with Llama-3.1 ("llama3") or linear scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling_type == "linear":
        return inv / factor
    if scaling_type == "llama3":
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    return inv


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, float32, shape [max_positions, head_dim/2]."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return freqs.cos(), freqs.sin()


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim] to ``positions`` [tokens]; returns a new tensor.

    Positions may be negative-free offsets of any size inside the table; re-rotating stored K by a
    delta uses the same call with ``positions = delta``.
    """
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
