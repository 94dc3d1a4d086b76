"""CUDA graphs: captured forwards for decode batches and for short one-sequence prefills.

A decode step of a 7B model is ~500 kernel launches of a few microseconds of work each; launched
from Python they cost more than the GPU work at small batches. A graph replays them all in one
launch. Graphs fix every tensor address, so the step's inputs are copied into static buffers first,
and a batch is padded up to the next captured size: padding rows get ``seq_len = 0`` (attend to
nothing) and ``slot = -1`` (write nothing), so they cannot touch real sequences' cache.

The same holds for a prefill of a few hundred tokens: its ~500 launches take longer from Python
than its matmuls take on the GPU (a 512-token prefill of a 7B model: ~35 ms of launching for
~12 ms of work on an H100). ``PrefillGraphs`` captures one sequence's prefill per token bucket.

Only the Triton attention backend may be captured: the torch reference reads lengths back to the
host inside the forward.

A decode batch behind registered system prompts (relay attention) replays its own graph per size,
whose static inputs also hold the batch's system tiles (padded with empty tiles: they read and write
nothing); the system prompts' block tables are the registry's fixed device tensors.

A decode batch whose sequences share prefix-tree blocks (two-phase attention) replays a graph per
size and plan capacity (item rows, partial slots: ``plan_capacity``), with or without relay. Its
plan lives in fixed device buffers padded with inert rows; the tree's current plan is copied there
only when it changes (a new batch or new sharing), not at every step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ragfuse.kernels.relay import max_system_tiles, system_tiles
from ragfuse.kernels.two_phase import TwoPhasePlan

from . import gemm_library
from .attention import AttentionMetadata, RelayMetadata
from .staged_inputs import StagedInputs

GRAPHS_ENV = "RAGFUSE_CUDA_GRAPHS"  # "0" turns decode graphs off
# captured when the cache is allocated; 48 too, or a batch shrinking from 64 to 48 (requests finishing)
# captures in the middle of serving
EAGER_SIZES = (1, 2, 4, 8, 16, 32, 48, 64)
MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly
GRAPH_SYSTEMS = 4  # distinct system prompts (counting "none") a relay graph's tiles have room for
# Prefill token buckets, captured on first use. Longer prefills are matmul-bound (launching is
# hidden behind the GPU work) and may take the cuDNN attention path, which takes no lengths. Steps of
# 32 up to 512: a new chat turn is often just past a power of two (a 256-token message after the
# previous answer's last token is 257 tokens); padded to 512 its matmuls would double, to 320 they
# cost 1.5 ms more than at 256 on an H100 (Mistral-7B shape). And 272: cuBLAS's tiles for 288 rows
# are slower than for 320; a layer's matmuls took 0.2094 ms at 256 rows, 0.2309 at 257 (unpadded),
# 0.2326 at 272, 0.2584 at 288 and 0.2456 at 320 (H100, kernels/NOTES.md).
PREFILL_BUCKETS = (*range(64, 257, 32), 272, *range(288, 513, 32), 768, 1024)
# Two-phase plan capacities of a tree graph: the smallest that holds the plan is used. Item rows past
# the plan's cost one early-exiting program each; partial slots size a float32 buffer per layer.
PLAN_ITEMS = (16, 32, 64, 128, 256)
PLAN_PARTS = (4, 16, 64)


def graphs_enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "1") != "0"


def plan_capacity(plan: TwoPhasePlan) -> tuple[int, int] | None:
    """(item rows, partial slots) of the tree graph a plan replays in, or None when none is big enough."""
    items = next((c for c in PLAN_ITEMS if c >= plan.num_items), None)
    parts = next((c for c in PLAN_PARTS if c >= plan.max_parts), None)
    return None if items is None or parts is None else (items, parts)


def padded_size(n: int) -> int:
    """The captured size a batch of ``n`` runs as: powers of two to 16, then multiples of 16."""
    if n <= 16:
        return 1 << max(0, (n - 1).bit_length())
    return -(-n // 16) * 16


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output buffer [size, hidden]
    logits: torch.Tensor | None = None  # decode graphs: float32 [size, vocab]
    greedy: torch.Tensor | None = None  # decode graphs: each row's argmax [size]


@torch.inference_mode()
def capture_call(fn: Callable[..., Any], args: tuple, pool: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn(*args)`` into a graph drawing on ``pool``; returns the graph and the output.

    The first run happens outside the graph on a side stream: it compiles the Triton kernels, lets
    cuBLAS pick its algorithms and ``gemm_library`` its library for each product's sizes, none of
    which may happen during capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), gemm_library.measuring():
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


def capture_forward(model: nn.Module, args: tuple, pool: tuple) -> _Captured:
    """Capture the whole forward ``model(*args)``."""
    return _Captured(*capture_call(model, args, pool))


def _decode_forward(model: nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's forward, output head and argmax: (hidden, float32 logits, greedy tokens). Every
    row of a decode batch is a sequence's last token, so every row gets logits."""
    hidden = model(*args)
    logits = model.compute_logits(hidden)
    return hidden, logits, logits.argmax(dim=-1)


