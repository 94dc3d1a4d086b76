"""The fused prefill: one pass over the layers that reuses stored KV and recomputes a few tokens.

For every layer, stored segments' KV (K rotated from position-free storage to its real offset) is
written into the sequence's cache pages, then the *active* tokens are computed and their fresh KV
overwrites the stored one. Tokens without stored KV (the question, the chat template's tail) are
always active. In ``fuse`` mode all tokens are active until the first check layer, where the
stored tokens that deviate most from their stored KV are kept active and the rest drop out; later
check layers narrow the set (gradual filtering). Active tokens attend to the whole fused prompt
with an exact causal mask for their scattered positions.

Modes, comparable on the same input:
- ``full``: every token computed (stored KV ignored): the reference.
- ``prefix``: the first segment's stored KV reused (prefix caching), everything after computed.
- ``reuse``: all stored KV reused, re-positioned; only tokens without stored KV computed.
- ``fuse``: reuse plus selective recompute of high-deviation tokens.

Behind a registered system prompt (``SystemPart``, relay attention) the prompt's tokens sit at
positions ``s, s+1, ...`` after the system prompt's ``s`` tokens, which stay in the registry's
blocks: every active token attends to all of them (the system part, merged by log-sum-exp) and to
the fused prompt in its own pages (the context part). No stored segment is then an exact prefix:
the system prompt is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from ragfuse.kernels.paged_attention import sequence_slots

from ..attention import RelayMetadata, write_kv
from ..models import LlamaForCausalLM
from .prefetch import LayerPrefetcher
from .segments import Segment
from .selection import SelectionPolicy, choose, deviation, keep_count


class FusionMode(str, Enum):
    FULL = "full"
    PREFIX = "prefix"
    REUSE = "reuse"
    FUSE = "fuse"


@dataclass
class FusionStats:
    mode: str
    recompute_ratio: float
    prompt_tokens: int
    stored_tokens: int  # tokens whose KV came from storage (before any recompute), exact prefix included
    reused_tokens: int  # stored tokens whose stored KV stayed in use past the last check layer
    recomputed_tokens: int  # stored tokens recomputed past the last check layer
    computed_tokens: int  # tokens without stored KV, always computed
    load_s: float
    load_wait_s: float
    compute_s: float
    total_s: float
    tiers: list[str] = field(default_factory=list)
    active_per_layer: list[int] = field(default_factory=list)

    @property
    def load_hidden(self) -> float:
        """Share of the loading time that overlapped compute."""
        return 1.0 - self.load_wait_s / self.load_s if self.load_s > 0 else 1.0


@dataclass(frozen=True)
class SystemPart:
    """The registered system prompt a fused prompt follows: its length, and the relay metadata
    for ``n`` query tokens behind it."""

    num_tokens: int
    relay: Callable[[int], RelayMetadata]


def fuse_prefill(
    model: LlamaForCausalLM,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    block_table: list[int],
    segments: list[Segment],
    mode: FusionMode | str,
    policy: SelectionPolicy,
    system: SystemPart | None = None,
) -> tuple[torch.Tensor, FusionStats]:
    """Fill ``block_table``'s cache pages with the prompt's KV and return the last token's logits.
    With ``system`` the prompt continues that registered system prompt (relay attention)."""
    t_start = time.perf_counter()
    mode = FusionMode(mode)
    device = model.lm_head.weight.device
    cfg = model.config
    ids = [t for s in segments for t in s.token_ids]
    n = len(ids)
    used = _stored_segments(segments, mode)
    stored = torch.zeros(n, dtype=torch.bool, device=device)
    forced = torch.zeros(n, dtype=torch.bool, device=device)  # always recomputed among stored
    exact = torch.zeros(n, dtype=torch.bool, device=device)  # stored KV computed in this very context
    offset = 0
    for i, seg in enumerate(segments):
        if i in used:
            stored[offset : offset + len(seg.token_ids)] = True
            forced[offset : offset + min(policy.sink_tokens, len(seg.token_ids))] = mode is FusionMode.FUSE
            # KV stored from position 0 is exactly what full prefill computes for a prompt that starts
            # with it: a cached prefix, never a candidate for recompute
            exact[offset : offset + len(seg.token_ids)] = offset == 0 and system is None
        offset += len(seg.token_ids)
    stored[n - 1] = False  # the last token's hidden state gives the first answer token
    exact[n - 1] = False
    row_of = torch.full((n,), -1, dtype=torch.long, device=device)  # prompt index -> stored row
    row_of[stored] = torch.arange(int(stored.sum()), device=device)
    num_stored = int(stored.sum())
    num_fusable = int((stored & ~exact).sum())
    positions = torch.arange(n, device=device)  # in the sequence's own pages
    base = system.num_tokens if system is not None else 0  # page position p is model position base + p
    relay: RelayMetadata | None = None
    table = torch.tensor([block_table], dtype=torch.int32, device=device)
    slots = sequence_slots(table[0], n, kv_layers[0][0].shape[1])

    active = ~stored if mode in (FusionMode.REUSE, FusionMode.PREFIX) else ~exact
    checks = list(policy.check_layers) if mode is FusionMode.FUSE and num_fusable else []
    active_idx = active.nonzero().squeeze(1)
    block = model.model
    sources = [segments[i].kv for i in sorted(used)]
    hidden = block.embed_tokens(torch.tensor(ids, device=device))[active_idx]
    idle_rows, idle_pos = _idle_stored(stored, active_idx, row_of)
    shape_key: tuple[bool, int] = (False, -1)
    bounds = torch.empty(0)
    residual: torch.Tensor | None = None
    counts: list[int] = []
    with LayerPrefetcher(sources, cfg.num_layers, device) as loader, torch.inference_mode():
        for li, layer in enumerate(block.layers):
            kc, vc = kv_layers[li]
            k_st, v_st = loader.get(li) if sources else (None, None)
            if k_st is not None and idle_pos.numel():
                write_kv(block.rotary(k_st[idle_rows], idle_pos + base), v_st[idle_rows], kc, vc, slots[idle_pos])
            if residual is None:
                residual, h = hidden, layer.input_layernorm(hidden)
            else:
                h, residual = layer.input_layernorm(hidden, residual)
            q, k_raw, v = layer.self_attn.project(h)
            pos = positions[active_idx]
            write_kv(block.rotary(k_raw, pos + base), v, kc, vc, slots[pos])
            if checks and li == checks[0]:
                keep = _check(policy, len(policy.check_layers) - len(checks), k_raw, v, k_st, v_st,
                              active_idx, stored & ~exact, forced, row_of, num_fusable)
                checks.pop(0)
                q, residual = q[keep], residual[keep]
                active_idx = active_idx[keep]
                pos = positions[active_idx]
                idle_rows, idle_pos = _idle_stored(stored, active_idx, row_of)
            counts.append(int(active_idx.numel()))
            whole = int(active_idx.numel()) == n
            if shape_key != (whole, int(active_idx.numel())):  # the active set changed: new launch sizes
                shape_key = (whole, int(active_idx.numel()))
                bounds = torch.tensor([0, shape_key[1], n], dtype=torch.int32, device=device)
                relay = system.relay(shape_key[1]) if system is not None else None
            out, _ = layer.self_attn.attn.attend(
                block.rotary(q, pos + base), None if whole else pos, (kc, vc), table, n, slots, bounds, relay
            )
            h = layer.self_attn.o_proj(out.reshape(out.shape[0], -1))
            h, residual = layer.post_attention_layernorm(h, residual)
            hidden = layer.mlp(h)
        hidden, _ = block.norm(hidden, residual)
        logits = model.compute_logits(hidden[-1:])[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    total = time.perf_counter() - t_start
    final_active = torch.zeros(n, dtype=torch.bool, device=device)
    final_active[active_idx] = True
    recomputed = int((final_active & stored).sum())
    stats = FusionStats(
        mode=mode.value,
        recompute_ratio=recomputed / num_fusable if num_fusable else (1.0 if mode is FusionMode.FULL else 0.0),
        prompt_tokens=n,
        stored_tokens=num_stored,
        reused_tokens=num_stored - recomputed,
        recomputed_tokens=recomputed,
        computed_tokens=n - num_stored,
        load_s=loader.load_s,
        load_wait_s=loader.wait_s,
        compute_s=total - loader.wait_s,
        total_s=total,
        tiers=sorted({s.tier for s in sources}),
        active_per_layer=counts,
    )
    return logits, stats


def _idle_stored(
    stored: torch.Tensor, active_idx: torch.Tensor, row_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored tokens not being computed (their stored KV is used): rows in the stored KV and their
    prompt positions. Changes only at check layers, so it is worked out then, not per layer."""
    idle = stored.clone()
    idle[active_idx] = False
    pos = idle.nonzero().squeeze(1)
    return row_of[pos], pos


