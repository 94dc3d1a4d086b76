"""Merge two partial attentions over disjoint key sets by their log-sum-exp.

If o_a, o_b are softmax-attention outputs over key sets A and B with log-sum-exp lse_a, lse_b, the
attention over A u B is o = w_a*o_a + w_b*o_b with w_x = exp(lse_x - lse), lse = logaddexp(lse_a, lse_b).
This is exact; relay attention and split-K decode both reduce to it.
"""

from __future__ import annotations

import torch


def merge_attention_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out_*`` [tokens, heads, head_dim], ``lse_*`` [tokens, heads] float32 -> merged (out, lse).

    An empty side carries lse = -inf and contributes nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    out = w_a * out_a.float() + w_b * out_b.float()
    return out.to(out_a.dtype), lse
