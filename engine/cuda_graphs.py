"""CUDA graphs for decode: one captured forward per padded batch size, replayed every step.

A decode step of a 7B model is ~500 kernel launches of a few microseconds of work each; launched
from Python they cost more than the GPU work at small batches. A graph replays them all in one
launch. Graphs fix every tensor address, so the step's inputs are copied into static buffers first,
and a batch is padded up to the next captured size: padding rows get ``seq_len = 0`` (attend to
nothing) and ``slot = -1`` (write nothing), so they cannot touch real sequences' cache.

Only the Triton attention backend may be captured: the torch reference reads lengths back to the
host inside the forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionMetadata

GRAPHS_ENV = "RAGFUSE_CUDA_GRAPHS"  # "0" turns decode graphs off
EAGER_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured when the cache is allocated
MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly


def graphs_enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "1") != "0"


def padded_size(n: int) -> int:
    """The captured size a batch of ``n`` runs as: powers of two to 16, then multiples of 16."""
    if n <= 16:
        return 1 << max(0, (n - 1).bit_length())
    return -(-n // 16) * 16


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output buffer [size, hidden]


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``kv_caches``, keyed by padded batch size.

    Graphs share one memory pool, so a graph's output is only valid until the next replay: callers
    use it (here: the runner's logits) before the next step.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        n = MAX_GRAPH_BATCH
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}
        self.replays = 0  # steps served by a graph (for tests and metrics)

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether this step can replay a graph: plain decode only (two-phase decode over shared
        blocks runs eagerly: its launch grid follows the tree), within the captured sizes."""
        return (
            not meta.is_prefill
            and meta.two_phase is None
            and meta.num_seqs <= MAX_GRAPH_BATCH
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def capture(self, sizes: tuple[int, ...] = EAGER_SIZES) -> None:
        """Capture the given batch sizes now (largest first, so smaller ones reuse its pool memory)."""
        for size in sorted(sizes, reverse=True):
            if size <= MAX_GRAPH_BATCH and size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode step of ``n`` sequences, by graph replay."""
        n = input_ids.shape[0]
        size = padded_size(n)
        captured = self.graphs.get(size)
        if captured is None:
            captured = self.graphs[size] = self._capture(size)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:  # rows left by a larger earlier batch: make them inert again
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:n]

    @torch.inference_mode()
    def _capture(self, size: int) -> _Captured:
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # split counts must hold for any length a replay sees
            block_size=self.block_size,
        )
        self.slot_mapping[:size].fill_(-1)  # the warm-up and capture runs touch no cache slot
        self.seq_lens[:size].zero_()
        args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        # Warm up outside the graph on a side stream: compiles the Triton kernels and lets cuBLAS
        # pick its algorithms, none of which may happen during capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*args)
        return _Captured(graph, hidden)
