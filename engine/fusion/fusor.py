"""The fused prefill: one pass over the layers that reuses stored KV and recomputes a few tokens.

For every layer, stored segments' KV (K rotated from position-free storage to its real offset) is
written into the sequence's cache pages, then the *active* tokens are computed and their fresh KV
overwrites the stored one. Tokens without stored KV (the question, the chat template's tail) are
always active. In ``fuse`` mode all tokens are active until the first check layer, where the
stored tokens that deviate most from their stored KV are kept active and the rest drop out; later
check layers narrow the set (gradual filtering; with ``revert_dropped`` the tokens a check drops get
their stored KV back at that layer, so ratio 0 is exactly reuse). With ``stale_shift`` the stored KV
of every layer first moves by its segment's mean deviation on the tokens computed there
(``stale_shift.py``). Active tokens attend to the whole fused prompt with an exact causal mask for
their scattered positions. Where stored KV comes from a blocking tier (disk, Redis), layer 0's is
computed from the tokens instead of read (``layer_step.first_layer_kv``): the layer depends on
nothing else, and its read is the one no compute can hide.

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

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
import torch

from ragfuse.kernels.paged_attention import consecutive_slots

from .. import ops
from ..attention import RelayMetadata
from ..errors import RequestError
from ..models import LlamaForCausalLM
from . import layer_step
from .graphs import CheckShape, FirstInputs, FirstShape, FusionGraphs, PassInputs
from .prefetch import LayerPrefetcher, drain, start_reads
from .segments import Segment
from .selection import SelectionPolicy, check_keep, keep_count, true_indices
from .stale_shift import QUESTION_WINDOW, MassCap, ShiftIndex, segment_bounds


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
    # prompt positions of the stored tokens recomputed past the last check layer, on the device
    # (read only by whoever compares selections: the pass itself never waits for it)
    recomputed_positions: torch.Tensor | None = None

    @property
    def load_hidden(self) -> float:
        """Share of the loading time that overlapped compute (0 where the compute waited as long as the
        load took, as a disk-bound pass's may, by a few thread wake-ups more)."""
        return max(0.0, 1.0 - self.load_wait_s / self.load_s) if self.load_s > 0 else 1.0


@dataclass
class _Layout:
    """Where the prompt's stored KV sits and how many tokens each check layer keeps, worked out on
    the host before the first layer: every launch size of the pass is known up front, so the layer
    loop never reads a count back from the device (each read-back would drain the GPU queue).
    Arrays, not lists: a 3K-token prompt's per-position lists took ~1.5 ms of Python to build and
    to turn into a tensor, time the GPU sat idle before its first layer."""

    stored: np.ndarray  # prompt positions with stored KV, in order: row i of the loaded KV is stored[i]
    fusable: np.ndarray  # bool per position: stored KV computed elsewhere, a recompute candidate
    forced: np.ndarray  # bool per position: a fusable token always recomputed (sink tokens)
    active: np.ndarray  # positions computed at layer 0
    num_fusable: int
    candidates: int  # fusable tokens among them
    tail: int  # positions after the last recompute candidate (the question): they rank candidates by attention
    check_sizes: list[tuple[int, int]]  # per check layer: (candidates before it, candidates it keeps)
    segment: np.ndarray  # stored segment (0, 1, ... in prompt order) per position; num_segments - 1 if none
    num_segments: int  # stored segments + 1 spare for positions without stored KV

    @classmethod
    def build(
        cls, segments: list[Segment], used: set[int], mode: FusionMode, policy: SelectionPolicy, behind_system: bool
    ) -> _Layout:
        n = sum(len(s.token_ids) for s in segments)
        stored, exact, forced = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        segment = np.full(n, len(used), dtype=np.int64)
        nearest = max(used, default=-1)  # the stored segment nearest the question
        fuse = mode is FusionMode.FUSE
        offset = 0
        for i, seg in enumerate(segments):
            end = offset + len(seg.token_ids)
            if i in used:
                stored[offset:end] = True
                segment[offset:end] = sum(j < i for j in used)
                sinks = min(policy.sink_tokens, len(seg.token_ids)) if fuse else 0
                forced[offset : offset + sinks] = True
                if fuse and i == nearest and policy.tail_tokens:
                    forced[max(offset, end - policy.tail_tokens) : end] = True
                # KV stored from position 0 is exactly what full prefill computes for a prompt that
                # starts with it: a cached prefix, never a candidate for recompute (unless the prompt
                # follows a system prompt, which the stored KV never saw)
                exact[offset:end] = offset == 0 and not behind_system
            offset = end
        stored[n - 1] = exact[n - 1] = False  # the last token's hidden state gives the first answer token
        segment[n - 1] = len(used)
        fusable = stored & ~exact
        forced &= fusable
        recompute = mode is FusionMode.FUSE or mode is FusionMode.FULL
        active = np.flatnonzero(~stored | fusable) if recompute else np.flatnonzero(~stored)
        num_fusable, num_forced = int(fusable.sum()), int(forced.sum())
        sizes: list[tuple[int, int]] = []
        if mode is FusionMode.FUSE and num_fusable:
            cand = num_fusable
            for c in range(len(policy.check_layers)):
                if cand == 0:  # nothing left to narrow: later checks have no work
                    break
                keep = keep_count(policy.keep_share(c), num_fusable)
                kept = num_forced + max(0, min(keep - num_forced, cand - num_forced))
                sizes.append((cand, kept))
                cand = kept
        tail = n - 1 - int(np.flatnonzero(fusable)[-1]) if num_fusable else 0
        return cls(
            stored=np.flatnonzero(stored), fusable=fusable, forced=forced, active=active, num_fusable=num_fusable,
            candidates=num_fusable if mode is FusionMode.FUSE else 0, tail=tail,
            check_sizes=sizes, segment=segment, num_segments=len(used) + 1,
        )


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
    graphs: FusionGraphs | None = None,
) -> tuple[torch.Tensor, FusionStats]:
    """Fill ``block_table``'s cache pages with the prompt's KV and return the last token's logits.
    With ``system`` the prompt continues that registered system prompt (relay attention). With
    ``graphs`` the layers past the last check layer replay CUDA graphs where the sizes fit, and so do
    the check layers when they follow one another (gradual filtering's 1-5) and all fit."""
    t_start = time.perf_counter()
    mode = FusionMode(mode)
    policy = _within_depth(policy, model.config.num_layers, mode)
    # at ratio 0 with no token forced in, fusion recomputes no stored token: that is full reuse, run
    # as such (no check layer computing every token only to select none of them)
    run = FusionMode.REUSE if mode is FusionMode.FUSE and policy.ratio == 0 and not policy.forces_tokens() else mode
    device = model.lm_head.weight.device
    # one pass over the token lists (per-segment arrays joined took ~2x as long, before layer 0)
    n = sum(len(s.token_ids) for s in segments)
    ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in segments), dtype=np.int64, count=n)
    # the rotary tables end at the model's context: past it, RoPE indexing failed (CPU) or read past
    # the table (a GPU kernel) instead of refusing the prompt; callers that borrow pages (the gate's
    # calibration, evals) skip the engine's own length check
    limit = model.model.rotary.max_positions
    if n == 0:
        raise RequestError("fused prompt is empty: no segment has a token")
    if n + (system.num_tokens if system is not None else 0) > limit:
        raise RequestError(f"fused prompt of {n} tokens (after a system prompt of "
                           f"{system.num_tokens if system is not None else 0}) exceeds the context of {limit}")
    used = _stored_segments(segments, run, policy, system is not None)
    sources = [segments[i].kv for i in sorted(used)]
    num_layers = model.config.num_layers
    # where a source blocks (disk, Redis), layer 0's stored KV is computed from the tokens, not read: the
    # first read is the one no compute precedes (a disk's took 3-5 ms with the page cache dropped), and a
    # token's layer-0 KV is its embedding's projection whatever surrounds it (``layer_step.first_layer_kv``)
    computes_first = any(s.blocking for s in sources)
    # a disk or Redis tier's first reads start now, not once the host has set the pass up
    reads = start_reads(sources, num_layers, first=int(computes_first))
    try:
        lay = _Layout.build(segments, used, run, policy, system is not None)
        num_stored, num_fusable, num_active = len(lay.stored), lay.num_fusable, len(lay.active)
        # the attention kernel's [0, queries, keys] for each active-set size of the pass, made at once
        # checks narrow only the candidates: after one, the active set is the non-candidates plus what it kept
        sizes = [num_active, *(num_active - lay.candidates + k for _, k in lay.check_sizes)]
        bounds = np.array([[0, a, n] for a in sizes], dtype=np.int32)
        checks = list(zip(policy.check_layers, lay.check_sizes, strict=False))
        block = model.model
        rotary = block.rotary
        # past the last check layer every layer runs the same active set: replayed from CUDA graphs, as are
        # the check layers (check c narrows sizes[c] to sizes[c + 1]) when they run back to back and all fit
        steady = policy.check_layers[len(checks) - 1] + 1 if checks else 0
        use_graphs = (graphs is not None and system is None and bool(sources) and steady < num_layers
                      and graphs.accepts(sizes[-1], num_stored, len(block_table), len(used)))
        shifting = run is FusionMode.FUSE and max(policy.shift_shares()) > 0 and bool(sources)
        capped = shifting and policy.caps_k_mass() and lay.tail > 0
        check_shapes: list[CheckShape] = []
        first_shapes: list[FirstShape] = []  # the layers before the first check, when every later one replays
        if use_graphs and checks and [li for li, _ in checks] == list(range(checks[0][0], steady)):
            shapes = [CheckShape.of(li, sizes[c], sizes[c + 1], n, lay.tail, policy, capped)
                      for c, (li, _) in enumerate(checks)]
            check_shapes = [s for s in shapes if s is not None] if None not in shapes else []
            firsts = [FirstShape.of(li, sizes[0]) for li in range(checks[0][0])]
            first_shapes = [s for s in firsts if s is not None] if check_shapes and None not in firsts else []
        cap = (graphs.prepare(sizes[-1], num_stored, range(steady, num_layers), [*first_shapes, *check_shapes], capped)
               if use_graphs else None)
        # layer 0's stored KV is on its way while the host sets the pass up; later layers' loads are
        # issued once each layer's work is launched (``ahead``). Before the first check every fusable
        # token is active: its stored KV is overwritten unread there, so it is not copied
        first_read = checks[0][0] if run is FusionMode.FUSE and checks else 0
        skip = [first_read if start < n and lay.fusable[start] else 0 for start in _starts(segments, used)]
        first_rows = _first_layer_rows(segments, used, skip, num_stored) if computes_first else 0

        def first_layer(out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
            """Layer 0's stored KV where the loader does not read it: its first ``first_rows`` rows (those
            read there: the exact prefix, or all) computed into ``out`` (a ring slot), or into new tensors
            of every stored row (the others are overwritten unread). ``dev`` is set before layer 0."""
            computed = layer_step.first_layer_kv(block, dev["first_ids"]) if first_rows else None
            if out is None:
                if computed is not None and first_rows == num_stored:
                    return computed
                shape = (num_stored, model.config.num_kv_heads, model.config.head_dim)
                out = (torch.zeros(shape, dtype=kv_layers[0][0].dtype, device=device),
                       torch.zeros(shape, dtype=kv_layers[0][1].dtype, device=device))
            if computed is not None:
                out[0][:first_rows].copy_(computed[0])
                out[1][:first_rows].copy_(computed[1])
            return out

        loader = LayerPrefetcher(sources, num_layers, device, ring=cap.ring if cap is not None else None, lazy=True,
                                 skip=skip, reads=reads, first_layer=first_layer if computes_first else None)
    except BaseException:
        drain(reads)  # their sources are closed by the caller next
        raise
    # the first layer replayed from a graph: every later one is too (the rest run eagerly)
    graph_from = num_layers if cap is None else 0 if first_shapes else checks[0][0] if check_shapes else steady
    with loader, torch.inference_mode():
        # everything the pass indexes with, worked out in numpy and sent in one host-to-device
        # transfer: each torch op here would be a launch (~20 us of host time) before layer 0, while
        # the GPU has nothing to do yet; the graphs' inputs go straight into theirs, and so does all
        # a pass replaying from layer 0 reads
        block_size = kv_layers[0][0].shape[1]
        table_h = np.asarray(block_table, dtype=np.int64)
        at = np.arange(n)
        slots_h = table_h[at // block_size] * block_size + at % block_size
        row_of = np.full(n, -1, dtype=np.int64)  # prompt position -> row of the loaded KV
        row_of[lay.stored] = np.arange(num_stored)
        rows_h = np.maximum(row_of[lay.active], 0)  # each active token's row of the loaded KV (any if none)
        base = system.num_tokens if system is not None else 0  # page position p is model position base + p
        must_keep_h = ~lay.fusable | lay.forced  # positions every check keeps: no stored KV, or forced in
        share_h = np.array(policy.shift_shares(), dtype=np.float32)
        host: dict[str, np.ndarray] = {}
        if graph_from > 0:  # what the eager layers index with (a pass replaying from layer 0 sends none)
            host = {
                "ids": ids[lay.active], "bounds": bounds, "fusable": lay.fusable,
                "stored_at": lay.stored + base, "active": lay.active, "active_at": lay.active + base,
                "slots": slots_h, "stored_slots": slots_h[lay.stored], "active_slots": slots_h[lay.active],
                "rows": rows_h, "active_segment": lay.segment[lay.active],
                "stored_segment": lay.segment[lay.stored], "table": table_h.astype(np.int32)[None],
                "must_keep": must_keep_h, "share": share_h, "mass_cap": np.array([policy.k_mass_cap], np.float32),
                "stored_bounds": segment_bounds(lay.segment[lay.stored], lay.num_segments),
                "tail_pos": np.arange(n - lay.tail, n),  # the question's positions (it ranks by its attention)
            }
        if first_rows:  # the tokens whose layer-0 KV ``first_layer`` computes
            host["first_ids"] = ids[lay.stored[:first_rows]]
        dev = _to_device(device, host) if host else {}
        if cap is not None:
            assert graphs is not None
            # when layer 0 replays, the active tokens' state goes with these, and what the pass reads
            # itself (no system prompt behind a graphed pass: prompt positions are model positions)
            first = (FirstInputs(lay.active, slots_h[lay.active], rows_h, lay.segment[lay.active], ids[lay.active],
                                 bounds, lay.fusable) if graph_from == 0 else None)
            # each layer's active rows coming in: the sizes before the first check, then after each check
            check_at = np.array([li for li, _ in checks], dtype=np.int64)
            active_in = np.array(sizes)[np.searchsorted(check_at, np.arange(num_layers))]
            graphs.send(cap, PassInputs(
                table=table_h, stored_at=lay.stored, stored_slots=slots_h[lay.stored],
                stored_segment=lay.segment[lay.stored] if shifting else None, prompt_slots=slots_h,
                must_keep=must_keep_h, share=share_h if shifting else None, mass_cap=policy.k_mass_cap, tail=lay.tail,
                active_in=active_in, num_segments=lay.num_segments, first=first))
            if first is not None:
                dev["bounds"], dev["fusable"] = graphs.first_inputs(first)
        bounds_all, fusable = dev["bounds"], dev["fusable"]
        # a pass replaying from layer 0 embeds its tokens in that layer's graph
        hidden = block.embed_tokens(dev["ids"]) if graph_from > 0 else None
        residual: torch.Tensor | None = None
        size_i, candidates = 0, lay.candidates
        counts: list[int] = []
        if graph_from > 0:
            must_keep, slots = dev["must_keep"], dev["slots"]
            # the torch attention (CPU) reads consecutive blocks' K/V as a view (0.4 ms of gathers a layer
            # for a 3K-token prompt on the default model otherwise)
            run = consecutive_slots(block_table, n, block_size) if device.type != "cuda" else None
            seq_slots: torch.Tensor | slice = run if run is not None else slots
            table, stored_at, stored_slots = dev["table"], dev["stored_at"], dev["stored_slots"]
            relays = [system.relay(a) for a in sizes] if system is not None else None
            pos, pos_at, act_slots, rows = dev["active"], dev["active_at"], dev["active_slots"], dev["rows"]
            share = dev["share"] if shifting else None
            stored_segment = dev["stored_segment"] if shifting else None
            active_segment = dev["active_segment"]

            def shift_index() -> ShiftIndex | None:
                """The stale shift's indices for the current active set (made again when a check narrows it):
                the question is its last rows, of which the mass cap reads the last ``QUESTION_WINDOW``."""
                if share is None or stored_segment is None:
                    return None
                mass_cap = None
                if capped:
                    width, a = min(lay.tail, QUESTION_WINDOW), pos.shape[0]
                    mass_cap = MassCap(dev["mass_cap"], torch.arange(a - width, a, device=device),
                                       torch.ones(width, dtype=torch.bool, device=device), dev["stored_bounds"])
                return ShiftIndex(share, rows, active_segment, stored_segment, lay.num_segments, mass_cap)

            shift = shift_index()
            shift_from = checks[0][0] if checks else num_layers
        for li in range(graph_from):
            layer, kv = block.layers[li], kv_layers[li]
            k_st = v_st = None
            if sources:
                k_st, v_st = (t[:num_stored] for t in loader.get(li, ahead=False))
            check = bool(checks) and li == checks[0][0]
            stored = (k_st, v_st, stored_at, stored_slots) if k_st is not None and v_st is not None else None
            # before the first check every fusable token is active and overwrites its stored KV: a shift
            # there would move only KV that is never read (the exact prefix's segment has no active rows)
            q, k_raw, v, residual, written = layer_step.front(layer, kv, rotary, stored, hidden, residual, pos_at,
                                                              act_slots, shift if li >= shift_from else None, check)
            kept = None
            if check:
                _, (cand, kept_n) = checks.pop(0)
                assert written is not None
                attn = layer.self_attn.attn
                weight = None
                if policy.attention_weight:
                    weight = ops.question_attention(q[-lay.tail :], kv[0], slots, dev["tail_pos"], bounds_all[0, 2],
                                                    attn.scale)
                keep = pos.shape[0] - cand + kept_n
                kept = check_keep(policy.metric, policy.attention_weight, (k_raw, v), written, rows, pos, must_keep,
                                  weight, keep, keep)
                pos = pos.index_select(0, kept)
                rows = rows.index_select(0, kept)
                active_segment = active_segment.index_select(0, kept)
                act_slots = slots.index_select(0, pos)
                pos_at = pos + base if base else pos
                if policy.revert_dropped:
                    layer_step.revert(kv, rotary, written, (stored_at, stored_slots),
                                      (k_raw.index_select(0, kept), v.index_select(0, kept), pos_at, act_slots))
                shift = shift_index()
                size_i, candidates = size_i + 1, kept_n
            a = pos.shape[0]
            assert a == sizes[size_i], "active-set size differs from the planned launch size"  # host ints: no sync
            counts.append(a)
            if kept is not None:
                q, residual = q.index_select(0, kept), residual.index_select(0, kept)
            hidden, residual = layer_step.back(layer, kv, q, residual, None if a == n else pos, table, n, seq_slots,
                                               bounds_all[size_i], None if relays is None else relays[size_i])
            # the next layers' loads only now: issuing them (~0.2 ms of host time a layer) between the
            # halves left the GPU idle in layer 0, whose host work the GPU is not yet behind
            loader.ahead(li)
        if cap is not None:  # the rest from graphs: the checks (and the layers before them), then the steady layers
            assert graphs is not None
            if graph_from > 0:  # the active tokens' state from the last eager layer (else sent with the inputs)
                assert hidden is not None and residual is not None  # every eager layer leaves them
                graphs.stage(cap, hidden, residual, pos_at, act_slots, rows, active_segment, bounds_all[size_i],
                             lay.num_segments)
            early = [*first_shapes, *check_shapes]  # one per layer from graph_from up to the steady ones
            for li in range(graph_from, num_layers):
                loader.get(li, ahead=False)  # the compute stream waits for the layer's stored KV
                if li < steady:
                    shape = early[li - graph_from]
                    if isinstance(shape, CheckShape):  # its bounds are those of the rows it keeps
                        _, (_, candidates) = checks.pop(0)
                        size_i += 1
                    graphs.check(cap, shape, bounds_all[size_i])
                else:
                    graphs.replay(cap, li, capped)
                loader.ahead(li)
                counts.append(sizes[size_i])
            hidden, residual, pos = graphs.output(sizes[size_i])
        assert residual is not None
        hidden, _ = block.norm(hidden[-1:], residual[-1:])
        logits = model.compute_logits(hidden)[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    total = time.perf_counter() - t_start
    recomputed = candidates  # stored tokens still active after the last layer
    stats = FusionStats(
        mode=mode.value,
        # without a recompute candidate: 1 where every chunk was computed (``prefix`` computes all after
        # the first, as ``ask`` reports it), else 0 (``reuse``, or a prompt of an exact prefix only)
        recompute_ratio=(recomputed / num_fusable if num_fusable
                         else float(_recomputes_all(mode, policy) or mode is FusionMode.PREFIX)),
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
        recomputed_positions=pos.index_select(0, true_indices(fusable.index_select(0, pos), recomputed)),
    )
    return logits, stats


def _within_depth(policy: SelectionPolicy, num_layers: int, mode: FusionMode) -> SelectionPolicy:
    """``policy`` with only the check layers the model has. The shipped policy checks layers 1-5 and
    narrows to its ratio at the last one; on a shallower model (a small or pruned checkpoint) the
    checks past its last layer never ran, so selection stopped at an earlier check's wider share
    (4 layers at ratio 0.3 recomputed 60% of the stored tokens). Its checks then narrow to the ratio
    at the model's last check layer instead. A one-layer model has no layer to check (layer 0 never
    deviates): selective recompute there is refused, not silently run at another ratio."""
    layers = tuple(li for li in policy.check_layers if li < num_layers)
    if layers == policy.check_layers:
        return policy
    if layers:
        return replace(policy, check_layers=layers)
    if mode is FusionMode.FUSE and (0.0 < policy.ratio < 1.0 or policy.forces_tokens()):
        raise RequestError(f"fuse mode selects tokens at check layers {policy.check_layers}, but the model has "
                           f"{num_layers} layer(s): use ratio 0 or 1, or the reuse or full mode")
    return policy


def _recomputes_all(mode: FusionMode, policy: SelectionPolicy) -> bool:
    return mode is FusionMode.FULL or (mode is FusionMode.FUSE and policy.ratio >= 1.0)


def _stored_segments(
    segments: list[Segment], mode: FusionMode, policy: SelectionPolicy, behind_system: bool
) -> set[int]:
    """Indices of the segments whose stored KV this mode uses. Fusion at ratio 1 (the controller's
    choice when loading is slower than recomputing) loads only what it will not recompute: the
    exact prefix, none behind a system prompt; loading the rest would only add its time."""
    first = {0} if segments and segments[0].kv is not None else set()
    if mode is FusionMode.FULL or (_recomputes_all(mode, policy) and behind_system):
        return set()
    if mode is FusionMode.PREFIX or _recomputes_all(mode, policy):
        return first
    return {i for i, s in enumerate(segments) if s.kv is not None}


def _first_layer_rows(segments: list[Segment], used: set[int], skip: list[int], num_stored: int) -> int:
    """How many leading rows of the loaded KV layer 0 reads: those of the sources not skipped there.
    They lead: either no source is skipped, or every one but an exact prefix, which comes first (a
    source that starts at the prompt's last token has no stored row)."""
    rows = start = 0
    for i, skipped in zip(sorted(used), skip, strict=True):
        end = start + len(segments[i].token_ids)
        if not skipped:
            assert start == rows or start >= num_stored, "the rows layer 0 reads do not lead"
            rows = end if start == rows else rows
        start = end
    return min(rows, num_stored)


def _starts(segments: list[Segment], used: set[int]) -> list[int]:
    """Prompt position where each used segment starts (in the order of ``sources``)."""
    starts = np.cumsum([0] + [len(s.token_ids) for s in segments])
    return [int(starts[i]) for i in sorted(used)]


def _to_device(device: torch.device, arrays: dict[str, np.ndarray | np.generic]) -> dict[str, torch.Tensor]:
    """The arrays on ``device`` in one host-to-device transfer: their bytes packed into one buffer
    (page-locked on CUDA, so the host goes on at once), one run per dtype, each run 8-byte aligned
    and viewed as its dtype once, then split into the arrays: a few torch calls for the lot, since
    each costs host time before layer 0 is launched."""
    runs: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}
    for name, value in arrays.items():
        a = np.asarray(value)
        runs.setdefault(a.dtype, []).append((name, a))
    spans = [-(-sum(a.nbytes for _, a in run) // 8) * 8 for run in runs.values()]
    host = torch.empty(sum(spans), dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()
    offset = 0
    for run, span in zip(runs.values(), spans, strict=True):
        np.concatenate([a.reshape(-1) for _, a in run], out=raw[offset : offset + span].view(run[0][1].dtype)[
            : sum(a.size for _, a in run)])
        offset += span
    buf = host.to(device, non_blocking=True)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for (dtype, run), span in zip(runs.items(), spans, strict=True):
        sizes = [a.size for _, a in run]
        flat = buf[offset : offset + span].view(_TORCH_DTYPES[dtype])
        for (name, a), t in zip(run, flat[: sum(sizes)].split(sizes), strict=True):
            out[name] = t if a.ndim == 1 else t.view(a.shape)
        offset += span
    return out


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.float32): torch.float32}