def capture_decode(model: nn.Module, args: tuple, pool: tuple) -> _Captured:
    """Capture a decode step through its output head and argmax: at batch 1 the launches of the head,
    the cast and the argmax, and the host work between them, cost as much as a few layers."""
    graph, (hidden, logits, greedy) = capture_call(_decode_forward, (model, *args), pool)
    return _Captured(graph, hidden, logits, greedy)


def decode_step_fields(rows: int, max_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``DecodeGraphs``' static inputs for up to ``rows`` sequences of up to ``max_blocks`` cache
    blocks, as ``StagedInputs`` fields: ids, positions and cache slots (one int64 tensor), lengths,
    then the block tables last, so that a step sends only the table rows it uses."""
    return {"longs": ((3, rows), torch.int64), "seq_lens": ((rows,), torch.int32),
            "block_tables": ((rows, max_blocks), torch.int32)}


def pack_decode_step(
    host: dict[str, np.ndarray], block_size: int, size: int,
    ids: list[int], positions: list[int], seq_lens: list[int], tables: list[list[int]],
) -> None:
    """Write a plain decode step of ``n = len(ids)`` sequences, run as a graph of ``size`` rows, into
    the host twins of ``DecodeGraphs``' inputs (``decode_step_fields``). Rows ``n..size`` are made
    inert (slot -1, length 0); the table rows past ``n`` are neither written nor sent."""
    n, longs, lens, rows = len(ids), host["longs"], host["seq_lens"], host["block_tables"]
    longs[0, :n] = ids
    longs[1, :n] = positions
    # the new token is the sequence's seq_len-th own token: its slot is in the block holding index seq_len-1
    longs[2, :n] = [t[(m - 1) // block_size] * block_size + (m - 1) % block_size for t, m in zip(tables, seq_lens)]
    longs[2, n:size] = -1
    lens[:n] = seq_lens
    lens[n:size] = 0
    for i, table in enumerate(tables):
        rows[i, : len(table)] = table


def pack_relay_tiles(packed: np.ndarray, most: int, tokens_per_tile: int, token_system: list[int]) -> None:
    """Write a relay decode step's system tiles (``kernels.relay.system_tiles`` of each row's system
    prompt, -1 for none) into the host image of ``DecodeGraphs``' static relay inputs: ``packed`` =
    tile systems [most] | tile tokens [most * tokens_per_tile]; every tile past the step's is empty,
    so the graph's padding tiles read and write nothing."""
    tokens, systems = system_tiles(token_system, tokens_per_tile)
    packed.fill(-1)
    packed[: len(systems)] = systems
    packed[most : most + len(tokens)] = tokens


