"""RelayAttention's system part in plain torch (CPU path, and the reference for ``relay_triton``).

A registered system prompt's K/V sit once in the paged cache, in blocks its registry owns (no request's
block table holds them). Every query of every request behind that prompt sees all of its keys (the
prompt precedes the request), so system attention needs no mask: the queries of all requests sharing
the prompt, with the query heads of one KV head stacked as rows, form one matrix that meets the
system K/V in a single matrix-matrix product. That is what reads the system K/V once per batch
instead of once per request.

The request's own tokens (its context) are attended to separately over its own pages; the two
partials are merged exactly by their log-sum-exp, which is RelayAttention's relay fusion
o = a*o_sys + (1-a)*o_ctx with a = 1/(1 + exp(lse_ctx - lse_sys)): ``merge.merge_attention_ref``.
"""

from __future__ import annotations

import torch

from .paged_attention import _sdpa_lse, sequence_slots

TILE_ROWS = 64  # query rows (tokens x query heads of one KV head) per program of the Triton kernel


def tile_tokens_for(group: int, rows: int = TILE_ROWS) -> int:
    """Tokens per tile of the Triton system kernel for ``group`` query heads per KV head: the rows of
    a tile are its tokens times the group (padded to a power of two) and number ``rows``."""
    padded = 1 << max(0, (group - 1).bit_length())
    return max(1, rows // padded)


def system_tiles(token_system: list[int], tokens_per_tile: int, min_tiles: int = 0) -> tuple[list[int], list[int]]:
    """Cut a batch's tokens into tiles of one system prompt each: (tokens [n_tiles * tokens_per_tile],
    -1 padded; the system of each tile, -1 for tokens behind no system prompt).

    Every token lands in exactly one tile, so the kernel writes each token's system partial (lse =
    -inf where there is no system prompt). ``min_tiles`` pads with empty tiles (CUDA-graph buffers).
    """
    groups: dict[int, list[int]] = {}
    for t, s in enumerate(token_system):
        groups.setdefault(s, []).append(t)
    tokens: list[int] = []
    systems: list[int] = []
    for s, members in groups.items():
        for i in range(0, len(members), tokens_per_tile):
            part = members[i : i + tokens_per_tile]
            tokens += part + [-1] * (tokens_per_tile - len(part))
            systems.append(s)
    while len(systems) < min_tiles:
        tokens += [-1] * tokens_per_tile
        systems.append(-1)
    return tokens, systems


def max_system_tiles(num_tokens: int, tokens_per_tile: int, num_systems: int) -> int:
    """Most tiles ``system_tiles`` makes for ``num_tokens`` tokens behind ``num_systems`` distinct
    system prompts (counting "none" as one): each group wastes at most one partial tile."""
    return -(-num_tokens // tokens_per_tile) + num_systems - 1


def system_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sys_tables: torch.Tensor,
    sys_lens: torch.Tensor,
    token_system: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query token over its system prompt's keys, all of them visible.

    q [T, H, D]; caches [blocks, page, KVH, D]; system ``s`` holds ``sys_lens[s]`` tokens in blocks
    ``sys_tables[s]``; ``token_system[t]`` is token t's system (-1: none, giving out 0, lse -inf).
    Returns out [T, H, D], lse [T, H] float32.
    """
    total, heads, d = q.shape
    kvh = k_cache.shape[2]
    g = heads // kvh
    out = torch.zeros_like(q)
    lse = torch.full((total, heads), float("-inf"), dtype=torch.float32, device=q.device)
    kf = k_cache.view(-1, kvh, d)
    vf = v_cache.view(-1, kvh, d)
    lens = sys_lens.tolist()
    rows_of: dict[int, list[int]] = {}
    for t, s in enumerate(token_system):
        if s >= 0 and lens[s] > 0:
            rows_of.setdefault(s, []).append(t)
    for s, rows in rows_of.items():
        idx = sequence_slots(sys_tables[s], lens[s], k_cache.shape[1])
        k, v = kf[idx].transpose(0, 1), vf[idx].transpose(0, 1)  # [KVH, S, D]
        sel = torch.tensor(rows, device=q.device)
        # the group's query heads of every token stacked as the rows of one matrix per KV head
        qs = q.index_select(0, sel).view(len(rows), kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, len(rows) * g, d)
        o, ls = _sdpa_lse(qs, k, v, scale, None, False)
        out[sel] = o.view(kvh, len(rows), g, d).permute(1, 0, 2, 3).reshape(len(rows), heads, d)
        lse[sel] = ls.view(kvh, len(rows), g).permute(1, 0, 2).reshape(len(rows), heads)
    return out, lse
