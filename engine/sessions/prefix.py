"""A session turn on CUDA as a cached-prefix prefill: the history is written into the sequence's
cache pages and only the new tokens run through the model, from the prefill CUDA graphs where they
fit (a 256-token turn of a 7B model then costs its GPU time, ~11 ms on an H100, instead of its ~500
launches from Python, ~25-35 ms).

The history is staged (``SessionSource.stage``): each layer's copy is queued on a side stream
``STAGE_AHEAD`` layers before the forward reaches it (the host queues them between the layers'
launches, far ahead of the device, so the copy engine still streams them back to back), or some of
the first layers were copied earlier (the read buffer, filled while the previous job ran). It is
written layer by layer, as the forward's ``before_layer``: a write stream waits *on the device* for
layer i's copy, re-rotates it and writes it into the pages; the compute stream waits for that write,
then replays layer i's graph. Later layers' copies and writes run meanwhile (AttentionStore's
layer-wise pre-loading), and the compute stream runs nothing but the graphs back to back. A history
already all on the GPU is written the same way: its writes then run ahead of the compute, beside it
(at 28K tokens writing all layers at once before the forward cost ~8 ms of index copies and
rotations on the critical path).

No loader threads and no host waits. Stalls are measured exactly with timed events: before layer i
the compute stream records ``ready_i``; it stalls for ``done_i - ready_i`` when the copy of layer i
ends later (``done_i``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kv_cache import KVCache
from ..layers import RotaryEmbedding
from .source import SessionSource

STAGE_AHEAD = 3  # layers whose copies are queued before the forward's first launch, and kept queued ahead of it


class HistoryWriter:
    """Writes the staged history (re-rotated to positions 0..n-1) into a sequence's cache pages, one
    layer per call (``writer(i)`` before layer i runs), on ``stream`` (the engine's, kept across
    turns: a fresh stream each turn made its first write's allocation a ``cudaMalloc``).

    Each layer is one launch (``write_history_triton``: rotation, slots and both writes), since the
    host loop around it also launches the layers' graphs and must stay ahead of the device: with a
    rotation and a write launched apart (and the slots and positions built before layer 0) the loop
    took ~0.26 ms a layer, as long as a layer of a 256-token turn on an H100."""

    def __init__(
        self, source: SessionSource, cache: KVCache, block_table: list[int], rotary: RotaryEmbedding,
        stream: torch.cuda.Stream, stage: Callable[[int], None] | None = None,
    ) -> None:
        """``stage(n)``: make sure the copies of the history's first ``n`` layers are queued."""
        from ragfuse.kernels.history_triton import write_history_triton  # CUDA only: Triton is there

        self._write = write_history_triton
        device = cache.storage.device
        self.table = torch.tensor(block_table, dtype=torch.int32, device=device)
        self.source = source
        self.cache = cache
        self.cos, self.sin = rotary.cos, rotary.sin
        self.stream = stream
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the pages and their table are ready
        self._marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stage = stage

    def __call__(self, layer: int) -> None:
        if self._stage is not None:
            self._stage(layer + STAGE_AHEAD)
        compute = torch.cuda.current_stream(self.table.device)
        ready = torch.cuda.Event(enable_timing=True)
        ready.record(compute)
        written = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            kv, rows, done = self.source.staged_layer(layer)  # this stream waits for the copy
            kc, vc = self.cache.layers[layer]
            self._write(kv, self.source.num_tokens, self.cos, self.sin, kc, vc, self.table, rows)
            written.record(self.stream)
        compute.wait_event(written)
        self._marks.append((ready, done))

    def timings(self) -> tuple[float, float]:
        """(seconds the copies took from staging to the last layer, seconds compute stalled on them);
        call after the device has finished."""
        if not self._marks or self.source.stage_start is None:
            return 0.0, 0.0
        load = self.source.stage_start.elapsed_time(self._marks[-1][1]) / 1e3
        stall = sum(max(0.0, ready.elapsed_time(done)) for ready, done in self._marks) / 1e3
        return load, stall
