"""A session turn on CUDA as a cached-prefix prefill: the history is written into the sequence's
cache pages one layer at a time, just before that layer runs, and only the new tokens run through
the model. The writer is the forward's ``before_layer``: where a prefill graph fits, the new tokens'
forward is replayed one captured graph per layer, so a 256-token turn of a 7B model costs its GPU
time (~10 ms on an H100) instead of its ~500 launches from Python (~25-30 ms).

The history was staged (``SessionSource.stage``): every layer's copy is queued on a side stream at
once, so the copy engine streams them back to back while the compute stream runs the new tokens;
before layer i's attention the compute stream waits *on the device* for layer i's copy event. No
loader threads and no host waits: with the read buffer filled ahead (staged while the previous job
ran) the history costs nothing but the re-rotation and the cache write.

Stalls are measured exactly with timed events: before layer i the compute stream records ``ready_i``;
it stalls for ``done_i - ready_i`` when the copy of layer i ends later (``done_i``).
"""

from __future__ import annotations

import torch

from ragfuse.kernels.paged_attention import sequence_slots

from ..attention import write_kv
from ..layers import RotaryEmbedding
from .source import SessionSource


class HistoryWriter:
    """Called with i before layer i runs: writes layer i of the staged history (re-rotated to
    positions 0..n-1) into the cache pages, on the compute stream once that layer's copy is done."""

    def __init__(
        self, source: SessionSource, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_table: list[int],
        block_size: int, rotary: RotaryEmbedding,
    ) -> None:
        device = kv_layers[0][0].device
        table = torch.tensor(block_table, dtype=torch.int32, device=device)
        self.source = source
        self.kv_layers = kv_layers
        self.rotary = rotary
        self.slots = sequence_slots(table, source.num_tokens, block_size)
        self.positions = torch.arange(source.num_tokens, device=device)
        self._marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, layer: int) -> None:
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        k_st, v_st, done = self.source.layer_on_device(layer)
        kc, vc = self.kv_layers[layer]
        write_kv(self.rotary(k_st, self.positions), v_st, kc, vc, self.slots)
        self._marks.append((ready, done))

    def timings(self) -> tuple[float, float]:
        """(seconds the copies took from staging to the last layer, seconds compute stalled on them);
        call after the device has finished."""
        if not self._marks or self.source.stage_start is None:
            return 0.0, 0.0
        load = self.source.stage_start.elapsed_time(self._marks[-1][1]) / 1e3
        stall = sum(max(0.0, ready.elapsed_time(done)) for ready, done in self._marks) / 1e3
        return load, stall
