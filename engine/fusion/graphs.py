"""CUDA graphs of the fused prefill's layers that run few active tokens.

Past its last check layer every layer runs the same few hundred active tokens (the selected ones
and the query): ~20 launches of GPU work a layer, and ~0.5 ms of it on an H100 for a 7B model, while
launching them from Python costs about twice that (measured: ``reuse``, 32 tokens a layer, took
45 ms for 10 ms of loading). Each layer is captured once per (active, stored) capacity and replayed
with one launch, between the loader's per-layer waits for its stored KV.

The check layers of gradual filtering run up to a thousand tokens, and their eager launches set the
pace too: ~1.9 ms of host work a layer for 0.6-1.4 ms of GPU work (H100, Mistral-7B, 6 x 512
tokens). A check layer's active set shrinks between its halves, by a selection that depends on the
data but whose sizes the host knows up front; so each half is captured on its own, keyed by layer
and row capacity: ``front`` (stored KV written, the active tokens' q, K and V out) and ``back``
(attention and MLP of the tokens kept), with the selection launched eagerly between them.

Graphs fix every address, so a pass copies its inputs into static buffers first: the active
tokens' hidden state, positions and slots (padded to the captured size), the stored tokens'
positions and slots (padded likewise), the block table and ``bounds = [0, active, prompt length]``,
which the Triton attention kernel reads on the device. Padding is inert as in ``cuda_graphs``: a
slot of -1 writes nothing, query rows past ``bounds[1]`` attend to nothing, every other op is
row-wise. The stored KV itself arrives in a ring of device buffers that belongs to the stored
capacity, which the loader fills (``LayerPrefetcher(ring=...)``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..cuda_graphs import PREFILL_BUCKETS, capture_call, prefill_bucket
from .layer_step import KVCache, back, front
from .prefetch import RING_SLOTS
from .stale_shift import ShiftIndex

STORED_STEP = 512  # stored-token capacities are multiples of this: few captures, little padding
# a check layer's halves run 400-2000 tokens (6 x 512 at r = 15%: 1184 down to 416): captured at
# multiples of 32 rows, since padding a half from 800 to the next prefill bucket (1024) costs ~0.2 ms
HALF_STEP = 32
HALF_MAX_ROWS = 2048


def half_rows(active: int) -> int | None:
    """Rows of the check-layer half graph for ``active`` tokens, or None when it runs eagerly."""
    rows = -(-active // HALF_STEP) * HALF_STEP
    return rows if 0 < rows <= HALF_MAX_ROWS else None


def capacity(active: int, stored: int) -> tuple[int, int] | None:
    """(active rows, stored rows) of the graphs a pass with these counts replays, or None when its
    active set is large enough to be matmul-bound (launched eagerly, launching hidden behind it)."""
    rows = prefill_bucket(active)
    if rows is None or stored < 1:
        return None
    return rows, -(-stored // STORED_STEP) * STORED_STEP


class _Stored:
    """The static stored-KV inputs of one stored capacity: the loader's ring and the stored tokens'
    model positions, cache slots and stale-shift segments (``spare``, one past any real segment, for
    rows without a stored token: its shift is zero); and ``written``, where a check layer's front
    leaves the stored KV as it wrote it (moved by the stale shift), which its selection compares with."""

    def __init__(self, stored: int, kv_cache: KVCache, device: torch.device) -> None:
        _, _, kv_heads, head_dim = kv_cache[0].shape
        shape = (RING_SLOTS, stored, kv_heads, head_dim)
        self.ring = (torch.zeros(shape, dtype=kv_cache[0].dtype, device=device),
                     torch.zeros(shape, dtype=kv_cache[0].dtype, device=device))
        self.at = torch.zeros(stored, dtype=torch.long, device=device)
        self.slots = torch.full((stored,), -1, dtype=torch.long, device=device)
        self.spare = stored
        self.segment = torch.full((stored,), stored, dtype=torch.long, device=device)
        self.written = (torch.zeros(shape[1:], dtype=kv_cache[0].dtype, device=device),
                        torch.zeros(shape[1:], dtype=kv_cache[0].dtype, device=device))


class _Capacity:
    """The steady layers' graphs of one (active, stored) capacity, over its stored inputs."""

    def __init__(self, rows: int, stored: int, inputs: _Stored) -> None:
        self.rows = rows
        self.stored = stored
        self.inputs = inputs
        self.ring = inputs.ring
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by layer


