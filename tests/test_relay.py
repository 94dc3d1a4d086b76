"""RelayAttention kernels: the torch references equal standard attention over [system prompt + own
tokens] (float32, CPU), and the Triton kernels equal the references (interpreter on CPU; compiled on
CUDA in bf16/fp16/fp32 under the ``gpu`` mark)."""

from __future__ import annotations

import os

import pytest
import torch

from ragfuse.kernels.merge import merge_attention_ref
from ragfuse.kernels.paged_attention import (
    attention_with_lse,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    sequence_slots,
)
from ragfuse.kernels.relay import max_system_tiles, system_attention_ref, system_tiles, tile_tokens_for

SHAPES = [(4, 4, 32), (8, 2, 64), (6, 2, 16)]  # (heads, kv heads, head_dim): MHA, GQA 4, GQA 3 (padded group)
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class Batch:
    """A paged cache holding two system prompts in their own blocks and requests' own tokens in
    theirs (blocks in random order, spare blocks of random data), plus each request's system."""

    def __init__(self, sys_lens: list[int], own_lens: list[int], systems: list[int], q_lens: list[int],
                 heads: int, kvh: int, d: int, dtype: torch.dtype, device: torch.device, page: int = 8) -> None:
        need_sys = [-(-n // page) for n in sys_lens]
        need_own = [-(-n // page) for n in own_lens]
        blocks = sum(need_sys) + sum(need_own) + 3
        g = torch.Generator().manual_seed(0)
        self.k = torch.randn(blocks, page, kvh, d, generator=g).to(dtype).to(device)
        self.v = torch.randn(blocks, page, kvh, d, generator=g).to(dtype).to(device)
        perm = torch.randperm(blocks, generator=g).tolist()
        self.sys_tables = torch.zeros(len(sys_lens), max(need_sys), dtype=torch.int32)
        for s, n in enumerate(need_sys):
            self.sys_tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.tables = torch.zeros(len(own_lens), max(need_own) + 1, dtype=torch.int32)
        for r, n in enumerate(need_own):
            self.tables[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.sys_tables, self.tables = self.sys_tables.to(device), self.tables.to(device)
        self.sys_lens = torch.tensor(sys_lens, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(own_lens, dtype=torch.int32, device=device)
        self.cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        self.token_system = [s for s, n in zip(systems, q_lens) for _ in range(n)]
        self.q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype).to(device)
        self.own_lens, self.q_lens, self.systems, self.page = own_lens, q_lens, systems, page
        self.scale = d**-0.5

    def tiles(self, group: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, systems = system_tiles(self.token_system, tile_tokens_for(group, rows))
        dev = self.q.device
        return torch.tensor(tokens, dtype=torch.int32, device=dev), torch.tensor(systems, dtype=torch.int32, device=dev)

    def standard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each request over its system prompt's K/V followed by its own."""
        kf, vf = self.k.float().flatten(0, 1), self.v.float().flatten(0, 1)
        outs, lses = [], []
        cu = self.cu.tolist()
        for r, (n, s) in enumerate(zip(self.own_lens, self.systems)):
            idx = sequence_slots(self.tables[r], n, self.page)
            if s >= 0:
                sys_idx = sequence_slots(self.sys_tables[s], int(self.sys_lens[s]), self.page)
                idx = torch.cat([sys_idx, idx])
            q = self.q[cu[r] : cu[r + 1]].float()
            o, lse = attention_with_lse(q, kf[idx], vf[idx], self.scale, len(idx) - q.shape[0])
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (an element left unwritten?)"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def relay_ref(b: Batch, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = b.q.float(), b.k.float(), b.v.float()
    sys = system_attention_ref(q, k, v, b.sys_tables, b.sys_lens, b.token_system, b.scale)
    if prefill:
        ctx = paged_prefill_attention_ref(q, k, v, b.tables, b.seq_lens, b.cu, b.scale)
    else:
        ctx = paged_decode_attention_ref(q, k, v, b.tables, b.seq_lens, b.scale)
    return merge_attention_ref(*sys, *ctx)


@pytest.mark.parametrize("heads,kvh,d", SHAPES)
@pytest.mark.parametrize("prefill", [True, False])
def test_relay_reference_equals_standard_attention(heads, kvh, d, prefill) -> None:
    """System part + context part merged by lse = one causal attention over the whole sequence,
    for requests behind two different system prompts and one behind none (multi-application)."""
    q_lens = [5, 1, 9, 3] if prefill else [1, 1, 1, 1]
    own = [12, 1, 30, 3] if prefill else [12, 1, 30, 7]
    b = Batch([37, 16], own, [0, 1, 0, -1], q_lens, heads, kvh, d, torch.float32, torch.device("cpu"))
    out, lse = relay_ref(b, prefill)
    want, want_lse = b.standard()
    assert rel_err(out, want) < 1e-5
    assert rel_err(lse, want_lse) < 1e-6


def test_system_tiles_cover_every_token_once() -> None:
    token_system = [0, 1, 0, -1, 0, 1, 0, 0]
    tokens, systems = system_tiles(token_system, 2, min_tiles=9)
    assert len(systems) == 9 and len(tokens) == 18
    assert sorted(t for t in tokens if t >= 0) == list(range(8))
    for i, s in enumerate(systems):
        assert all(token_system[t] == s for t in tokens[2 * i : 2 * i + 2] if t >= 0)
    assert sum(any(t >= 0 for t in tokens[2 * i : 2 * i + 2]) for i in range(9)) == 5  # 3 + 1 + 1 tiles used
    assert max_system_tiles(8, 2, 3) >= len(system_tiles(token_system, 2)[1])
    assert tile_tokens_for(1) == 64 and tile_tokens_for(4) == 16 and tile_tokens_for(3) == 16


# ---- Triton kernels against the references ---------------------------------------------------


@pytest.fixture(scope="module", params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request: pytest.FixtureRequest) -> tuple[torch.device, tuple[torch.dtype, ...], bool]:
    """(device, dtypes, big shapes) for the Triton kernels: compiled on CUDA, else the interpreter."""
    pytest.importorskip("triton")
    if request.param == "cuda":
        return torch.device("cuda"), (torch.bfloat16, torch.float16, torch.float32), True
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for CUDA here: the cuda variant covers the kernels")
    return torch.device("cpu"), (torch.float32,), False  # fp32 only there, as in test_kernels


def case(where, heads: int, kvh: int, d: int, dtype: torch.dtype, prefill: bool) -> Batch:
    device, _, big = where
    if big:  # long system prompts (many key tiles and splits), a batch spanning several tiles
        n = 70
        systems = [i % 3 - 1 for i in range(n)]  # behind system 0, system 1, or none
        own = [1 + (7 * i) % 300 for i in range(n)]
        sys_lens = [2048 + 5, 700]
    else:
        n = 6
        systems = [0, 1, 0, -1, 0, 1]
        own = [3, 17, 1, 9, 20, 8]
        sys_lens = [37, 90]
    q_lens = [min(o, 4) for o in own] if prefill else [1] * n
    return Batch(sys_lens, own, systems, q_lens, heads, kvh, d, dtype, device, page=16 if big else 8)


@pytest.mark.parametrize("heads,kvh,d", SHAPES)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_system_attention_triton_matches_reference(where, heads, kvh, d, splits) -> None:
    from ragfuse.kernels.relay_triton import system_attention_triton

    for dtype in where[1]:
        b = case(where, heads, kvh, d, dtype, prefill=True)
        ref, ref_lse = system_attention_ref(b.q.float(), b.k.float(), b.v.float(), b.sys_tables, b.sys_lens,
                                            b.token_system, b.scale)
        tokens, systems = b.tiles(heads // kvh)
        out, lse = system_attention_triton(b.q, b.k, b.v, b.sys_tables, b.sys_lens, tokens, systems, b.scale,
                                           int(b.sys_lens.max()), num_splits=splits)
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype], dtype
        none = torch.tensor([s < 0 for s in b.token_system], device=b.q.device)
        assert torch.isinf(lse[none]).all() and torch.count_nonzero(out[none]) == 0
        assert rel_err(lse[~none], ref_lse[~none]) < 1e-4, dtype


@pytest.mark.parametrize("heads,kvh,d", SHAPES)
@pytest.mark.parametrize("splits", [(1, 1), (3, 2), (None, None)])
def test_relay_decode_triton_matches_reference(where, heads, kvh, d, splits) -> None:
    """Context partials + system partials reduced in one pass = relay fusion of the references."""
    from ragfuse.kernels.relay_triton import relay_decode_attention_triton

    for dtype in where[1]:
        b = case(where, heads, kvh, d, dtype, prefill=False)
        ref, ref_lse = relay_ref(b, prefill=False)
        tokens, systems = b.tiles(heads // kvh)
        out, lse = relay_decode_attention_triton(
            b.q, b.k, b.v, b.tables, b.seq_lens, b.sys_tables, b.sys_lens, tokens, systems, b.scale,
            max(b.own_lens), int(b.sys_lens.max()), num_splits=splits[0], sys_splits=splits[1],
        )
        assert rel_err(out, ref) < TOL[dtype], dtype
        assert rel_err(lse, ref_lse) < 1e-4, dtype


@pytest.mark.parametrize("tuning,rows", [
    ({"half_partials": True}, 64),
    ({"sys_block_n": 32, "ctx_block_n": 32, "num_stages": 2}, 64),
    ({"pdl": True, "num_warps": 8, "sys_block_n": 128}, 128),
    ({"fused_reduce": True}, 64),
    ({"fused_reduce": True, "num_stages": 3}, 32),
    ({"streams": 2}, 64),
])
def test_relay_decode_tunings_match_reference(where, tuning, rows) -> None:
    """Every launch parameter the profile tries keeps relay decode exact: 16-bit partials, other key
    tiles and pipeline depths, the reduction as a programmatic dependent launch, larger system tiles."""
    from ragfuse.kernels.relay_triton import RelayTuning, relay_decode_attention_triton

    heads, kvh, d = 8, 2, 64
    for dtype in where[1]:
        b = case(where, heads, kvh, d, dtype, prefill=False)
        ref, ref_lse = relay_ref(b, prefill=False)
        tokens, systems = b.tiles(heads // kvh, rows)
        for _ in range(2):  # a second call on the same buffers: nothing carried over from the first
            out, lse = relay_decode_attention_triton(
                b.q, b.k, b.v, b.tables, b.seq_lens, b.sys_tables, b.sys_lens, tokens, systems, b.scale,
                max(b.own_lens), int(b.sys_lens.max()), tuning=RelayTuning(**tuning),
            )
            tol = TOL[dtype] * (2 if tuning.get("half_partials") and dtype != torch.float32 else 1)
            assert rel_err(out, ref) < tol, dtype
            assert rel_err(lse, ref_lse) < 1e-4, dtype


def test_fused_relay_decode_ignores_padding_rows_and_leaves_no_count_behind(where) -> None:
    """A captured batch's padding rows (no tokens, in no tile) count nothing, so when such a row
    later holds a real sequence its reduction waits for all of its partials."""
    from ragfuse.kernels.relay_triton import RelayTuning, relay_decode_attention_triton

    heads, kvh, d = 8, 2, 64
    tuning = RelayTuning(fused_reduce=True)
    for dtype in where[1]:
        b = case(where, heads, kvh, d, dtype, prefill=False)
        ref, _ = relay_ref(b, prefill=False)
        n = len(b.own_lens)
        padded = b.seq_lens.clone()
        padded[n // 2:] = 0
        real = [s if t < n // 2 else -2 for t, s in enumerate(b.token_system)]  # -2: left out of every tile
        tokens, systems = system_tiles([s for s in real if s != -2], tile_tokens_for(heads // kvh))
        dev = b.q.device
        args = (b.q, b.k, b.v, b.tables)
        tail = (b.sys_tables, b.sys_lens, torch.tensor(tokens, dtype=torch.int32, device=dev),
                torch.tensor(systems, dtype=torch.int32, device=dev), b.scale, max(b.own_lens), int(b.sys_lens.max()))
        out, _ = relay_decode_attention_triton(*args, padded, *tail, tuning=tuning)
        assert rel_err(out[: n // 2], ref[: n // 2]) < TOL[dtype], dtype
        tokens, systems = b.tiles(heads // kvh)
        out, _ = relay_decode_attention_triton(*args, b.seq_lens, *tail[:2], tokens, systems, *tail[4:], tuning=tuning)
        assert rel_err(out, ref) < TOL[dtype], dtype
