"""CUDA graphs of the fused prefill: the steady layers, and whole check layers.

Past its last check layer every layer runs the same few hundred active tokens (the selected ones
and the query): ~20 launches of GPU work a layer, and ~0.5 ms of it on an H100 for a 7B model, while
launching them from Python costs about twice that (measured: ``reuse``, 32 tokens a layer, took
45 ms for 10 ms of loading). Each layer is captured once per (active, stored) capacity and replayed
with one launch, between the loader's per-layer waits for its stored KV.

The check layers of gradual filtering run up to a few thousand tokens, and launched eagerly they set
the pace too: ~2 ms of host work a layer for 0.4-1.4 ms of GPU work (H100, Mistral-7B, 6 x 512
tokens; with only their halves captured and the selection launched between them, still ~2 ms). A
check layer's selection depends on the data, but every size in it is known up front, so the whole
layer is one graph: the front (stored KV written, the active tokens' q, K and V), the question's
attention, the selection (``selection.check_keep``, the code the eager pass runs), the dropped
tokens' stored KV put back, the active rows' state gathered down to the kept rows, and the back
(attention and MLP of the kept rows). Its shapes are capacities (rows in and out at multiples of
``CHECK_STEP``, prompt positions at multiples of ``PROMPT_STEP``): the real counts live on the
device (``bounds``, the row's slot), so prompts of nearby lengths share a capture.

Graphs fix every address, so a pass copies its inputs into static buffers first: the active
tokens' hidden state, positions, slots, stored-KV rows and stale-shift segments (padded to the
captured size), the stored tokens' positions and slots (padded likewise), the block table,
``bounds = [0, active, prompt length]`` (which the Triton attention kernel reads on the device), and
for the check layers the prompt's slots, which positions always stay active, and the question's
length. Padding is inert as in ``cuda_graphs``: a slot of -1 writes nothing, query rows past
``bounds[1]`` attend to nothing, a selection never keeps a row whose slot is -1, every other op is
row-wise. The stored KV itself arrives in a ring of device buffers that belongs to the stored
capacity, which the loader fills (``LayerPrefetcher(ring=...)``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import ops
from ..cuda_graphs import PREFILL_BUCKETS, capture_call
from ..staged_inputs import StagedInputs
from .layer_step import KVCache, back, front, revert
from .prefetch import RING_SLOTS
from .selection import SelectionPolicy, check_keep
from .stale_shift import QUESTION_WINDOW, MassCap, ShiftIndex, question_rows, segment_bounds

STORED_STEP = 512  # stored-token capacities are multiples of this: few captures, little padding
# a check layer runs 400-2600 tokens (6 x 512 at r = 15%: 2592 down to 416): captured at multiples of
# 32 rows, since padding 800 rows to the next prefill bucket (1024) costs ~0.2 ms
CHECK_STEP = 32
CHECK_MAX_ROWS = 4096
# the steady layers' active rows: the prefill buckets up to 512, then every 64 up to the check layers' cap.
# The prefill buckets' 768 and 1024 padded the 646 rows of r = 20% over 6 x 512 stored tokens to 768: a
# fifth more rows of matmuls in each of 26 layers, ~3 ms of a ~23 ms pass (H200, Mistral-7B shape). Past
# 1024 rows the steady layers ran eagerly, on the view that launching hides behind so many rows' matmuls.
# Mostly it does, not wholly: replayed, r = 50% of that prompt (1312 rows) took 43.2 vs 44.8 ms, r = 70%
# 55.0 vs 55.9, prefix (2592 rows) 67.7 vs 68.3 (H200, one process, medians of 9; results/fusion-h200-1201),
# and two of four earlier `bench fusion` runs had r = 50% eagerly at 73-75 ms, longer than recomputing all
ACTIVE_BUCKETS = (*(b for b in PREFILL_BUCKETS if b <= 512), *range(576, CHECK_MAX_ROWS + 1, 64))
PROMPT_STEP = 512  # the question's attention runs over the prompt's positions, padded to this
MAX_CHECK_GRAPHS = 256  # check-layer and first-layer graphs kept (least recently used go first): many prompt sizes
# stored segments a graphed pass may have: the stale shift's kernels work on all captured segments at
# once (a one-hot matrix of them), so the spare sits just past this many, making 64 with it (a spare at
# the stored capacity made 3073 of them, 2.6 ms a layer on an H100); more segments run eagerly
MAX_SEGMENTS = 63
STATE_PAD = (0, -1, 0, MAX_SEGMENTS)  # an inert active row: position 0, no slot (writes nothing), stored row 0, spare
STORED_PAD = (0, -1, MAX_SEGMENTS)  # an inert stored row: position 0, no slot, the spare segment


def check_rows(active: int) -> int | None:
    """Rows of the check-layer graph for ``active`` tokens, or None when it runs eagerly."""
    rows = -(-active // CHECK_STEP) * CHECK_STEP
    return rows if 0 < rows <= CHECK_MAX_ROWS else None


def capacity(active: int, stored: int) -> tuple[int, int] | None:
    """(active rows, stored rows) of the graphs a pass with these counts replays, or None (run eagerly)
    past ``CHECK_MAX_ROWS`` active rows or without stored tokens."""
    rows = next((b for b in ACTIVE_BUCKETS if b >= active), None)
    if rows is None or stored < 1:
        return None
    return rows, -(-stored // STORED_STEP) * STORED_STEP


@dataclass(frozen=True)
class CheckShape:
    """What a check layer's graph is captured for: the layer, its active rows before and after
    (capacities), the prompt positions and question rows its attention weight covers (0: no
    weight), and the policy's parts that change the captured work."""

    layer: int
    rows_in: int
    rows_out: int
    prompt: int
    tail: int
    metric: str
    attention_weight: float
    revert: bool
    mass_cap: bool  # the K shift capped by the question (``stale_shift.begin_k_mass_cap``)

    @classmethod
    def of(cls, layer: int, active_in: int, active_out: int, prompt: int, tail: int,
           policy: SelectionPolicy, mass_cap: bool = False) -> CheckShape | None:
        rows_in, rows_out = check_rows(active_in), check_rows(active_out)
        if rows_in is None or rows_out is None:
            return None
        weighted = policy.attention_weight > 0 and tail > 0
        return cls(layer, rows_in, rows_out, -(-prompt // PROMPT_STEP) * PROMPT_STEP if weighted else 0,
                   -(-tail // CHECK_STEP) * CHECK_STEP if weighted else 0, policy.metric, policy.attention_weight,
                   policy.revert_dropped, mass_cap)


@dataclass(frozen=True)
class FirstShape:
    """What a layer before the first check is captured for: every token is active there (all their
    stored KV is overwritten unread, so no stale shift), ``rows`` a capacity as for check layers.
    Launched eagerly, layer 0's small kernels waited on the host (~0.5 ms of a 2.5 ms layer on an
    H200 for 2.6K tokens of a 7B model)."""

    layer: int
    rows: int

    @classmethod
    def of(cls, layer: int, active: int) -> FirstShape | None:
        rows = check_rows(active)
        return None if rows is None else cls(layer, rows)


@dataclass
class PassInputs:
    """A pass's own inputs to the graphs, on the host (``FusionGraphs.send``)."""

    table: np.ndarray  # the sequence's block table
    stored_at: np.ndarray  # the stored tokens' model positions, cache slots, stale-shift segments
    stored_slots: np.ndarray
    stored_segment: np.ndarray | None  # None: no stale shift
    prompt_slots: np.ndarray  # every prompt position's cache slot
    must_keep: np.ndarray  # bool per position: kept by every check
    share: np.ndarray | None  # the stale shift's (K, V) shares (None: no shift)
    mass_cap: float  # nats the K shift may move the question's attention mass (graphs captured with the cap)
    tail: int  # the question's length
    active_in: np.ndarray  # each layer's active rows coming in (the K mass cap's question is their last ``tail``)
    num_segments: int  # the fusor's segments, its spare (the last) becoming the graphs'
    first: FirstInputs | None = None  # when layer 0 replays


@dataclass
class FirstInputs:
    """What a pass that replays from layer 0 sends as well (``PassInputs.first``): its active
    tokens' state, and what the pass itself reads, so that it makes no other transfer before layer 0."""

    positions: np.ndarray  # the active tokens' model positions, cache slots, rows of the loaded stored KV, segments
    slots: np.ndarray
    stored_rows: np.ndarray
    segment: np.ndarray
    ids: np.ndarray  # their token ids
    sizes_bounds: np.ndarray  # [active-set sizes, 3]: ``bounds`` of each, in the pass's order
    fusable: np.ndarray  # bool per prompt position: a recompute candidate


class _Stored:
    """The static stored-KV inputs of one stored capacity: the loader's ring and the stored tokens'
    model positions, cache slots and stale-shift segments (``spare`` = ``MAX_SEGMENTS``, past any real one, for
    rows without a stored token: its shift is zero)."""

    def __init__(self, stored: int, kv_cache: KVCache, device: torch.device) -> None:
        _, _, kv_heads, head_dim = kv_cache[0].shape
        shape = (RING_SLOTS, stored, kv_heads, head_dim)
        self.ring = (torch.zeros(shape, dtype=kv_cache[0].dtype, device=device),
                     torch.zeros(shape, dtype=kv_cache[0].dtype, device=device))
        self.spare = MAX_SEGMENTS
        # positions, slots, segments: one tensor, and the segments' bounds (``MassCap.bounds``; the
        # spare's run is empty), sent from the host by one copy a pass (``FusionGraphs.send``)
        self.staged = StagedInputs({"state": ((len(STORED_PAD), stored), torch.int64),
                                    "bounds": ((MAX_SEGMENTS + 2,), torch.int64)}, device)
        self.state, self.bounds = self.staged.device["state"], self.staged.device["bounds"]
        self.state.copy_(torch.tensor(STORED_PAD, device=device)[:, None].expand(-1, stored))
        self.at, self.slots, self.segment = self.state.unbind(0)


class _Capacity:
    """The steady layers' graphs of one (active, stored) capacity, over its stored inputs."""

    def __init__(self, rows: int, stored: int, inputs: _Stored) -> None:
        self.rows = rows
        self.stored = stored
        self.inputs = inputs
        self.ring = inputs.ring
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (layer, K shift's mass capped)


class FusionGraphs:
    """Per-layer graphs of the fused prefill: steady layers keyed by ``capacity``; check layers and the
    layers before them (``early``) by (``CheckShape`` or ``FirstShape``, stored capacity)."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, max_model_len: int,
                 device: torch.device, pool: tuple) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.pool = pool
        self.max_blocks = -(-max_model_len // block_size)
        rows, hidden = max(PREFILL_BUCKETS[-1], CHECK_MAX_ROWS), model.config.hidden_size
        dtype = model.lm_head.weight.dtype
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        positions = -(-max_model_len // PROMPT_STEP) * PROMPT_STEP
        # a pass's own inputs, sent from the host by one copy (``send``): the active rows' state (model
        # positions, cache slots, rows of the loaded stored KV, segments: one tensor, so a check layer
        # narrows all four with one gather), the block table, ``bounds``, the stale shift's (K, V) shares
        # (0 shifts nothing) and its K mass cap, for the check layers the prompt's slots, the positions
        # always kept and the question's length, and for a pass replaying from layer 0 what it reads
        # itself (its tokens' ids, the bounds of each active-set size, which positions are candidates);
        # the K mass cap's question rows for every layer (made on the host: ~10 small launches a layer)
        self.staged = StagedInputs({
            "state": ((len(STATE_PAD), rows), torch.int64), "table": ((1, self.max_blocks), torch.int32),
            "bounds": ((3,), torch.int32), "share": ((2,), torch.float32), "mass_cap": ((1,), torch.float32),
            "prompt_slots": ((positions,), torch.int64), "must_keep": ((positions,), torch.bool),
            "tail": ((), torch.int64), "ids": ((rows,), torch.int64),
            "sizes_bounds": ((model.config.num_layers + 1, 3), torch.int32), "fusable": ((positions,), torch.bool),
            "question_rows": ((model.config.num_layers, QUESTION_WINDOW), torch.int64),
            "question_ok": ((QUESTION_WINDOW,), torch.bool),
        }, device)
        staged = self.staged.device
        self.state_pad = torch.tensor(STATE_PAD, device=device)[:, None]
        self.state = staged["state"]
        self.state.copy_(self.state_pad.expand(-1, rows))
        self.positions, self.slots, self.rows, self.segment = self.state.unbind(0)
        self.table, self.bounds, self.share = staged["table"], staged["bounds"], staged["share"]
        self.mass_cap = staged["mass_cap"]
        self.prompt_slots, self.must_keep, self.tail = staged["prompt_slots"], staged["must_keep"], staged["tail"]
        self.question_rows, self.question_ok = staged["question_rows"], staged["question_ok"]
        self.stored_inputs: dict[int, _Stored] = {}  # by stored capacity
        self.capacities: dict[tuple[int, int], _Capacity] = {}
        # least recent first
        self.checks: OrderedDict[tuple[CheckShape | FirstShape, int], torch.cuda.CUDAGraph] = OrderedDict()
        self.max_checks = MAX_CHECK_GRAPHS
        self.replays = 0  # layers served by a graph (for tests and the profile)

    def accepts(self, active: int, stored: int, num_blocks: int, segments: int) -> bool:
        """Whether a pass of ``active`` rows past its checks, ``stored`` stored tokens in ``segments``
        stored segments, over ``num_blocks`` cache blocks, replays graphs."""
        return (capacity(active, stored) is not None and num_blocks <= self.max_blocks
                and segments <= MAX_SEGMENTS)

    def prepare(self, active: int, stored: int, layers: range, checks: list[CheckShape | FirstShape],
                mass_cap: bool = False) -> _Capacity:
        """The capacity for these counts with the steady ``layers`` and the early ``checks`` (check
        layers and the layers before them) captured (what is missing now, before any input is loaded:
        the capture runs are inert); the steady layers with the K shift's mass cap where ``mass_cap``
        (its work is captured only where a pass asks for it)."""
        key = capacity(active, stored)
        assert key is not None, "accepts() first"
        cap = self.capacities.get(key)
        if cap is None:
            inputs = self.stored_inputs.get(key[1])
            if inputs is None:
                inputs = self.stored_inputs[key[1]] = _Stored(key[1], self.kv_caches[0], self.device)
            cap = self.capacities[key] = _Capacity(*key, inputs)
        missing = [(li, mass_cap) for li in layers if (li, mass_cap) not in cap.graphs]
        todo = [c for c in checks if (c, cap.stored) not in self.checks]
        for c in checks:
            if (c, cap.stored) in self.checks:
                self.checks.move_to_end((c, cap.stored))
        if missing or todo:
            self._make_inert(cap)
            for key in missing:
                cap.graphs[key], _ = capture_call(self._step, (*key, cap), self.pool)
            for c in todo:
                fn = self._check if isinstance(c, CheckShape) else self._first
                self.checks[(c, cap.stored)], _ = capture_call(fn, (c, cap), self.pool)
        # this pass's own graphs are the most recent: never the ones dropped
        while len(self.checks) > max(self.max_checks, len(checks)):
            self.checks.popitem(last=False)
        return cap

    def send(self, cap: _Capacity, inputs: PassInputs) -> None:
        """Put a pass's own inputs into the static ones, padded inert (two copies from page-locked
        host memory, in the stream's order: before the first replay, after any earlier pass)."""
        stored = cap.inputs.staged.host()["state"]
        stored[...] = np.array(STORED_PAD)[:, None]
        s = len(inputs.stored_at)
        stored[0, :s], stored[1, :s] = inputs.stored_at, inputs.stored_slots
        stored_bounds = cap.inputs.staged.host()["bounds"]
        stored_bounds[...] = 0
        if inputs.stored_segment is not None:
            stored[2, :s] = inputs.stored_segment
            stored_bounds[...] = segment_bounds(inputs.stored_segment, MAX_SEGMENTS + 1)
        h = self.staged.host()
        h["question_rows"][...], h["question_ok"][...] = question_rows(inputs.active_in, inputs.tail)
        h["table"][...] = 0
        h["table"][0, : len(inputs.table)] = inputs.table
        h["share"][...] = inputs.share if inputs.share is not None else 0.0
        h["mass_cap"][...] = inputs.mass_cap
        h["tail"][...] = inputs.tail
        h["prompt_slots"][...] = 0
        h["prompt_slots"][: len(inputs.prompt_slots)] = inputs.prompt_slots
        h["must_keep"][...] = False
        h["must_keep"][: len(inputs.must_keep)] = inputs.must_keep
        state = h["state"]
        state[...] = np.array(STATE_PAD)[:, None]
        h["bounds"][...] = 0
        if inputs.first is not None:
            first = inputs.first
            a = len(first.positions)
            state[0, :a], state[1, :a], state[2, :a] = first.positions, first.slots, first.stored_rows
            state[3, :a] = np.where(first.segment == inputs.num_segments - 1, cap.inputs.spare, first.segment)
            h["bounds"][...] = first.sizes_bounds[0]
            h["ids"][:a] = first.ids
            h["sizes_bounds"][: len(first.sizes_bounds)] = first.sizes_bounds
            h["fusable"][: len(first.fusable)] = first.fusable
        cap.inputs.staged.send()
        self.staged.send()

    def first_inputs(self, first: FirstInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The device views of what ``send`` staged for a pass replaying from layer 0 that the pass
        reads itself: the bounds of each active-set size, and which positions are candidates (its
        token ids are embedded by layer 0's graph)."""
        d = self.staged.device
        return d["sizes_bounds"][: len(first.sizes_bounds)], d["fusable"][: len(first.fusable)]

    def stage(self, cap: _Capacity, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, rows: torch.Tensor, segment: torch.Tensor, bounds: torch.Tensor,
              num_segments: int) -> None:
        """Copy the active tokens' state (hidden state and residual) from the last eager layer into the
        static inputs, padding made inert. ``segment``: the fusor's segment per active row, whose
        spare (``num_segments - 1``) becomes the capacity's."""
        a = hidden.shape[0]
        self.hidden[:a].copy_(hidden)
        self.residual[:a].copy_(residual)
        spare = cap.inputs.spare
        self.positions[:a].copy_(positions)
        self.positions[a:].zero_()  # any valid RoPE row; these queries attend to nothing
        self.slots[:a].copy_(slots)
        self.slots[a:].fill_(-1)
        self.rows[:a].copy_(rows)
        self.rows[a:].zero_()
        self.segment[:a].copy_(segment.masked_fill(segment == num_segments - 1, spare))
        self.segment[a:].fill_(spare)
        self.bounds.copy_(bounds)

    def check(self, cap: _Capacity, shape: CheckShape | FirstShape, bounds: torch.Tensor) -> None:
        """Replay a check layer (or a layer before the first) over the staged tokens; ``bounds`` are
        those of the rows it keeps. Its output (hidden, residual and state of the kept rows) is left
        staged for the next layer."""
        self.bounds.copy_(bounds)
        self.checks[(shape, cap.stored)].replay()
        self.replays += 1

    def replay(self, cap: _Capacity, layer: int, mass_cap: bool = False) -> None:
        cap.graphs[(layer, mass_cap)].replay()
        self.replays += 1

    def output(self, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, residual, positions) of the real rows after the last replayed layer."""
        return self.hidden[:active], self.residual[:active], self.positions[:active]

    def _step(self, layer: int, mass_cap: bool, cap: _Capacity) -> None:
        """One steady layer over the static buffers; its outputs overwrite its inputs (layer 0: a pass
        without checks, replayed from its start, embeds its tokens first)."""
        rows = cap.rows
        if layer == 0:
            self._embed(rows)
        q, *_ = self._front_call(layer, rows, cap, keep=False, mass_cap=mass_cap)
        self._back_call(layer, rows, q)

    def _first(self, shape: FirstShape, cap: _Capacity) -> None:
        """A layer before the first check over the static buffers: every token active, no shift (layer 0
        embeds the pass's tokens first)."""
        if shape.layer == 0:
            self._embed(shape.rows)
        q, *_ = self._front_call(shape.layer, shape.rows, cap, keep=False, shift=False)
        self._back_call(shape.layer, shape.rows, q)

    def _embed(self, rows: int) -> None:
        """The staged token ids' embeddings into the static hidden state, for a pass replayed from layer 0
        (three launches fewer on the host while the GPU waits for its first work); no residual yet: a
        zero one, as ``x + 0`` normed is ``x`` normed."""
        embed = self.model.model.embed_tokens.weight
        torch.index_select(embed, 0, self.staged.device["ids"][:rows], out=self.hidden[:rows])
        self.residual[:rows].zero_()

    def _check(self, shape: CheckShape, cap: _Capacity) -> None:
        """One check layer over the static buffers, narrowing the active rows' state in place."""
        rows_in, rows_out = shape.rows_in, shape.rows_out
        q, k_raw, v, residual, written = self._front_call(shape.layer, rows_in, cap, mass_cap=shape.mass_cap)
        assert written is not None
        positions, slots = self.positions[:rows_in], self.slots[:rows_in]
        valid = slots >= 0  # every real active token has a slot: padding has -1
        weight = self._question_weight(shape, q, positions, valid) if shape.tail else None
        kept = check_keep(shape.metric, shape.attention_weight, (k_raw, v), written, self.rows[:rows_in], positions,
                          self.must_keep, weight, rows_out, self.bounds[1], valid)
        live = kept < rows_in
        take = kept.clamp(max=rows_in - 1)
        kept_state = torch.where(live, self.state[:, :rows_in].index_select(1, take), self.state_pad)
        if shape.revert:
            revert(self.kv_caches[shape.layer], self.model.model.rotary, written,
                   (cap.inputs.at, cap.inputs.slots),
                   (k_raw.index_select(0, take), v.index_select(0, take), kept_state[0], kept_state[1]))
        q_kept = q.index_select(0, take)
        # the kept rows' residual into the static one (gathered first: ``residual`` is that buffer)
        self.residual[:rows_out].copy_(residual.index_select(0, take))
        self.state[:, :rows_out].copy_(kept_state)
        self.state[:, rows_out:].copy_(self.state_pad.expand(-1, self.state.shape[1] - rows_out))
        self._back_call(shape.layer, rows_out, q_kept)

    def _question_weight(self, shape: CheckShape, q: torch.Tensor, positions: torch.Tensor,
                         valid: torch.Tensor) -> torch.Tensor:
        """The question's attention per prompt position [shape.prompt], as the eager pass computes it
        for its last ``tail`` active rows, here with the counts on the device: padded query rows
        see every real key and count for nothing, padded key positions are hidden from all."""
        idx, q_ok = self._question_rows(valid, self.tail, shape.tail)
        n = self.bounds[2]
        q_pos = torch.where(q_ok, positions.index_select(0, idx), n - 1)
        scale = self.model.model.layers[shape.layer].self_attn.attn.scale
        return ops.question_attention(q.index_select(0, idx), self.kv_caches[shape.layer][0],
                                      self.prompt_slots[: shape.prompt], q_pos, n, scale, q_ok)

    @staticmethod
    def _question_rows(valid: torch.Tensor, count: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The active rows of the question's last ``count`` tokens (a device count), padded to
        ``width`` rows (the last real row again), and which of them are real: the question's tokens
        are the last real rows."""
        last = valid.sum() - 1
        ar = torch.arange(width, device=valid.device)
        idx = torch.minimum(last + 1 - count + ar, last).clamp(min=0)  # (no real row at all in a capture run)
        return idx, ar < count

    def _front_call(self, layer: int, rows: int, cap: _Capacity, keep: bool = True,
                    shift: bool = True, mass_cap: bool = False) -> tuple[torch.Tensor, ...]:
        block, slot = self.model.model, layer % RING_SLOTS
        inputs = cap.inputs
        stored = (inputs.ring[0][slot], inputs.ring[1][slot], inputs.at, inputs.slots)
        question = None
        if mass_cap:
            question = MassCap(self.mass_cap, self.question_rows[layer], self.question_ok, inputs.bounds)
        index = ShiftIndex(self.share, self.rows[:rows], self.segment[:rows], inputs.segment, inputs.spare + 1,
                           question)
        q, k_raw, v, residual, written = front(block.layers[layer], self.kv_caches[layer], block.rotary, stored,
                                               self.hidden[:rows], self.residual[:rows], self.positions[:rows],
                                               self.slots[:rows], index if shift else None, keep)
        return q, k_raw, v, residual, written

    def _back_call(self, layer: int, rows: int, q: torch.Tensor) -> None:
        """The layer's second half over the static residual, its outputs left in the static buffers (the
        residual updated in place, the hidden state written there by the last matmul)."""
        # seq_len and the sequence's slots are read by the torch attention only; Triton reads bounds
        back(self.model.model.layers[layer], self.kv_caches[layer], q, self.residual[:rows], self.positions[:rows],
             self.table, 0, self.slots, self.bounds, None, out=self.hidden[:rows])

    def _make_inert(self, cap: _Capacity) -> None:
        """Inputs that write and attend to nothing, for the capture runs. Positions, stored rows and
        the question's rows too: a larger pass may have left ones past this capacity's buffers, which a
        capture run would index with (the question's rows of a prefix pass over 2592 rows, then the
        first capture of r = 15%'s 416: a device-side assert, the end of the process's CUDA context)."""
        self.slots.fill_(-1)
        self.positions.zero_()
        self.rows.zero_()
        self.question_rows.zero_()
        self.bounds.zero_()
        self.share.zero_()
        self.tail.zero_()
        self.question_ok.zero_()
        cap.inputs.slots.fill_(-1)
        cap.inputs.bounds.zero_()
        cap.inputs.segment.fill_(cap.inputs.spare)
        self.segment.fill_(cap.inputs.spare)
