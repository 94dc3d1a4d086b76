"""Which way a passage's K shift moves the question's attention to it (torch reference).

Cache fusion's stale shift adds one vector ``delta`` to all of a passage's K before RoPE. For a
question query ``q`` (rotated) that moves the log of its attention mass on the passage,
``log sum_t exp(scale * q . R(p_t) k_t)``, by ``scale * u . delta`` to first order, where
``u = sum_t w_t R(p_t)^T q`` and ``w`` is the query's softmax over the passage's tokens alone. Since
``R(p)^T`` is a rotation by ``-p`` per frequency, ``u`` needs only the ``w``-weighted sums of the
tokens' cos and sin: ``u = (q1 C + q2 S, q2 C - q1 S)`` with ``C = sum_t w_t cos(p_t)`` and
``S = sum_t w_t sin(p_t)`` (``q1``, ``q2`` the halves of ``q``). The stale shift's mass cap
(``engine/fusion/stale_shift.py``) reads the mean of ``u`` over the question's tokens and each KV
head's query heads, and caps each segment's move there (``cap_k_shift_ref``).
``mass_direction_triton`` computes both without a score tensor in memory.
"""

from __future__ import annotations

import torch


def mass_direction_ref(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bounds: torch.Tensor, scale: float, walk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean ``u`` [segments, KVH, D] float32 per stored segment and KV head.

    ``q`` [W, H, D]: the question's queries, rotated; ``ok`` [W] bool: which of them count (the rest
    are padding); ``k`` [T, KVH, D]: the stored K before RoPE, at model positions ``at`` [T];
    ``bounds`` [segments + 1]: segment ``s`` is the rows ``bounds[s]:bounds[s + 1]`` (the fused pass
    knows them on the host: they are made once a pass, not found again in every layer).
    The mean is over the real queries and the KV head's query heads; a segment without rows gets
    zeros. Float32 throughout.

    Each segment's softmax and its cos/sin sums are two products over that segment's rows alone, so
    no pass touches a score tensor of the whole prompt (the CPU runs this in every shifted layer of a
    fused pass: the default model's pass at 6 x 512 stored tokens takes ~1.6 ms a layer longer with the
    cap than without, where one score tensor with scattered per-segment max and sum took ~6.3 longer;
    results/fusion-cpu/2026-11-30-cap-ref). The bounds are read on the host: the Triton backend,
    whose CUDA graphs cannot sync, runs ``mass_direction_triton`` instead. ``walk`` [segments] bool:
    only those are walked (the others get zeros, as the cap's ``may_bind`` allows); None: all."""
    w_rows, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    group = heads // kv_heads
    qs = (q.float() * ok[:, None, None]).view(w_rows, kv_heads, group, dim).transpose(0, 1)
    qs = qs.reshape(kv_heads, w_rows * group, dim)
    c, s = cos[at].float(), sin[at].float()  # [T, half]
    kt = k.float().transpose(0, 1).contiguous()  # [KVH, T, D]
    # rotated to its positions, as the cache holds it, straight into the [KVH, T, D] layout the per-segment
    # products slice (apply_rope_ref then a transposed copy: the cap cost a CPU pass 126 ms, not 47)
    k_rot = torch.empty_like(kt)
    torch.mul(kt[..., :half], c, out=k_rot[..., :half]).addcmul_(kt[..., half:], s, value=-1)
    torch.mul(kt[..., half:], c, out=k_rot[..., half:]).addcmul_(kt[..., :half], s)
    cs = torch.cat((c, s), dim=-1)
    qk = qs * scale
    ends = bounds.tolist()
    walked = [True] * (len(ends) - 1) if walk is None else walk.tolist()
    cw = torch.zeros(len(ends) - 1, kv_heads, w_rows * group, dim, device=q.device)  # per row: (C, S)
    for i, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        if b > a and walked[i]:
            w = torch.softmax(torch.bmm(qk, k_rot[:, a:b].transpose(1, 2)), dim=-1)
            torch.matmul(w, cs[a:b], out=cw[i])
    # u = (q1 C + q2 S, q2 C - q1 S) summed over rows: products with q and with (q2, -q1), halves folded
    x = (cw * qs).sum(2)
    y = (cw * torch.cat((qs[..., half:], -qs[..., :half]), dim=-1)).sum(2)
    u = torch.cat((x[..., :half] + x[..., half:], y[..., :half] + y[..., half:]), dim=-1)
    return u / (ok.sum() * group).clamp(min=1)


def may_bind(mk: torch.Tensor, q: torch.Tensor, ok: torch.Tensor, limit: torch.Tensor, scale: float) -> torch.Tensor:
    """[segments] bool: the segments whose K shift ``mk`` [segments, KVH, D] might move the question's
    attention mass past ``limit``, for some KV head. ``u`` is a softmax-weighted mean of rotations of a
    query, so ``|ub|`` is at most the mean norm of the real queries of the KV head's group, and
    ``|m| <= scale * that * |delta|``; where this bound stays under the limit (with 0.1% to spare for
    float32 rounding) the cap cuts nothing, so the segment's softmax need not be computed."""
    w_rows, heads, _ = q.shape
    kv_heads = mk.shape[1]
    group = heads // kv_heads
    norms = (q.float().norm(dim=-1) * ok[:, None]).view(w_rows, kv_heads, group).sum((0, 2))
    mean_norm = norms / (ok.sum() * group).clamp(min=1)  # [KVH]
    reach = scale * mean_norm * mk.norm(dim=-1)  # [segments, KVH]: the largest move the shift could make
    return (reach >= 0.999 * limit).any(dim=1)


def cap_k_shift_ref(
    mk: torch.Tensor, q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, bounds: torch.Tensor, limit: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The K shift ``mk`` [segments, KVH, D] float32 with each segment's move ``m = scale * ub . delta``
    of the question's log attention mass (``ub`` from ``mass_direction_ref``) capped at ``limit`` [1]
    nats: where ``|m| > limit``, ``(|m| - limit) * sign(m) / (scale * |ub|^2) * ub`` comes off delta,
    the rest of it stays. Only the segments that ``may_bind`` are walked; the rest keep delta, as the
    cap would leave it, so the result is the same, bit for bit, as walking them all. On the default
    model the bound cleared 28% of the segments and 13% of the layers whole over four MuSiQue cases
    (10 passages, ~6K tokens), and 16% and 2 of 29 layers on `bench fusion`'s random tokens
    (results/fusion-cpu/2026-11-30-cap-skip)."""
    walk = may_bind(mk, q, ok, limit, scale)
    if not bool(walk.any()):
        return mk
    ub = mass_direction_ref(q, ok, k, at, cos, sin, bounds, scale, walk)
    move = scale * (ub * mk).sum(-1)
    over = move.abs() - limit
    cut = torch.where(over > 0, over * move.sign() / (scale * (ub * ub).sum(-1)).clamp(min=1e-30), 0.0)
    return mk - cut[..., None] * ub
