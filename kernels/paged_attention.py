"""Attention over a paged KV cache, in plain torch (CPU path and the reference for Triton kernels).

Cache layout, shared with vLLM's paged attention: one tensor per layer for K and for V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's token ``t`` lives in block
``block_tables[s, t // block_size]`` at offset ``t % block_size``.

Every function returns the output and the natural-log log-sum-exp of the scores per (token, head),
so partial attentions over disjoint key sets can be merged exactly (see ``merge.py``).
"""

from __future__ import annotations

import torch

from .merge import merge_attention_ref


def sequence_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of a sequence's first ``seq_len`` tokens, in position order."""
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    offsets = torch.arange(block_size, device=block_table.device)
    return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:seq_len]


def consecutive_slots(blocks: list[int], seq_len: int, block_size: int) -> slice | None:
    """The slots of a sequence's first ``seq_len`` tokens as one ``slice`` when its blocks (``blocks``,
    its block table's first entries, host ints) are consecutive, the usual case as blocks are handed
    out in order: the torch path then reads its K/V as a view instead of gathering a copy. None
    otherwise (use ``sequence_slots``)."""
    n_blocks = -(-seq_len // block_size)
    table = blocks[:n_blocks]
    if not table or table != list(range(table[0], table[0] + n_blocks)):
        return None
    start = table[0] * block_size
    return slice(start, start + seq_len)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_start: int,
    sliding_window: int | None = None,
    q_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention for one sequence, query token ``i`` at absolute position ``q_start + i``
    or, when given, at ``q_positions[i]`` (scattered positions, as selective recompute needs: each
    query sees exactly the keys at or before its own position).

    q [Lq, H, D]; k, v [Lk, KVH, D] hold positions 0..Lk-1. Returns out [Lq, H, D], lse [Lq, H].
    """
    lq = q.shape[0]
    lk = k.shape[0]
    window_cuts = sliding_window is not None and lk > sliding_window
    if q_positions is None and lq == 1 and not window_cuts:
        return _folded(q, k, v, scale)  # decode: every cached key is visible
    if q_positions is None and q_start > 0 and q_start + lq == lk and not window_cuts and q.device.type == "cpu":
        # New tokens after a cached prefix: the prefix is fully visible (no mask) and the new block
        # is plain causal, so two fast unmasked partials merged by log-sum-exp replace one explicitly
        # masked pass, which CPU flash attention runs far slower.
        out_p, lse_p = _folded(q, k[:q_start], v[:q_start], scale)
        out_n, lse_n = _grouped(q, k[q_start:], v[q_start:], scale, None, True)
        return merge_attention_ref(out_p, lse_p, out_n, lse_n)
    if q_positions is None and q_start == 0 and lq == lk and not window_cuts:
        return _grouped(q, k, v, scale, None, True)
    if q_positions is not None and not window_cuts and q.device.type == "cpu":
        return _scattered_cpu(q, k, v, scale, q_positions)
    qpos = q_positions if q_positions is not None else torch.arange(q_start, q_start + lq, device=q.device)
    kpos = torch.arange(lk, device=q.device)
    visible = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        visible &= (qpos[:, None] - kpos[None, :]) < sliding_window
    return _grouped(q, k, v, scale, visible, False)


# queries per block of ``_scattered_cpu``: its masked part spans about this many / density keys. On the
# 2-core CI box, fusion's 416-1184 of 3104 positions (SmolLM2's 9 heads of 64) ran 10-15% faster in
# blocks of 64 than of 32 (16: slower still; 128: masks too wide)
_SCATTER_BLOCK = 64


def _scattered_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scattered ascending query positions on CPU, exact, without one dense [Lq, Lk] mask.

    CPU flash attention is several times slower with an explicit mask than without, and with one
    mask over every key it also computes the half of the scores that the mask throws away. Here
    each block of consecutive queries (positions lo..hi) sees keys before lo unmasked, and only the
    keys lo..hi (a few hundred at cache fusion's densities) through a small mask; the two parts are
    merged by log-sum-exp. Every query sees at least key lo, so no row of the masked part is empty.
    The query heads of a KV group are folded into the query length, so K/V are never copied.
    Positions that form one run (fusion's first layer: every token after the exact prefix) take
    the contiguous path instead: two large unmasked calls, ~25% faster than blocks there.
    """
    lq = q.shape[0]
    pos = q_positions.tolist()  # host ints: on CPU this costs no device sync
    if pos and pos[-1] - pos[0] + 1 == lq:
        end = pos[-1] + 1
        return attention_with_lse(q, k[:end], v[:end], scale, pos[0])
    outs, lses = [], []
    for a in range(0, lq, _SCATTER_BLOCK):
        b = min(a + _SCATTER_BLOCK, lq)
        lo, hi = pos[a], pos[b - 1]
        visible = torch.arange(lo, hi + 1)[None, :] <= q_positions[a:b, None]
        out, lse = _folded(q[a:b], k[lo : hi + 1], v[lo : hi + 1], scale, visible)
        if lo > 0:
            out, lse = merge_attention_ref(*_folded(q[a:b], k[:lo], v[:lo], scale), out, lse)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _folded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Lq, H, D] over k, v [Lk, KVH, D], every key visible to every query unless ``visible`` [Lq, Lk]
    says otherwise: the query heads of a KV group are folded into the query length, so K/V are read
    as views once per KV head, never repeated for the group (``_grouped`` copies them, which a causal
    mask needs). On CPU a prefix of 3K tokens cost ~1 ms a layer to repeat for SmolLM2's groups of 3."""
    lq, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    mask = None if visible is None else visible.repeat(g, 1)
    if lq == 1:  # decode: the fold is a view (no permutes: a CPU decode step runs this once a layer)
        out, lse = _sdpa_lse(q.view(kvh, g, d), k.transpose(0, 1), v.transpose(0, 1), scale, mask, False)
        return out.reshape(1, h, d), lse.reshape(1, h)
    qf = q.view(lq, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * lq, d)
    out, lse = _sdpa_lse(qf, k.transpose(0, 1), v.transpose(0, 1), scale, mask, False)
    out = out.view(kvh, g, lq, d).permute(2, 0, 1, 3).reshape(lq, h, d)
    return out, lse.view(kvh, g, lq).permute(2, 0, 1).reshape(lq, h)