def _stored_segments(segments: list[Segment], mode: FusionMode) -> set[int]:
    """Indices of the segments whose stored KV this mode uses."""
    if mode is FusionMode.FULL:
        return set()
    if mode is FusionMode.PREFIX:
        return {0} if segments and segments[0].kv is not None else set()
    return {i for i, s in enumerate(segments) if s.kv is not None}


def _check(
    policy: SelectionPolicy,
    check_index: int,
    k_raw: torch.Tensor,
    v: torch.Tensor,
    k_st: torch.Tensor,
    v_st: torch.Tensor,
    active_idx: torch.Tensor,
    stored: torch.Tensor,
    forced: torch.Tensor,
    row_of: torch.Tensor,
    num_stored: int,
) -> torch.Tensor:
    """Bool mask over the active tokens: which stay active after this check layer."""
    is_stored = stored[active_idx]
    rows = row_of[active_idx[is_stored]]
    dev = deviation(policy.metric, k_raw[is_stored], v[is_stored], k_st[rows], v_st[rows])
    chosen = choose(dev, keep_count(policy.keep_share(check_index), num_stored), forced[active_idx[is_stored]])
    keep = ~is_stored  # tokens without stored KV always stay
    keep[is_stored.nonzero().squeeze(1)[chosen]] = True
    return keep