class FusionGraphs:
    """Per-layer graphs of the fused prefill: steady layers keyed by ``capacity``, check-layer
    halves by (half, layer, rows[, stored capacity])."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, max_model_len: int,
                 device: torch.device, pool: tuple) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.pool = pool
        self.max_blocks = -(-max_model_len // block_size)
        rows, hidden = max(PREFILL_BUCKETS[-1], HALF_MAX_ROWS), model.config.hidden_size
        dtype = model.lm_head.weight.dtype
        attn = model.model.layers[0].self_attn
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.table = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=device)
        self.bounds = torch.zeros(3, dtype=torch.int32, device=device)
        # a check layer's front writes q, K and V here; its back reads the kept rows of q and residual
        self.q = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
        self.k_raw = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.q_kept = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
        self.residual_kept = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # the stale shift's inputs per active row (``set_shift``); a share of 0 shifts nothing
        self.share = torch.zeros((), device=device)
        self.shift_rows = torch.zeros(rows, dtype=torch.long, device=device)
        self.shift_segment = torch.zeros(rows, dtype=torch.long, device=device)
        self.stored_inputs: dict[int, _Stored] = {}  # by stored capacity
        self.capacities: dict[tuple[int, int], _Capacity] = {}
        self.halves: dict[tuple[str, int, int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # layers and halves served by a graph (for tests and the profile)

    def accepts(self, active: int, stored: int, num_blocks: int) -> bool:
        return capacity(active, stored) is not None and num_blocks <= self.max_blocks

    def prepare(self, active: int, stored: int, layers: range, halves: list[tuple[str, int, int]]) -> _Capacity:
        """The capacity for these counts with ``layers`` and the check-layer ``halves`` (half,
        layer, active tokens) that fit a capture captured (what is missing now, before any input
        is loaded: the capture runs are inert)."""
        key = capacity(active, stored)
        assert key is not None, "accepts() first"
        cap = self.capacities.get(key)
        if cap is None:
            inputs = self.stored_inputs.get(key[1])
            if inputs is None:
                inputs = self.stored_inputs[key[1]] = _Stored(key[1], self.kv_caches[0], self.device)
            cap = self.capacities[key] = _Capacity(*key, inputs)
        missing = [li for li in layers if li not in cap.graphs]
        todo = [(half, li, rows) for half, li, a in halves
                if (rows := half_rows(a)) is not None and self._key(cap, half, li, rows) not in self.halves]
        if missing or todo:
            self._make_inert(cap)
            for li in missing:
                cap.graphs[li], _ = capture_call(self._step, (li, cap), self.pool)
            for half, li, rows in todo:
                fn = self._front if half == "front" else self._back
                self.halves[self._key(cap, half, li, rows)], _ = capture_call(fn, (li, rows, cap), self.pool)
        return cap

    def has(self, cap: _Capacity, half: str, layer: int, active: int) -> bool:
        """Whether ``prepare`` captured this half for ``active`` tokens."""
        rows = half_rows(active)
        return rows is not None and self._key(cap, half, layer, rows) in self.halves

    def begin(self, cap: _Capacity, stored_at: torch.Tensor, stored_slots: torch.Tensor, table: torch.Tensor) -> None:
        """Copy a pass's stored tokens' positions and slots and its block table into the static
        inputs, before its first replay."""
        s, inputs = stored_at.shape[0], cap.inputs
        inputs.at[:s].copy_(stored_at)
        inputs.at[s:].zero_()
        inputs.slots[:s].copy_(stored_slots)
        inputs.slots[s:].fill_(-1)
        self.table[:, : table.shape[1]].copy_(table)

    def set_shift(self, cap: _Capacity, shift: ShiftIndex | None) -> None:
        """The stale shift's inputs for the current active set, or a zero share without one. Every
        pass sets them before its first replay, so no index or share of an earlier pass (maybe of
        another capacity) reaches its graphs; padding rows fall in the spare segment."""
        inputs, spare = cap.inputs, cap.inputs.spare
        inputs.segment.fill_(spare)
        if shift is None:
            self.share.zero_()
            self.shift_rows.zero_()
            self.shift_segment.fill_(spare)
            return
        self.share.copy_(shift.share)
        inputs.segment[: shift.stored_segment.shape[0]].copy_(shift.stored_segment)
        self.set_active_shift(cap, shift)

    def set_active_shift(self, cap: _Capacity, shift: ShiftIndex) -> None:
        """The active rows' part of ``set_shift``, all a check layer's narrowing changes (the share
        and the stored rows' segments stay for the pass)."""
        a, spare = shift.active_rows.shape[0], cap.inputs.spare
        self.shift_rows[:a].copy_(shift.active_rows)
        self.shift_rows[a:].zero_()
        seg = shift.active_segment
        self.shift_segment[:a].copy_(seg.masked_fill(seg == shift.num_segments - 1, spare))
        self.shift_segment[a:].fill_(spare)

    def stage(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              slots: torch.Tensor, bounds: torch.Tensor) -> None:
        """Copy the active tokens' state from an eager layer into the static inputs, padding made inert.
        No residual yet (the pass starts here): a zero residual, as ``x + 0`` normed is ``x`` normed."""
        a = hidden.shape[0]
        self.hidden[:a].copy_(hidden)
        if residual is None:
            self.residual[:a].zero_()
        else:
            self.residual[:a].copy_(residual)
        self._place(positions, slots)
        self.bounds.copy_(bounds)

    def front(self, cap: _Capacity, layer: int, active: int,
              stored: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """A check layer's front over the staged tokens: (q rotated, K before RoPE, V, residual) and
        the ``stored`` tokens' (K before RoPE, V) as written."""
        rows = half_rows(active)
        assert rows is not None
        self.halves[self._key(cap, "front", layer, rows)].replay()
        self.replays += 1
        written = tuple(w[:stored] for w in cap.inputs.written)
        return self.q[:active], self.k_raw[:active], self.v[:active], self.residual[:active], written

    def back(self, cap: _Capacity, layer: int, q: torch.Tensor, residual: torch.Tensor, kept: torch.Tensor,
             positions: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A check layer's back for the ``kept`` rows of its front's q and residual: (hidden, residual),
        left staged for the next layer's graph."""
        a = kept.shape[0]
        rows = half_rows(a)
        assert rows is not None
        torch.index_select(q, 0, kept, out=self.q_kept[:a])
        torch.index_select(residual, 0, kept, out=self.residual_kept[:a])
        self._place(positions, slots)
        self.bounds.copy_(bounds)
        self.halves[self._key(cap, "back", layer, rows)].replay()
        self.replays += 1
        return self.hidden[:a], self.residual[:a]

    def replay(self, cap: _Capacity, layer: int) -> None:
        cap.graphs[layer].replay()
        self.replays += 1

    def output(self, active: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of the real rows after the last replayed layer."""
        return self.hidden[:active], self.residual[:active]

    def _place(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The active tokens' positions and slots, every row past them inert: halves and steady
        layers round rows up differently, and a graph may read any of them."""
        a = positions.shape[0]
        self.positions[:a].copy_(positions)
        self.positions[a:].zero_()  # any valid RoPE row; these queries attend to nothing
        self.slots[:a].copy_(slots)
        self.slots[a:].fill_(-1)

    @staticmethod
    def _key(cap: _Capacity, half: str, layer: int, rows: int) -> tuple[str, int, int, int]:
        return half, layer, rows, cap.stored if half == "front" else 0  # a back reads no stored KV

    def _step(self, layer: int, cap: _Capacity) -> None:
        """One steady layer over the static buffers; its outputs overwrite its inputs."""
        rows = cap.rows
        q, _, _, residual, _ = self._front_call(layer, rows, cap)
        self._back_call(layer, rows, q, residual)

    def _front(self, layer: int, rows: int, cap: _Capacity) -> None:
        """A check layer's front over the static buffers, into ``q``, ``k_raw``, ``v``, ``residual``
        and the stored KV as written."""
        q, k_raw, v, residual, written = self._front_call(layer, rows, cap)
        self.q[:rows].copy_(q)
        self.k_raw[:rows].copy_(k_raw)
        self.v[:rows].copy_(v)
        self.residual[:rows].copy_(residual)
        for out, w in zip(cap.inputs.written, written, strict=True):
            out.copy_(w)

    def _back(self, layer: int, rows: int, cap: _Capacity) -> None:
        """A check layer's back over the kept rows, into ``hidden`` and ``residual``."""
        self._back_call(layer, rows, self.q_kept[:rows], self.residual_kept[:rows])

    def _front_call(self, layer: int, rows: int, cap: _Capacity) -> tuple[torch.Tensor, ...]:
        block, slot = self.model.model, layer % RING_SLOTS
        inputs = cap.inputs
        stored = (inputs.ring[0][slot], inputs.ring[1][slot], inputs.at, inputs.slots)
        shift = ShiftIndex(self.share, self.shift_rows[:rows], self.shift_segment[:rows], inputs.segment,
                           inputs.spare + 1)
        q, k_raw, v, residual, written = front(block.layers[layer], self.kv_caches[layer], block.rotary, stored,
                                               self.hidden[:rows], self.residual[:rows], self.positions[:rows],
                                               self.slots[:rows], shift)
        assert written is not None
        return q, k_raw, v, residual, written

    def _back_call(self, layer: int, rows: int, q: torch.Tensor, residual: torch.Tensor) -> None:
        # seq_len and the sequence's slots are read by the torch attention only; Triton reads bounds
        hidden, residual = back(self.model.model.layers[layer], self.kv_caches[layer], q, residual,
                                self.positions[:rows], self.table, 0, self.slots, self.bounds, None)
        self.hidden[:rows].copy_(hidden)
        self.residual[:rows].copy_(residual)

    def _make_inert(self, cap: _Capacity) -> None:
        """Inputs that write and attend to nothing, for the capture runs."""
        self.slots.fill_(-1)
        self.bounds.zero_()
        cap.inputs.slots.fill_(-1)
        self.set_shift(cap, None)
