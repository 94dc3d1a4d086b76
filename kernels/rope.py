"""Rotary position embedding (rotate-half layout, as Llama/Mistral/Qwen2 checkpoints expect).

RoPE is a rotation per frequency pair with angle ``position * inv_freq``, so rotating by ``a`` then
by ``b`` equals rotating by ``a + b``. That is why stored K can be moved to a new offset by rotating
it again by the difference (the fusion and session paths rely on this). The tables therefore hold
pure rotations only: a scaling that also multiplies cos and sin (YaRN's attention factor) multiplies
every q·k by its square, which the model applies to its attention scale instead, since a factor in
the tables would be applied again each time stored K is moved.
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
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """Inverse frequencies, with linear, Llama-3.1 ("llama3") or YaRN ("yarn") scaling applied.

    Any other type is a ValueError rather than plain frequencies: a scaling that changes with the
    sequence length (dynamic NTK) cannot be one fixed table, and serving a model other frequencies
    than it was trained with gives wrong logits without a word. YaRN's attention factor is no part
    of the frequencies: the caller folds it into the attention scale, so these tables stay pure
    rotations that compose (see the module docstring)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling_type == "yarn":
        return _yarn_inv_frequencies(theta ** exponents, head_dim, theta, factor, original_max_position,
                                     beta_fast, beta_slow, truncate)
    inv = 1.0 / (theta**exponents)
    if scaling_type == "default":
        return inv
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
    raise ValueError(f"unsupported rope scaling type {scaling_type!r}")


def _yarn_inv_frequencies(
    wavelengths: torch.Tensor, head_dim: int, theta: float, factor: float, original_max_position: int,
    beta_fast: float, beta_slow: float, truncate: bool,
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn more than ``beta_fast`` times over the original
    context keep their frequency, those turning fewer than ``beta_slow`` times are interpolated
    (divided by ``factor``), and a linear ramp over the dimension index blends the two in between.
    ``wavelengths`` are ``theta ** (2i / head_dim)``; the interpolated frequency is computed as
    ``1 / (factor * wavelength)``, the same float32 operations transformers uses, so the tables agree
    bit for bit."""

    def dim_turning(turns: float) -> float:
        """The (fractional) dimension index whose frequency turns ``turns`` times over the original context."""
        return head_dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width: a step at ``low`` instead of a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its trained frequency; 0: it is interpolated
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


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
