"""How much the question attends to each prompt position (torch reference).

Cache fusion weighs each stored token's KV deviation by the question's attention to it: a stale KV
that nobody attends to changes the answer little. At every check layer that is the softmax of the
question's queries (its last tokens, computed fresh) over the whole prompt's keys, averaged over
queries and heads. As torch ops that is a dozen launches and several passes over a
[kv_heads, queries x group, positions] float32 score tensor (~0.12 ms a check layer on an H100 at
3.5K positions); ``question_attention_triton`` reads each key twice and writes only the weights.
"""

from __future__ import annotations

import torch


def question_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    q_pos: torch.Tensor,
    n: torch.Tensor,
    scale: float,
    q_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean attention [P] float32 of the queries ``q`` [m, H, D] (rotated) to prompt positions
    0..P-1, whose rotated keys sit in the layer's pages ``k_cache`` [blocks, page, KVH, D] at
    ``slots`` [P]. Query i sees positions 0..``q_pos[i]``; positions from ``n`` (a 0-d tensor: the
    real prompt length, padding after it) are hidden from all. ``q_valid`` [m] marks the real queries
    (None: all): the weights average over them and every head, so they sum to 1.

    Each KV head's group of query heads is one batched product against its keys, in the model's
    dtype; the scores are then scaled and normalised in float32."""
    m, heads, dim = q.shape
    keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)
    p, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    qg = q.reshape(m, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, m * group, dim)
    scores = torch.bmm(qg, keys.permute(1, 2, 0)).float().view(kv_heads, m, group, p) * scale
    key_pos = torch.arange(p, device=q.device)
    hidden = (key_pos[None, :] > q_pos[:, None]) | (key_pos >= n)[None, :]
    probs = scores.masked_fill(hidden[None, :, None, :], float("-inf")).softmax(-1)
    if q_valid is None:
        return probs.mean((0, 1, 2))
    per_query = torch.where(q_valid[:, None], probs.mean((0, 2)), 0.0)  # (a padding query may be NaN)
    return per_query.sum(0) / q_valid.sum().clamp(min=1)
