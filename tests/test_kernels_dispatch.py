"""Kernel-backend choice, decode-graph batch padding and the attention metadata (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragfuse.engine.attention import AttentionMetadata
from ragfuse.engine.cuda_graphs import decode_step_fields, pack_decode_step, pack_relay_tiles, padded_size
from ragfuse.engine.ops import resolve_backend
from ragfuse.engine.staged_inputs import StagedInputs
from ragfuse.kernels.relay import system_tiles


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGFUSE_KERNELS", raising=False)
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve_backend("cutlass", cpu)
    monkeypatch.setenv("RAGFUSE_KERNELS", "torch")
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    monkeypatch.setenv("RAGFUSE_KERNELS", "fast")
    with pytest.raises(ValueError, match="RAGFUSE_KERNELS"):
        resolve_backend("auto", cpu)


@pytest.mark.gpu
def test_auto_backend_is_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGFUSE_KERNELS", raising=False)
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


def test_padded_sizes() -> None:
    assert [padded_size(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 64, 80]


def test_metadata_build_matches_per_token_definition() -> None:
    """Slots, offsets and flags of a mixed batch: chunked prefill with a prefix, fresh prompt, decode."""
    bs = 4
    query_lens, seq_lens = [5, 3, 1], [9, 3, 6]
    tables = [[7, 2, 9], [4], [0, 5]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, torch.device("cpu"))
    want = [
        table[p // bs] * bs + p % bs
        for q, n, table in zip(query_lens, seq_lens, tables)
        for p in range(n - q, n)
    ]
    assert meta.slot_mapping.tolist() == want
    assert meta.cu_seqlens_q.tolist() == [0, 5, 8, 9]
    assert meta.block_tables.tolist() == [[7, 2, 9], [4, 0, 0], [0, 5, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.cu_seqlens_q.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert (meta.is_prefill, meta.has_prefix, meta.max_query_len, meta.max_seq_len) == (True, True, 5, 9)
    fresh = AttentionMetadata.build([3, 2], [3, 2], [[1], [2]], bs, torch.device("cpu"))
    assert not fresh.has_prefix
    decode = AttentionMetadata.build([1, 1], [6, 2], [[0, 5], [3]], bs, torch.device("cpu"))
    assert not decode.is_prefill and decode.slot_mapping.tolist() == [21, 13]


def test_host_packed_decode_step_matches_metadata() -> None:
    """The host twins of a decode step's inputs (``DecodeGraphs.run_host``) hold what
    ``AttentionMetadata.build`` computes for it, after a larger batch left its rows behind; padding
    rows are inert, and sending up to the step's table rows leaves the rows past them as they were."""
    bs, rows, width = 4, 8, 5
    staged = StagedInputs(decode_step_fields(rows, width), torch.device("cpu"))
    pack_decode_step(staged.host(), bs, 8, list(range(6)), list(range(6)), [2] * 6, [[1, 2, 3]] * 6)
    staged.send()
    seq_lens, tables = [6, 2, 13], [[0, 5], [3], [7, 1, 4, 6]]
    pack_decode_step(staged.host(), bs, padded_size(3), [11, 12, 13], [5, 1, 12], seq_lens, tables)
    staged.host()["block_tables"][3:] = -7  # not sent: past the step's rows
    staged.send(upto=("block_tables", 3))
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, tables, bs, torch.device("cpu"))
    longs, lens, table_rows = (staged.device[k] for k in ("longs", "seq_lens", "block_tables"))
    assert longs[0, :3].tolist() == [11, 12, 13] and longs[1, :3].tolist() == [5, 1, 12]
    assert longs[2, :4].tolist() == meta.slot_mapping.tolist() + [-1] == [21, 13, 24, -1]
    assert lens[:4].tolist() == meta.seq_lens.tolist() + [0]
    for i, table in enumerate(tables):
        assert table_rows[i, : len(table)].tolist() == meta.block_tables[i, : len(table)].tolist()
    assert table_rows[3:6, :3].tolist() == [[1, 2, 3]] * 3 and not bool((table_rows == -7).any())


