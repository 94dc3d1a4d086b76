"""CUDA graphs of the fused prefill's layers past its last check layer.

From there on every layer runs the same few hundred active tokens (the selected ones and the
query): ~20 launches of GPU work a layer, and ~0.5 ms of it on an H100 for a 7B model, while
launching them from Python costs about twice that (measured: ``reuse``, 32 tokens a layer, took
45 ms for 10 ms of loading). Each layer is captured once per (active, stored) capacity and replayed
with one launch, between the loader's per-layer waits for its stored KV.

Graphs fix every address, so a pass copies its inputs into static buffers first: the active
tokens' hidden state, positions and slots (padded to the captured size), the stored tokens'
positions and slots (padded likewise), the block table and ``bounds = [0, active, prompt length]``,
which the Triton attention kernel reads on the device. Padding is inert as in ``cuda_graphs``: a
slot of -1 writes nothing, query rows past ``bounds[1]`` attend to nothing, every other op is
row-wise. The stored KV itself arrives in a ring of device buffers that belongs to the capacity,
which the loader fills (``LayerPrefetcher(ring=...)``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..cuda_graphs import PREFILL_BUCKETS, capture_call, prefill_bucket
from .layer_step import KVCache, back, front
from .prefetch import RING_SLOTS
from .stale_shift import ShiftIndex

STORED_STEP = 512  # stored-token capacities are multiples of this: few captures, little padding


def capacity(active: int, stored: int) -> tuple[int, int] | None:
    """(active rows, stored rows) of the graphs a pass with these counts replays, or None when its
    active set is large enough to be matmul-bound (launched eagerly, launching hidden behind it)."""
    rows = prefill_bucket(active)
    if rows is None or stored < 1:
        return None
    return rows, -(-stored // STORED_STEP) * STORED_STEP


class _Capacity:
    """The static stored-KV inputs and per-layer graphs of one (active, stored) capacity."""

    def __init__(self, rows: int, stored: int, kv_cache: KVCache, device: torch.device) -> None:
        self.rows = rows
        _, block_size, kv_heads, head_dim = kv_cache[0].shape
        shape = (RING_SLOTS, stored, kv_heads, head_dim)
        self.ring = (torch.zeros(shape, dtype=kv_cache[0].dtype, device=device),
                     torch.zeros(shape, dtype=kv_cache[0].dtype, device=device))
        self.stored_at = torch.zeros(stored, dtype=torch.long, device=device)
        self.stored_slots = torch.full((stored,), -1, dtype=torch.long, device=device)
        self.spare = stored  # the stale shift's segment for rows without stored KV: one past any real one
        self.stored_segment = torch.full((stored,), stored, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by layer


class FusionGraphs:
    """Per-layer graphs of the fused prefill's steady layers, keyed by ``capacity``."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, max_model_len: int,
                 device: torch.device, pool: tuple) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.pool = pool
        self.max_blocks = -(-max_model_len // block_size)
        rows, hidden = PREFILL_BUCKETS[-1], model.config.hidden_size
        dtype = model.lm_head.weight.dtype
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.table = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=device)
        self.bounds = torch.zeros(3, dtype=torch.int32, device=device)
        # the stale shift's inputs (``stale_shift``); a share of 0 (a pass without it) shifts nothing
        self.share = torch.zeros((), device=device)
        self.shift_rows = torch.zeros(rows, dtype=torch.long, device=device)
        self.shift_segment = torch.zeros(rows, dtype=torch.long, device=device)
        self.capacities: dict[tuple[int, int], _Capacity] = {}
        self.replays = 0  # layers served by a graph (for tests and the profile)

    def accepts(self, active: int, stored: int, num_blocks: int) -> bool:
        return capacity(active, stored) is not None and num_blocks <= self.max_blocks

    def prepare(self, active: int, stored: int, layers: range) -> _Capacity:
        """The capacity for these counts with ``layers`` captured (capturing what is missing now,
        before any input is loaded: the capture runs are inert)."""
        key = capacity(active, stored)
        assert key is not None, "accepts() first"
        cap = self.capacities.get(key)
        if cap is None:
            cap = self.capacities[key] = _Capacity(*key, self.kv_caches[0], self.device)
        missing = [li for li in layers if li not in cap.graphs]
        if missing:
            self._make_inert(cap)
            for li in missing:
                cap.graphs[li], _ = capture_call(self._step, (li, cap), self.pool)
        return cap

    def load(self, cap: _Capacity, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
             slots: torch.Tensor, stored_at: torch.Tensor, stored_slots: torch.Tensor, table: torch.Tensor,
             bounds: torch.Tensor, shift: ShiftIndex | None) -> None:
        """Copy a pass's state at its first steady layer into the static inputs, padding made inert.
        No residual yet (the pass starts here): a zero residual, as ``x + 0`` normed is ``x`` normed."""
        a, s, rows = hidden.shape[0], stored_at.shape[0], cap.rows
        self.hidden[:a].copy_(hidden)
        if residual is None:
            self.residual[:a].zero_()
        else:
            self.residual[:a].copy_(residual)
        self.positions[:a].copy_(positions)
        self.positions[a:rows].zero_()  # any valid RoPE row; these queries attend to nothing
        self.slots[:a].copy_(slots)
        self.slots[a:rows].fill_(-1)
        cap.stored_at[:s].copy_(stored_at)
        cap.stored_at[s:].zero_()
        cap.stored_slots[:s].copy_(stored_slots)
        cap.stored_slots[s:].fill_(-1)
        self.table[:, : table.shape[1]].copy_(table)
        self.bounds.copy_(bounds)
        self.shift_rows[:rows].zero_()
        self.shift_segment[:rows].fill_(cap.spare)
        cap.stored_segment.fill_(cap.spare)
        if shift is None:
            self.share.zero_()
            return
        self.share.copy_(shift.share)
        self.shift_rows[:a].copy_(shift.active_rows)
        seg = shift.active_segment
        self.shift_segment[:a].copy_(seg.masked_fill(seg == shift.num_segments - 1, cap.spare))
        cap.stored_segment[:s].copy_(shift.stored_segment)

    def replay(self, cap: _Capacity, layer: int) -> None:
        cap.graphs[layer].replay()
        self.replays += 1

    def output(self, active: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of the real rows after the last replayed layer."""
        return self.hidden[:active], self.residual[:active]

    def _step(self, layer: int, cap: _Capacity) -> None:
        """One steady layer over the static buffers; its outputs overwrite its inputs."""
        rows, block = cap.rows, self.model.model
        mod, kv = block.layers[layer], self.kv_caches[layer]
        slot = layer % RING_SLOTS
        stored = (cap.ring[0][slot], cap.ring[1][slot], cap.stored_at, cap.stored_slots)
        positions = self.positions[:rows]
        shift = ShiftIndex(self.share, self.shift_rows[:rows], self.shift_segment[:rows], cap.stored_segment,
                           cap.spare + 1)
        q, _, _, residual, _ = front(mod, kv, block.rotary, stored, self.hidden[:rows], self.residual[:rows],
                                     positions, self.slots[:rows], shift)
        # seq_len and the sequence's slots are read by the torch attention only; Triton reads bounds
        hidden, residual = back(mod, kv, q, residual, positions, self.table, 0, self.slots, self.bounds, None)
        self.hidden[:rows].copy_(hidden)
        self.residual[:rows].copy_(residual)

    def _make_inert(self, cap: _Capacity) -> None:
        """Inputs that write and attend to nothing, for the capture runs."""
        self.slots.fill_(-1)
        self.bounds.zero_()
        cap.stored_slots.fill_(-1)
        self.share.zero_()
        self.shift_rows.zero_()
        self.shift_segment.fill_(cap.spare)
        cap.stored_segment.fill_(cap.spare)