def _grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Lq, H, D] over k, v [Lk, KVH, D] with KV heads repeated for their query groups."""
    g = q.shape[1] // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(g, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(g, dim=0)
    out, lse = _sdpa_lse(q.transpose(0, 1), kh, vh, scale, visible, causal)
    return out.transpose(0, 1), lse.transpose(0, 1)


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, Lq, D], k/v [H, Lk, D] -> (out [H, Lq, D], lse [H, Lq] float32).

    On CPU this is torch's flash-attention op, which returns the log-sum-exp; elsewhere it is the
    explicit formula (the Triton kernels replace it on CUDA).
    """
    if q.device.type == "cpu":
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))[None, None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, attn_mask=mask, scale=scale
        )[:2]
        return out[0], lse[0].float()
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    if causal:
        visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype), lse


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    slots: list[torch.Tensor | slice] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length causal prefill over the paged cache.

    q [total_q, H, D] packs each sequence's new tokens; sequence ``s`` has ``seq_lens[s]`` tokens in
    the cache (its new ones already written, at the end), so its queries start at position
    ``seq_lens[s] - query_len[s]``: a prefix already in the cache is attended to. ``slots`` may
    carry each sequence's precomputed cache slots (the engine computes them once for all layers).
    """
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    block_size = k_cache.shape[1]
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        idx = slots[s] if slots is not None else sequence_slots(block_tables[s], seq_len, block_size)
        out[a:b], lse[a:b] = attention_with_lse(
            q[a:b], kf[idx], vf[idx], scale, seq_len - (b - a), sliding_window
        )
    return out, lse


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    slots: list[torch.Tensor | slice] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence: q [num_seqs, H, D] attends to all ``seq_lens[s]`` cached tokens."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, cu, scale, sliding_window, slots
    )


def paged_attention_at_positions_ref(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    slots: torch.Tensor | slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's queries at arbitrary absolute positions ``q_positions`` [Lq] over its first
    ``seq_len`` cached tokens, each query seeing the keys at or before its own position; None
    means the last ``len(q)`` positions.

    A bottom-right causal mask would be wrong here: the queries are scattered through the prompt.
    """
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    idx = slots if slots is not None else sequence_slots(block_table, seq_len, k_cache.shape[1])
    q_start = seq_len - q.shape[0] if q_positions is None else 0
    return attention_with_lse(q, kf[idx], vf[idx], scale, q_start, sliding_window, q_positions)