def test_host_packed_relay_tiles_match_system_tiles() -> None:
    """The host twin of a relay decode step's static tiles (``DecodeGraphs.run_host``) holds the
    tiles ``system_tiles`` cuts for the step, and a larger earlier step's tiles are emptied."""
    most, per_tile = 6, 4
    packed = np.zeros(most * (1 + per_tile), dtype=np.int32)
    pack_relay_tiles(packed, most, per_tile, [0] * 9 + [1] * 5)  # 5 tiles
    step = [1, -1, 0, 1, 0, 0, -1]
    pack_relay_tiles(packed, most, per_tile, step)
    tokens, systems = system_tiles(step, per_tile)
    assert systems == [1, -1, 0] and packed[:most].tolist() == systems + [-1] * 3
    assert packed[most:].tolist() == tokens + [-1] * (most - 3) * per_tile
    assert sorted(t for t in tokens if t >= 0) == list(range(len(step)))


def test_graph_tiles_take_a_step_and_empty_the_rest() -> None:
    """A graph's static relay tiles get the step's tiles (``load_tiles``, decode and prefill graphs) and
    every tile after them is emptied, also where a larger earlier step had filled it."""
    from ragfuse.engine.attention import RelayMetadata
    from ragfuse.engine.cuda_graphs import load_tiles

    def meta(token_system: list[int], most: int = 0) -> RelayMetadata:
        tokens, systems = system_tiles(token_system, 4, most)
        return RelayMetadata(token_system, torch.tensor(tokens, dtype=torch.int32),
                             torch.tensor(systems, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), 0)

    static = meta([], most=5)
    load_tiles(static, meta([0] * 9 + [1] * 6))  # 5 tiles
    load_tiles(static, meta([1, 0, 0, 1, 0]))
    tokens, systems = system_tiles([1, 0, 0, 1, 0], 4)
    assert static.tile_system.tolist() == systems + [-1] * 3
    assert static.tile_tokens.tolist() == tokens + [-1] * 12


def test_relay_system_shares_fewer_where_contexts_may_be_long() -> None:
    """Relay decode's system shares aim at one program per multiprocessor where every own context is
    short (the system part is the longer one), at half that where contexts may be long (the decode
    graphs, sized for any length): never more shares for the longer contexts."""
    from ragfuse.kernels.relay_triton import RELAY_SHORT_CONTEXT, relay_system_programs_per_sm, system_num_splits

    cpu = torch.device("cpu")  # the interpreter counts 4 multiprocessors
    short, long = relay_system_programs_per_sm(128), relay_system_programs_per_sm(4096)
    assert short == relay_system_programs_per_sm(RELAY_SHORT_CONTEXT) == 1.0
    assert long == relay_system_programs_per_sm(RELAY_SHORT_CONTEXT + 1) == 0.5
    assert system_num_splits(1, 1, 2048, cpu, short) == 4
    assert system_num_splits(1, 1, 2048, cpu, long) == 2
    for tiles in (1, 2, 4, 8):
        assert system_num_splits(tiles, 1, 2048, cpu, long) <= system_num_splits(tiles, 1, 2048, cpu, short)


def test_relay_context_splits_cut_ragged_contexts() -> None:
    """Relay decode splits each sequence's own keys at least 3 ways where its contexts may span
    3 key tiles (one long context would set the launch's time), more where the per-SM rule wants
    more, and never into more shares than the bound has tiles; host ints only (graphs)."""
    from ragfuse.kernels.paged_attention_triton import decode_num_splits
    from ragfuse.kernels.relay_triton import RELAY_MIN_CONTEXT_SPLITS, RELAY_PROGRAMS_PER_SM, relay_context_splits

    cpu = torch.device("cpu")  # the interpreter counts 4 multiprocessors
    assert RELAY_MIN_CONTEXT_SPLITS == 3
    assert relay_context_splits(64, 8, 2700, cpu) == 3 > decode_num_splits(64, 8, 2700, cpu, RELAY_PROGRAMS_PER_SM)
    assert relay_context_splits(1, 1, 4096, cpu) == decode_num_splits(1, 1, 4096, cpu, RELAY_PROGRAMS_PER_SM) == 4
    assert relay_context_splits(64, 8, 100, cpu) == 2  # 100 keys: two tiles of 64
    assert relay_context_splits(64, 8, 40, cpu) == 1