def load_tiles(static: RelayMetadata, relay: RelayMetadata) -> None:
    """Copy a step's system tiles into a graph's static relay inputs; the tiles past them stay empty
    (-1), so the graph's spare tiles read and write nothing."""
    static.tile_system.fill_(-1)
    static.tile_system[: relay.tile_system.shape[0]].copy_(relay.tile_system)
    static.tile_tokens.fill_(-1)
    static.tile_tokens[: relay.tile_tokens.shape[0]].copy_(relay.tile_tokens)


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
        # static inputs, sent by ``run_host`` from their page-locked host twins with one copy
        self.staged = StagedInputs(decode_step_fields(n, self.max_blocks), device)
        self.input_ids, self.positions, self.slot_mapping = self.staged.device["longs"].unbind(0)
        self.slot_mapping.fill_(-1)
        self.seq_lens, self.block_tables = self.staged.device["seq_lens"], self.staged.device["block_tables"]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}  # by padded size
        self.relay_graphs: dict[int, _Captured] = {}  # by padded size, for batches behind system prompts
        self.relay: RelayMetadata | None = None  # static relay inputs, made at the first relay batch
        self._relay_staged: StagedInputs | None = None  # self.relay's tiles are views of its one field
        # two-phase decode: graphs by (size, item rows, partial slots, relay), over one set of plan buffers
        self.tree_graphs: dict[tuple[int, int, int, bool], _Captured] = {}
        self.plan_items = torch.zeros(PLAN_ITEMS[-1], 5, dtype=torch.int32, device=device)
        self.plan_order = torch.zeros(n, dtype=torch.int32, device=device)
        self.plan_shared_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.plan_num_parts = torch.zeros(n, dtype=torch.int32, device=device)
        self._loaded: tuple[TwoPhasePlan, int, tuple[int, int]] | None = None  # plan in the buffers, for which graph
        self.replays = 0  # steps served by a graph (for tests and metrics)
        self.host_replays = 0  # of which sent from host values (run_host)
        self.tree_replays = 0  # of which two-phase

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether this step can replay a graph: a decode step within the captured sizes (and, over
        shared tree blocks, a two-phase plan within the largest capacity)."""
        fits = (
            not meta.is_prefill
            and meta.num_seqs <= MAX_GRAPH_BATCH
            and meta.block_tables.shape[1] <= self.max_blocks
            and (meta.two_phase is None or plan_capacity(meta.two_phase) is not None)
        )
        if not fits or meta.relay is None:
            return fits
        return meta.relay.tile_system.shape[0] <= self._tiles(padded_size(meta.num_seqs), meta.relay)

    def capture(self, sizes: tuple[int, ...] = EAGER_SIZES) -> None:
        """Capture the given batch sizes now (largest first, so smaller ones reuse its pool memory)."""
        for size in sorted(sizes, reverse=True):
            if size <= MAX_GRAPH_BATCH and size not in self.graphs:
                self.graphs[size] = self._capture(size, None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode step of ``n`` sequences, by graph replay."""
        return self._replay(input_ids, positions, meta).hidden[: input_ids.shape[0]]

    def run_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [n, vocab], greedy tokens [n]) of a decode step of ``n`` sequences, by one
        graph replay that includes the output head. Valid until the next replay."""
        n = input_ids.shape[0]
        captured = self._replay(input_ids, positions, meta)
        assert captured.logits is not None and captured.greedy is not None
        return captured.logits[:n], captured.greedy[:n]

    def takes_from_host(self, token_system: list[int]) -> bool:
        """Whether ``run_host`` can replay a decode step whose rows sit behind these system prompts
        (-1: none): always without relay; with relay once its static inputs exist and the step's
        distinct system prompts fit a graph's tiles."""
        if all(s < 0 for s in token_system):
            return True
        return self.relay is not None and len(set(token_system)) <= GRAPH_SYSTEMS

    def run_host(
        self, ids: list[int], positions: list[int], seq_lens: list[int], tables: list[list[int]],
        token_system: list[int] | None = None, gather_from: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``run_logits`` for a decode step without shared tree blocks, from host values: sequence
        i's token ``ids[i]`` at ``positions[i]`` is its ``seq_lens[i]``-th own token, cached through
        block table ``tables[i]``, behind system prompt ``token_system[i]`` (relay; -1 or no list:
        none; check ``takes_from_host`` first). Written into the page-locked twins of the static
        inputs (``StagedInputs``) and sent by one copy (two with relay), with no ``AttentionMetadata``
        built: with this and the head in the graph, the host's share of a batch-1 step on an H100 fell
        from 1.05 to 0.18 ms (kernels/NOTES.md). The caller reads the results before the next step:
        they live in the graph's buffers.

        ``gather_from``: the token ids are on the device, not yet known to the host (a step launched
        before its predecessor's tokens were read); ``ids`` are then row indices into it."""
        n, size = len(ids), padded_size(len(ids))
        relay = token_system is not None and any(s >= 0 for s in token_system)
        graphs = self.relay_graphs if relay else self.graphs
        captured = graphs.get(size)
        if captured is None:
            captured = graphs[size] = self._capture(size, self.relay if relay else None)
        pack_decode_step(self.staged.host(), self.block_size, size, ids, positions, seq_lens, tables)
        self.staged.send(upto=("block_tables", n))
        if gather_from is not None:
            self.input_ids[:n].copy_(gather_from.index_select(0, self.input_ids[:n]))
        if relay:
            assert self.relay is not None and self._relay_staged is not None and token_system is not None
            pack_relay_tiles(self._relay_staged.host()["tiles"], self.relay.tile_system.shape[0],
                             self._per_tile(self.relay), token_system)
            self._relay_staged.send()
        captured.graph.replay()
        self.replays += 1
        self.host_replays += 1
        assert captured.logits is not None and captured.greedy is not None
        return captured.logits[:n], captured.greedy[:n]

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> _Captured:
        n = input_ids.shape[0]
        size = padded_size(n)
        relay, plan = meta.relay, meta.two_phase
        if plan is not None:
            capacity = plan_capacity(plan)
            assert capacity is not None, "accepts() first"
            key = (size, *capacity, relay is not None)
            captured = self.tree_graphs.get(key)
            if captured is None:
                captured = self.tree_graphs[key] = self._capture(size, relay, capacity)
            if self._loaded is None or self._loaded[0] is not plan or self._loaded[1:] != (size, capacity):
                plan.load_into(self._padded_plan(size, capacity))  # device copies, once per plan
                self._loaded = (plan, size, capacity)
            self.tree_replays += 1
        else:
            graphs = self.graphs if relay is None else self.relay_graphs
            captured = graphs.get(size)
            if captured is None:
                captured = graphs[size] = self._capture(size, relay)
        if relay is not None:
            assert self.relay is not None
            load_tiles(self.relay, relay)
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
        return captured

    def capture_relay(self, tokens_per_tile: int, sys_tables: torch.Tensor, sys_lens: torch.Tensor,
                      sizes: tuple[int, ...] = EAGER_SIZES) -> None:
        """Capture the relay graphs of these sizes now (the engine does at the first registered
        system prompt, so no capture lands inside a serving step)."""
        self._make_static_relay(tokens_per_tile, sys_tables, sys_lens)
        for size in sorted(sizes, reverse=True):
            if size <= MAX_GRAPH_BATCH and size not in self.relay_graphs:
                self.relay_graphs[size] = self._capture(size, self.relay)

    def _tiles(self, size: int, relay: RelayMetadata) -> int:
        """System tiles a relay graph of ``size`` rows holds."""
        return max_system_tiles(size, self._per_tile(relay), GRAPH_SYSTEMS)

    @staticmethod
    def _per_tile(relay: RelayMetadata) -> int:
        return relay.tile_tokens.shape[0] // max(1, relay.tile_system.shape[0])

    def _make_static_relay(self, tokens_per_tile: int, sys_tables: torch.Tensor, sys_lens: torch.Tensor) -> None:
        if self.relay is not None:
            return
        most = max_system_tiles(MAX_GRAPH_BATCH, tokens_per_tile, GRAPH_SYSTEMS)
        # tile systems | tile tokens in one tensor, so run_host sends a step's tiles in one copy
        self._relay_staged = StagedInputs({"tiles": ((most * (1 + tokens_per_tile),), torch.int32)}, sys_lens.device)
        packed = self._relay_staged.device["tiles"]
        packed.fill_(-1)
        self.relay = RelayMetadata(
            token_system=[], tile_tokens=packed[most:], tile_system=packed[:most],
            sys_tables=sys_tables, sys_lens=sys_lens, max_sys_len=self.max_model_len,
        )

    def _static_relay(self, size: int, relay: RelayMetadata) -> RelayMetadata:
        """Views of the static relay inputs for a graph of ``size`` rows (created on first use)."""
        from ragfuse.kernels.relay_triton import relay_system_programs_per_sm, system_num_splits

        per_tile = self._per_tile(relay)
        self._make_static_relay(per_tile, relay.sys_tables, relay.sys_lens)
        assert self.relay is not None
        self.relay.tile_system.fill_(-1)  # the warm-up and capture runs read no system prompt
        tiles = self._tiles(size, relay)
        # splits sized for the tiles that hold tokens (the padding tiles only exit): a fixed host int
        busy = -(-size // per_tile)
        splits = system_num_splits(busy, self.kv_caches[0][0].shape[2], self.max_model_len, relay.sys_lens.device,
                                   relay_system_programs_per_sm(self.max_model_len))
        return RelayMetadata(
            token_system=[], tile_tokens=self.relay.tile_tokens[: tiles * per_tile],
            tile_system=self.relay.tile_system[:tiles], sys_tables=self.relay.sys_tables,
            sys_lens=self.relay.sys_lens, max_sys_len=self.max_model_len, num_splits=splits,
        )

    def _padded_plan(self, size: int, capacity: tuple[int, int]) -> TwoPhasePlan:
        """The plan a tree graph of ``size`` rows and ``capacity`` reads: views of the plan buffers."""
        items, parts = capacity
        return TwoPhasePlan.padded(size, self.plan_items[:items], self.plan_order[:size],
                                   self.plan_shared_lens[:size], self.plan_num_parts[:size], parts)

    def _capture(self, size: int, relay: RelayMetadata | None, capacity: tuple[int, int] | None = None) -> _Captured:
        two_phase = None
        if capacity is not None:  # the warm-up and capture runs share nothing: every plan row inert
            for buf in (self.plan_items, self.plan_shared_lens, self.plan_num_parts):
                buf.zero_()
            self._loaded = None
            two_phase = self._padded_plan(size, capacity)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # split counts must hold for any length a replay sees
            block_size=self.block_size,
            relay=None if relay is None else self._static_relay(size, relay),
            two_phase=two_phase,
        )
        self.slot_mapping[:size].fill_(-1)  # the warm-up and capture runs touch no cache slot
        self.seq_lens[:size].zero_()
        return capture_decode(self.model, (self.input_ids[:size], self.positions[:size], self.kv_caches, meta),
                              self.pool)


def captured_span(max_seq_len: int, max_model_len: int, split_span: int) -> int:
    """The key length a prefill graph for sequences of up to ``max_seq_len`` keys is captured with:
    the model's context once its attention may split the keys (``split_span``, keys at which a tile
    splits), else one less, so that graph's attention launches one split and no programs that only
    exit. Two graphs per bucket at most, both valid for every length they serve."""
    return max_model_len if max_seq_len >= split_span else min(max_model_len, split_span - 1)


def prefill_bucket(n: int) -> int | None:
    """The captured token count a prefill of ``n`` tokens runs as, or None when it runs eagerly."""
    return next((b for b in PREFILL_BUCKETS if b >= n), None)


class PrefillGraphs:
    """Captured prefills of one sequence (fresh, or continuing a cached prefix), keyed by token bucket.

    A prefill of ``n`` tokens replays the graph of the next bucket ``N >= n``. Only the first ``n``
    rows are real: the attention kernel reads the query count from ``cu_seqlens_q = [0, n]`` on the
    device, so rows ``n..N`` attend to nothing, and their ``slot = -1`` writes nothing. Every other op
    is row-wise, so whatever the padding rows hold never reaches a real row.

    A bucket may also be captured as one graph per layer (``run_layers``): the caller then gets the
    host between layers, to put work on the stream before layer i reads the cache (a session turn
    writes layer i of its stored history into the pages there, while later layers' history is still
    on its way from host memory). Each layer graph reads the previous one's output buffers.

    Graphs are keyed by (bucket, ``captured_span``): a turn after a short history and one after a
    long history (whose attention splits its keys) replay graphs of their own.
    """

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_model_len: int, device: torch.device, pool: tuple) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        n = PREFILL_BUCKETS[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(2, dtype=torch.int32, device=device)
        self.pool = pool
        from ragfuse.kernels.paged_attention_triton import prefill_split_span  # Triton: CUDA engines only

        self.split_span = prefill_split_span(device)
        self.graphs: dict[tuple[int, int, bool], _Captured] = {}  # by (bucket, key span, relay)
        self.layer_graphs: dict[tuple[int, int], list[_Captured]] = {}  # one graph per layer
        self.replays = 0
        self.relay_replays = 0  # of which behind a system prompt (for tests and metrics)
        self.layer_replays = 0  # forwards served by the per-layer graphs (for tests and metrics)
        self._held: list[torch.Tensor] = []
        self._relay: RelayMetadata | None = None  # static system tiles of the relay graphs (first relay prefill)

    def accepts(self, meta: AttentionMetadata, per_layer: bool = False) -> bool:
        """Whether a prefill replays a graph: one sequence, within the buckets; behind a system prompt
        (relay) only as a whole forward, the per-layer graphs hold no system part. A request's
        prefill behind a system prompt ran eagerly before: with requests arriving one by one (each
        prefilled alone), relay served Mistral-7B 16% slower than the prefix-shared path."""
        return (
            meta.is_prefill
            and (meta.relay is None or not per_layer)
            and meta.num_seqs == 1
            and prefill_bucket(meta.max_query_len) is not None
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of the sequence's ``n`` new tokens, by graph replay."""
        size, span = self._key(input_ids, meta)
        key = (size, span, meta.relay is not None)
        captured = self.graphs.get(key)
        if captured is None:  # before the inputs are loaded: capturing makes them inert
            static = self._meta(size, span, meta.relay)
            captured = self.graphs[key] = capture_forward(
                self.model, (self.input_ids[:size], self.positions[:size], self.kv_caches, static), self.pool
            )
        n = self._load_inputs(input_ids, positions, meta)
        if meta.relay is not None:
            assert self._relay is not None
            load_tiles(self._relay, meta.relay)
            self.relay_replays += 1
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:n]

    def run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        before_layer: Callable[[int], None],
    ) -> torch.Tensor:
        """As ``run``, one layer's graph at a time, calling ``before_layer(i)`` before layer i's replay."""
        key = self._key(input_ids, meta)
        layers = self.layer_graphs.get(key)
        if layers is None:
            layers = self.layer_graphs[key] = self._capture_layers(*key)
        n = self._load_inputs(input_ids, positions, meta)
        for i, captured in enumerate(layers):
            before_layer(i)
            captured.graph.replay()
        self.layer_replays += 1
        return captured.hidden[:n]

    @staticmethod
    def _bucket(input_ids: torch.Tensor) -> int:
        size = prefill_bucket(input_ids.shape[0])
        assert size is not None, "accepts() first"
        return size

    def _key(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[int, int]:
        return self._bucket(input_ids), captured_span(meta.max_seq_len, self.max_model_len, self.split_span)

    def _load_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy the step into the static inputs (rows past it made inert); returns its token count."""
        n = input_ids.shape[0]
        size = self._bucket(input_ids)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)  # a longer earlier prefill left real slots there
        self.block_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens.copy_(meta.seq_lens)
        self.cu_seqlens_q.copy_(meta.cu_seqlens_q)
        return n

    def _capture_layers(self, size: int, span: int) -> list[_Captured]:
        meta = self._meta(size, span)
        ids, pos = self.input_ids[:size], self.positions[:size]
        hidden = residual = None
        out: list[_Captured] = []
        for i in range(len(self.kv_caches)):
            graph, (hidden, residual) = capture_call(
                self.model.forward_layer, (i, ids, pos, self.kv_caches, meta, hidden, residual), self.pool
            )
            out.append(_Captured(graph, hidden))
            self._held.append(residual)  # every layer's outputs stay allocated: later captures must not reuse them
        return out

    def _static_relay(self, size: int, relay: RelayMetadata) -> RelayMetadata:
        """Views of the static system tiles for a graph of ``size`` rows behind one system prompt
        (``relay``: a step's, for the tile width and the registry's tables), all empty for the
        warm-up and capture runs; the system keys' split count is fixed for any system length."""
        from ragfuse.kernels.relay_triton import system_num_splits

        per_tile = relay.tile_tokens.shape[0] // relay.tile_system.shape[0]
        if self._relay is None:
            most = -(-PREFILL_BUCKETS[-1] // per_tile)
            packed = torch.full((most * (1 + per_tile),), -1, dtype=torch.int32, device=self.input_ids.device)
            self._relay = RelayMetadata(token_system=[], tile_tokens=packed[most:], tile_system=packed[:most],
                                        sys_tables=relay.sys_tables, sys_lens=relay.sys_lens,
                                        max_sys_len=self.max_model_len)
        static = self._relay
        assert static.tile_tokens.shape[0] == static.tile_system.shape[0] * per_tile, "one tile width per engine"
        static.tile_system.fill_(-1)
        tiles = -(-size // per_tile)
        splits = system_num_splits(tiles, self.kv_caches[0][0].shape[2], self.max_model_len, self.input_ids.device)
        return RelayMetadata(token_system=[], tile_tokens=static.tile_tokens[: tiles * per_tile],
                             tile_system=static.tile_system[:tiles], sys_tables=static.sys_tables,
                             sys_lens=static.sys_lens, max_sys_len=self.max_model_len, num_splits=splits)

    def _meta(self, size: int, span: int, relay: RelayMetadata | None = None) -> AttentionMetadata:
        """Static metadata of a bucket's graphs for sequences of up to ``span`` keys (made inert for the
        warm-up and capture runs); with ``relay``, behind a system prompt."""
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu_seqlens_q,
            max_query_len=size,  # sizes the grid; tiles past the real query count exit at once
            max_seq_len=span,  # sets the key splits, which must hold for every length the graph serves
            block_size=self.block_size,
            has_prefix=True,  # keeps the paged Triton kernel, which reads the lengths on the device
            relay=None if relay is None else self._static_relay(size, relay),
        )
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.cu_seqlens_q.zero_()
        return meta
