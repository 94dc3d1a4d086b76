"""Each Triton kernel against its torch reference, on fresh random inputs.

Every test runs twice: compiled on CUDA (``gpu`` mark, bf16/fp16/fp32, larger shapes), and on CPU
through Triton's interpreter (small shapes, fp32 only: the interpreter of triton 3.9 emulates bf16
by truncation and miscomputes ``tl.dot`` on bf16 operands, and it runs every program in Python, so
the half-precision dtypes, which only change loads, stores and casts, are checked on the GPU).
Outputs are compared with the reference run in float32 on the upcast inputs, by relative L2
error. Before each kernel call the allocator is fed NaN-filled blocks of the outputs' sizes, so an
element the kernel fails to write shows up as NaN instead of a stale correct value.
"""

from __future__ import annotations

import importlib
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

from ragfuse.kernels.activation import silu_mul_ref
from ragfuse.kernels.gemv import gemv_ref
from ragfuse.kernels.history import write_history_ref
from ragfuse.kernels.mass_direction import cap_k_shift_ref, mass_direction_ref, may_bind
from ragfuse.kernels.merge import merge_attention_ref
from ragfuse.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from ragfuse.kernels.paged_attention import (
    consecutive_slots,
    paged_attention_at_positions_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    sequence_slots,
)
from ragfuse.kernels.question_attention import question_attention_ref
from ragfuse.kernels.rope import apply_rope_ref, cos_sin_table, inv_frequencies
from ragfuse.kernels.stored_kv import segment_shift_ref, write_stored_kv_ref

pytest.importorskip("triton")

KERNEL_MODULES = ("norm_triton", "rope_triton", "merge_triton", "paged_attention_triton", "activation_triton",
                  "gemv_triton", "skinny_gemm_triton", "history_triton", "stored_kv_triton",
                  "question_attention_triton", "mass_direction_triton")
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _kernels() -> SimpleNamespace:
    names: dict[str, object] = {}
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"ragfuse.kernels.{name}")
        names.update({k: v for k, v in vars(mod).items() if k.endswith("_triton") or k.endswith("_num_splits")})
    return SimpleNamespace(**names)


@pytest.fixture(scope="module", params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def kern(request: pytest.FixtureRequest) -> SimpleNamespace:
    """The kernels and where they run: compiled on CUDA, or the interpreter on CPU (conftest sets
    TRITON_INTERPRET=1 on machines without CUDA, before Triton is first imported)."""
    ns = _kernels()
    if request.param == "cuda":
        ns.device, ns.dtypes, ns.big = torch.device("cuda"), (torch.bfloat16, torch.float16, torch.float32), True
    elif os.environ.get("TRITON_INTERPRET") == "1":
        ns.device, ns.dtypes, ns.big = torch.device("cpu"), (torch.float32,), False
    else:
        pytest.skip("Triton compiles for CUDA here: the cuda variant covers the kernels")
    return ns


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in output (an element left unwritten?)"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def poison(device: torch.device, *shapes: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Leave NaN-filled blocks of these sizes in the allocator for the next call to receive."""
    bufs = [torch.full(s, float("nan"), dtype=d, device=device) for s, d in shapes]
    del bufs


# ---- paged attention ----------------------------------------------------------------------


def make_cache(
    seq_lens: list[int], kvh: int, d: int, page: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with every sequence's blocks scattered in random order (and spare blocks
    holding random data, so a wrong block index gives a wrong answer)."""
    need = [-(-n // page) for n in seq_lens]
    num_blocks = sum(need) + 3
    k = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    v = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(need + [1]) + 1, dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    return k, v, tables.to(device)


ATTN_SHAPES = [(4, 1, 64), (4, 2, 128), (2, 2, 64)]  # (heads, kv heads, head_dim): GQA/MQA, GQA, MHA


@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTN_SHAPES)
@pytest.mark.parametrize("page", [16, 5])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("pack", [False, True])
def test_prefill_matches_reference(kern, heads, kv_heads, head_dim, page, window, pack) -> None:
    """Varlen causal prefill: fresh sequences, cached prefixes, single tokens, tile/block edges; each
    tile one query head's rows, or (packed) every query head of a KV head."""
    if kern.big:
        q_lens, ctx = [300, 1, 129, 64, 17], [0, 257, 100, 64, 0]
        window = None if window is None else 100
    else:
        q_lens, ctx = [37, 1, 16, 20], [0, 19, 16, 33]
    _check_varlen_prefill(kern, q_lens, ctx, heads, kv_heads, head_dim, page, window, pack=pack)


def _check_varlen_prefill(kern, q_lens: list[int], ctx: list[int], heads: int, kv_heads: int, head_dim: int,
                          page: int, window: int | None, num_splits: int | None = None, pack: bool = False) -> None:
    """Sequences of ``ctx`` cached + ``q_lens`` new tokens through the Triton prefill, against the
    float32 reference, in every dtype the backend runs; outputs and split partials start poisoned so
    a row the kernel forgets to write cannot pass."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx)]
    for dtype in kern.dtypes:
        k_cache, v_cache, tables = make_cache(seq_lens, kv_heads, head_dim, page, dtype, kern.device)
        q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=kern.device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=kern.device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=kern.device)
        scale = head_dim**-0.5
        ref_out, ref_lse = paged_prefill_attention_ref(
            q.float(), k_cache.float(), v_cache.float(), tables, lens, cu, scale, window
        )
        parts = (q.shape[0], num_splits or 1, heads)
        poison(kern.device, (q.shape, dtype), (q.shape[:2], torch.float32), ((*parts, head_dim), torch.float32),
               (parts, torch.float32))
        out, lse = kern.paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, lens, cu, scale, window, max_query_len=max(q_lens), num_splits=num_splits,
            pack=pack,
        )
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert rel_err(out, ref_out) < TOL[dtype], dtype
        assert rel_err(lse, ref_lse) < 1e-4, dtype


@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTN_SHAPES[:2])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("pack", [False, True])
def test_prefill_split_keys_matches_reference(kern, heads, kv_heads, head_dim, num_splits, window, pack) -> None:
    """Split-K prefill (a new turn after a long history): each query tile's keys cut into shares
    merged by lse, beside tiles too short to split (written directly) in the same launch, and fresh
    sequences whose early tiles stay whole while later ones split."""
    if not kern.big and (window is None) == (pack == (num_splits == 3)):
        # Triton's interpreter runs every program in Python: on CPU half the grid, which still meets
        # every pair of (splits, window, pack) values; the GPU runs all of it
        pytest.skip("pairwise subset on the interpreter")
    if kern.big:
        q_lens, ctx = [257, 1, 129, 300, 64], [33000, 2000, 100, 0, 7000]
        window = None if window is None else 9000
    else:
        q_lens, ctx = [37, 1, 16, 20, 5], [0, 19, 16, 140, 40]  # 16 splits leave some shares empty
    _check_varlen_prefill(kern, q_lens, ctx, heads, kv_heads, head_dim, 16, window, num_splits, pack)


def test_prefill_split_count_depends_only_on_host_sizes(kern) -> None:
    """A turn's few query tiles split their keys (the count fixed by host ints, valid for any length
    a graph replays); a grid that fills the device twice over does not."""
    sms = kern.prefill_num_splits.__globals__["_sm_count"](kern.device)
    assert kern.prefill_num_splits(sms // 2, 32768, kern.device) > 1
    assert kern.prefill_num_splits(2 * sms, 32768, kern.device) == 1
    assert kern.prefill_num_splits(sms // 2, 16, kern.device) == 1  # keys too few to share
    assert kern.prefill_num_splits(sms // 2, 32768, kern.device) & (kern.prefill_num_splits(sms // 2, 32768,
                                                                                            kern.device) - 1) == 0


@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTN_SHAPES)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("pack", [False, True])
def test_prefill_at_scattered_positions_matches_reference(kern, heads, kv_heads, head_dim, window, num_splits,
                                                           pack) -> None:
    """Cache fusion's recompute: queries at scattered ascending positions over a whole cached
    sequence, each with its own causal bound (positions straddle tile and page edges), with the keys
    whole or split."""
    seq_len = 6500 if kern.big else 53
    picks = [0, 1, 5, 16, 17, 31, 32, 33, 52] if not kern.big else [0, 3, 63, 64, 65, 200, 511, 512, 6499]
    for dtype in kern.dtypes:
        k_cache, v_cache, tables = make_cache([seq_len], kv_heads, head_dim, 16, dtype, kern.device)
        q = torch.randn(len(picks), heads, head_dim, dtype=dtype, device=kern.device)
        pos = torch.tensor(picks, device=kern.device)
        scale = head_dim**-0.5
        ref_out, ref_lse = paged_attention_at_positions_ref(
            q.float(), pos, k_cache.float(), v_cache.float(), tables[0], seq_len, scale, window
        )
        poison(kern.device, (q.shape, dtype), (q.shape[:2], torch.float32))
        cu = torch.tensor([0, len(picks)], dtype=torch.int32, device=kern.device)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=kern.device)
        out, lse = kern.paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, lens, cu, scale, window, max_query_len=len(picks), q_positions=pos,
            num_splits=num_splits, pack=pack,
        )
        assert rel_err(out, ref_out) < TOL[dtype], dtype
        assert rel_err(lse, ref_lse) < 1e-4, dtype


@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTN_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, 9])
def test_decode_matches_reference(kern, heads, kv_heads, head_dim, num_splits, window) -> None:
    """Split-K decode, including shares that fall past a short sequence's end (empty splits)."""
    seq_lens = [1, 2000, 64, 129, 1025] if kern.big else [1, 17, 64, 100, 33]
    page = 16
    for dtype in kern.dtypes:
        k_cache, v_cache, tables = make_cache(seq_lens, kv_heads, head_dim, page, dtype, kern.device)
        q = torch.randn(len(seq_lens), heads, head_dim, dtype=dtype, device=kern.device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=kern.device)
        scale = head_dim**-0.5
        ref_out, ref_lse = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                                      scale, window)
        splits = num_splits or kern.decode_num_splits(len(seq_lens), kv_heads, max(seq_lens), kern.device)
        n = len(seq_lens)
        poison(kern.device, (q.shape, dtype), (q.shape[:2], torch.float32),
               ((n, splits, heads, head_dim), torch.float32), ((n, splits, heads), torch.float32))
        out, lse = kern.paged_decode_attention_triton(
            q, k_cache, v_cache, tables, lens, scale, window, max_seq_len=max(seq_lens), num_splits=num_splits
        )
        assert rel_err(out, ref_out) < TOL[dtype], dtype
        assert rel_err(lse, ref_lse) < 1e-4, dtype


def test_decode_split_count_depends_only_on_host_sizes(kern) -> None:
    """The split count must not change with the lengths a captured graph later replays."""
    n = kern.decode_num_splits(1, 1, 32768, kern.device)
    assert n > 1
    assert kern.decode_num_splits(64, 1, 32768, kern.device) < n
    assert kern.decode_num_splits(1, 1, 10, kern.device) == 1  # one key tile: nothing to split


def test_write_kv_skips_negative_slots(kern) -> None:
    for dtype in kern.dtypes:
        k_cache = torch.randn(6, 4, 2, 64, dtype=dtype, device=kern.device)
        v_cache = torch.randn_like(k_cache)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        slots = torch.tensor([3, -1, 22, 0, -1], dtype=torch.long, device=kern.device)
        k = torch.randn(5, 2, 64, dtype=dtype, device=kern.device)
        v = torch.randn(5, 2, 64, dtype=dtype, device=kern.device)
        kern.write_kv_triton(k, v, k_cache, v_cache, slots)
        keep = slots >= 0
        k_before.view(-1, 2, 64)[slots[keep]] = k[keep]
        v_before.view(-1, 2, 64)[slots[keep]] = v[keep]
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


# ---- merge, RoPE, RMSNorm ----------------------------------------------------------------------


@pytest.mark.parametrize("heads,head_dim", [(4, 64), (3, 128)])
def test_merge_matches_reference(kern, heads, head_dim) -> None:
    tokens = 37
    for dtype in kern.dtypes:
        oa = torch.randn(tokens, heads, head_dim, dtype=dtype, device=kern.device)
        ob = torch.randn(tokens, heads, head_dim, dtype=dtype, device=kern.device)
        la = torch.randn(tokens, heads, device=kern.device) * 4
        lb = torch.randn(tokens, heads, device=kern.device) * 4
        la[0, 0] = float("-inf")  # side a empty
        lb[1, 1] = float("-inf")  # side b empty
        la[2, 2] = lb[2, 2] = float("-inf")  # both empty: out 0, lse -inf
        ref_out, ref_lse = merge_attention_ref(oa.float(), la, ob.float(), lb)
        poison(kern.device, (oa.shape, dtype), (la.shape, torch.float32))
        out, lse = kern.merge_attention_triton(oa, la, ob, lb)
        assert rel_err(out, ref_out) < TOL[dtype] / 2
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert rel_err(lse[finite], ref_lse[finite]) < 1e-6
        assert torch.count_nonzero(out[2, 2]) == 0


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
def test_rope_matches_reference(kern, heads, kv_heads, head_dim) -> None:
    """q and k rotated in one launch from strided views of a packed qkv projection."""
    tokens, max_pos = 13, 4096
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 10000.0), max_pos)
    cos, sin = cos.to(kern.device), sin.to(kern.device)
    for dtype in kern.dtypes:
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=kern.device)
        q, k, _ = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        positions = torch.randint(0, max_pos, (tokens,), device=kern.device)
        poison(kern.device, (q.shape, dtype), (k.shape, dtype))
        q_out, k_out = kern.apply_rope_qk_triton(q, k, positions, cos, sin)
        assert rel_err(q_out, apply_rope_ref(q.float(), positions, cos, sin)) < TOL[dtype] / 2
        assert rel_err(k_out, apply_rope_ref(k.float(), positions, cos, sin)) < TOL[dtype] / 2
        assert rel_err(kern.apply_rope_triton(k, positions, cos, sin), k_out) == 0.0


def test_rope_rerotates_stored_k_by_delta(kern) -> None:
    """K stored at positions p, rotated again by per-token deltas, equals K rotated to p + delta."""
    tokens, head_dim, max_pos = 29, 64, 2048
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 500000.0), max_pos)
    cos, sin = cos.to(kern.device), sin.to(kern.device)
    k = torch.randn(tokens, 2, head_dim, device=kern.device)
    p = torch.randint(0, 1000, (tokens,), device=kern.device)
    delta = torch.randint(0, 1000, (tokens,), device=kern.device)
    stored = kern.apply_rope_triton(k, p, cos, sin)
    moved = kern.apply_rope_triton(stored, delta, cos, sin)
    assert rel_err(moved, apply_rope_ref(k, p + delta, cos, sin)) < 1e-5


@pytest.mark.parametrize("cut", [False, True])
def test_write_history_matches_reference(kern, cut: bool) -> None:
    """A stored layer written into scattered pages, K rotated to positions 0..n-1, and with a cut
    history only the kept rows; every other slot of the cache keeps its value."""
    page, heads, head_dim, stored, blocks = 4, 3, (128 if kern.big else 64), 23, 9
    n = 15 if cut else 19
    g = torch.Generator().manual_seed(1)
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 10000.0), 64)
    cos, sin = cos.to(kern.device), sin.to(kern.device)
    table = torch.randperm(blocks, generator=g)[: -(-n // page)].to(torch.int32).to(kern.device)
    rows = torch.sort(torch.randperm(stored, generator=g)[:n]).values.to(kern.device) if cut else None
    for dtype in kern.dtypes:
        kv = torch.randn(2, stored, heads, head_dim, generator=g).to(dtype).to(kern.device)
        k_cache = torch.randn(blocks, page, heads, head_dim, generator=g).to(dtype).to(kern.device)
        v_cache = torch.randn(blocks, page, heads, head_dim, generator=g).to(dtype).to(kern.device)
        k_ref, v_ref = k_cache.float(), v_cache.float()
        write_history_ref(kv.float(), n, cos, sin, k_ref, v_ref, table, rows)
        kern.write_history_triton(kv, n, cos, sin, k_cache, v_cache, table, rows)
        assert rel_err(k_cache, k_ref) < TOL[dtype] / 2
        assert torch.equal(v_cache.float(), v_ref)


def test_segment_shift_matches_reference(kern) -> None:
    """Mean deviation per stored segment over the active rows (fresh K/V as strided views of a packed
    projection), times K's and V's shares (unequal, so a swap shows); the spare last segment (rows
    without stored KV, padding) and a segment with no active row shift nothing."""
    heads, head_dim, stored, active, segments = 2, (128 if kern.big else 64), 40, 150 if not kern.big else 700, 5
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, stored, (active,), generator=g)
    seg = torch.randint(0, 3, (active,), generator=g)  # segment 3 has no active row
    seg[::4] = segments - 1
    share = torch.tensor([0.25, 0.5])
    for dtype in kern.dtypes:
        packed = torch.randn(active, 3 * heads * head_dim, generator=g).to(dtype)
        k_new, v_new = (t.view(active, heads, head_dim) for t in packed[:, heads * head_dim:].chunk(2, dim=-1))
        k_st, v_st = torch.randn(2, stored, heads, head_dim, generator=g).to(dtype)
        ref_k, ref_v = segment_shift_ref(k_new.float(), v_new.float(), k_st.float(), v_st.float(), rows, seg, share,
                                         segments)
        dev = [t.to(kern.device) for t in (k_new, v_new, k_st, v_st, rows, seg, share)]
        mk, mv = kern.segment_shift_triton(*dev, segments)
        assert mk.dtype == torch.float32 and mk.shape == (segments, heads, head_dim)
        mk, mv = mk.cpu(), mv.cpu()
        assert rel_err(mk, ref_k) < 1e-5 and rel_err(mv, ref_v) < 1e-5
        assert not mk[3:].any() and not mv[3:].any()


@pytest.mark.parametrize("odd_dim", [False, True])
def test_mass_direction_and_its_cap_match_reference(kern, odd_dim: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per segment and KV head, the question's mean mass direction, and the shift capped along it:
    grouped query heads, padded question rows (they count for nothing, whole blocks of them skip the
    walk), segments longer than a step, one without rows (zeros) and a spare one at the end,
    scattered positions, and a head_dim whose half is no power of two (the kernel pads it); the
    reference's per-segment softmax and the kernel's online one agree, and so do the capped shifts.
    With fewer programs than segments, each walks several: the same sums."""
    heads, kv_heads = 8, 2
    head_dim = (80 if odd_dim else 128) if kern.big else (48 if odd_dim else 32)
    lengths = (150, 0, 37, 90, 5) if kern.big else (70, 0, 9, 20, 3)
    w_rows, real = 40, 14  # 160 query rows, the last 104 padding: the kernel's row blocks past 64 are padding alone
    g = torch.Generator().manual_seed(7)
    t = sum(lengths)
    bounds = torch.tensor([0, *itertools.accumulate(lengths), t])  # the last segment is the spare: no rows
    at = torch.sort(torch.randperm(2 * t, generator=g)[:t]).values
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 10000.0), 4 * t)
    ok = torch.arange(w_rows) < real
    for dtype in kern.dtypes:
        q = (torch.randn(w_rows, heads, head_dim, generator=g) * 2).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
        ref = mass_direction_ref(q.float(), ok, k.float(), at, cos, sin, bounds, 0.3)
        dev = [x.to(kern.device) for x in (q, ok, k, at, cos, sin, bounds)]
        got = kern.mass_direction_triton(*dev, 0.3).cpu()
        assert got.dtype == torch.float32 and got.shape == (len(lengths) + 1, kv_heads, head_dim)
        assert rel_err(got, ref) < TOL[dtype]
        assert not got[1].any() and not got[-1].any()  # no rows: zeros
        with monkeypatch.context() as m:
            m.setattr(importlib.import_module("ragfuse.kernels.mass_direction_triton"), "_SEGMENT_PROGRAMS", 2)
            assert torch.equal(kern.mass_direction_triton(*dev, 0.3).cpu(), got)
        padded = mass_direction_ref(q.float()[:real], ok[:real], k.float(), at, cos, sin, bounds, 0.3)
        assert rel_err(ref, padded) < 1e-6
        # the cap: a shift per segment, a limit that some segments' moves pass and some do not
        mk = torch.randn(len(lengths) + 1, kv_heads, head_dim, generator=g)
        mk[-1] = 0.0
        moves = 0.3 * (ref * mk).sum(-1)
        limit = moves.abs()[moves != 0].median().reshape(1)
        capped = cap_k_shift_ref(mk, q.float(), ok, k.float(), at, cos, sin, bounds, limit, 0.3)
        assert not torch.equal(capped, mk) and torch.equal(capped[moves.abs() < limit], mk[moves.abs() < limit])
        got = kern.cap_k_shift_triton(mk.to(kern.device), *dev, limit.to(kern.device), 0.3).cpu()
        assert rel_err(got, capped) < TOL[dtype]


def test_cap_walks_only_segments_that_may_bind() -> None:
    """The reference cap skips the segments whose shift provably stays under the limit (``may_bind``):
    none of them would have been cut, a small shift is cleared and a large one walked, and the capped
    shifts equal, bit for bit, those of walking every segment, at limits from none binding to all."""
    heads, kv_heads, head_dim, scale = 6, 2, 32, 0.2
    lengths = (40, 25, 0, 60, 33)
    g = torch.Generator().manual_seed(11)
    t = sum(lengths)
    bounds = torch.tensor([0, *itertools.accumulate(lengths), t])
    at = torch.sort(torch.randperm(3 * t, generator=g)[:t]).values
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 10000.0), 4 * t)
    w_rows, real = 20, 13
    ok = torch.arange(w_rows) < real
    q = torch.randn(w_rows, heads, head_dim, generator=g)
    k = torch.randn(t, kv_heads, head_dim, generator=g)
    mk = torch.randn(len(lengths) + 1, kv_heads, head_dim, generator=g)
    mk[0] *= 1e-4  # a tiny shift: cleared at any limit that binds something
    mk[-1] = 0.0  # the spare
    ub = mass_direction_ref(q, ok, k, at, cos, sin, bounds, scale)  # every segment walked
    moves = scale * (ub * mk).sum(-1)
    levels = sorted(moves.abs()[moves != 0].tolist())
    for limit in (0.5 * levels[0], levels[len(levels) // 2], 2 * levels[-1]):
        lim = torch.tensor([limit])
        walk = may_bind(mk, q, ok, lim, scale)
        assert not (moves.abs()[~walk] > limit).any()  # what is skipped would not have been cut
        over = moves.abs() - lim
        cut = torch.where(over > 0, over * moves.sign() / (scale * (ub * ub).sum(-1)).clamp(min=1e-30), 0.0)
        assert torch.equal(cap_k_shift_ref(mk, q, ok, k, at, cos, sin, bounds, lim, scale), mk - cut[..., None] * ub)
    lim = torch.tensor([levels[len(levels) // 2]])
    walk = may_bind(mk, q, ok, lim, scale)
    assert not walk[0] and not walk[-1] and walk.any()
    # where the bound is tight (one query for every row and head, a segment's rows all at one position,
    # its shift along the direction it moves the mass), a move just past the limit is walked and cut
    q_one = q[:1, :1].expand(w_rows, heads, head_dim).contiguous()
    at_one = at.clone()
    at_one[bounds[1] : bounds[2]] = at[bounds[1]]
    ub = mass_direction_ref(q_one, ok, k, at_one, cos, sin, bounds, scale)
    tight = mk.clone()
    tight[1] = ub[1] * 3.0
    move = scale * (ub[1] * tight[1]).sum(-1)  # the bound itself, up to rounding
    lim = (0.99 * move.min()).reshape(1)
    assert may_bind(tight, q_one, ok, lim, scale)[1]
    got = cap_k_shift_ref(tight, q_one, ok, k, at_one, cos, sin, bounds, lim, scale)
    assert (got[1] - tight[1]).abs().max() > 1e-4  # cut
    assert torch.allclose(scale * (ub[1] * got[1]).sum(-1), lim.expand(kv_heads), rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_question_attention_matches_reference(kern, padded: bool) -> None:
    """The question's mean attention per position with grouped query heads, keys gathered through
    scattered slots, several shares of positions and row blocks; padded (a CUDA graph's capacities):
    invalid queries and positions past the real length count for nothing."""
    heads, kv_heads, head_dim, page, blocks = 8, 2, (128 if kern.big else 32), 16, 40
    m, p = (12, 600) if kern.big else (7, 90)
    n = p - 13 if padded else p
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(blocks * page, generator=g)[:p]
    q_pos = torch.arange(n - m, n)
    valid = None
    if padded:
        q_pos[-3:] = n - 1
        valid = torch.arange(m) < m - 3
    for dtype in kern.dtypes:
        q = torch.randn(m, heads, head_dim, generator=g).to(dtype)
        k_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=g).to(dtype)
        ref = question_attention_ref(q.float(), k_cache.float(), slots, q_pos, torch.tensor(n), 0.2, valid)
        dev = [t.to(kern.device) for t in (q, k_cache, slots, q_pos, torch.tensor(n, dtype=torch.int32))]
        got = kern.question_attention_triton(*dev, 0.2, None if valid is None else valid.to(kern.device)).cpu()
        assert got.dtype == torch.float32 and got.shape == (p,)
        assert rel_err(got, ref) < TOL[dtype]
        assert abs(got.sum().item() - 1) < 1e-3 and not got[n:].any()


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_write_stored_kv_matches_reference(kern, shifted: bool, keep: bool) -> None:
    """Stored rows shifted by their segment, K rotated to its position, both written at scattered
    slots (a slot of -1 writes nothing, every other slot keeps its value); with ``keep`` the shifted
    rows come back exactly as the reference rounds them."""
    page, heads, head_dim, rows, blocks, segments = 4, 3, (128 if kern.big else 64), 29, 12, 3
    g = torch.Generator().manual_seed(4)
    cos, sin = cos_sin_table(inv_frequencies(head_dim, 10000.0), 256)
    slots = torch.randperm(blocks * page, generator=g)[:rows]
    slots[[3, 17]] = -1
    positions = torch.randint(0, 256, (rows,), generator=g)
    segment = torch.randint(0, segments, (rows,), generator=g)
    mk, mv = torch.randn(2, segments, heads, head_dim, generator=g) * 0.1
    untouched = torch.ones(blocks * page, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for dtype in kern.dtypes:
        k, v = torch.randn(2, rows, heads, head_dim, generator=g).to(dtype)
        k_cache, v_cache = torch.randn(2, blocks, page, heads, head_dim, generator=g).to(dtype)
        k_ref, v_ref = k_cache.float(), v_cache.float()
        shift = (mk, mv, segment) if shifted else None
        written = write_stored_kv_ref(k, v, positions, cos, sin, k_cache.clone(), v_cache.clone(), slots, shift)
        assert written is not None
        write_stored_kv_ref(written[0].float(), written[1].float(), positions, cos, sin, k_ref, v_ref, slots)
        kc, vc = k_cache.to(kern.device), v_cache.to(kern.device)
        on = [t.to(kern.device) for t in (k, v, positions, cos, sin)]
        out = kern.write_stored_kv_triton(*on, kc, vc, slots.to(kern.device),
                                          tuple(t.to(kern.device) for t in shift) if shift else None, keep)
        assert (out is not None) == keep
        if out is not None:
            assert torch.equal(out[0].cpu(), written[0]) and torch.equal(out[1].cpu(), written[1])
        kc, vc = kc.cpu(), vc.cpu()
        assert rel_err(kc, k_ref) < TOL[dtype] / 2 and rel_err(vc, v_ref) < TOL[dtype] / 2
        for new, old in ((kc, k_cache), (vc, v_cache)):
            assert torch.equal(new.reshape(-1, heads, head_dim)[untouched], old.reshape(-1, heads, head_dim)[untouched])


@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (2, 3, 64)])
def test_rms_norm_matches_reference(kern, shape) -> None:
    if kern.big:
        shape = (*shape[:-1], 4096)
    eps = 1e-5
    for dtype in kern.dtypes:
        x = torch.randn(shape, dtype=dtype, device=kern.device) * 3
        res = torch.randn(shape, dtype=dtype, device=kern.device)
        w = (torch.rand(shape[-1], device=kern.device) + 0.5).to(dtype)
        poison(kern.device, (shape, dtype), (shape, dtype))
        out = kern.rms_norm_triton(x, w, eps)
        ref = rms_norm_ref(x, w, eps)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < TOL[dtype] / 4
        poison(kern.device, (shape, dtype), (shape, dtype))
        normed, new_res = kern.fused_add_rms_norm_triton(x, res, w, eps)
        ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, eps)
        assert torch.equal(new_res, ref_res)  # the residual sum rounds exactly like torch's add
        assert rel_err(normed, ref_normed) < TOL[dtype] / 4
        # in place (a CUDA graph's static residual): the same values, written over the residual given
        for fn in (kern.fused_add_rms_norm_triton, fused_add_rms_norm_ref):
            res_in = res.clone()
            normed_in, sum_in = fn(x, res_in, w, eps, in_place=True)
            assert sum_in.data_ptr() == res_in.data_ptr()
            assert torch.equal(res_in, ref_res) and torch.equal(normed_in, fn(x, res, w, eps)[0])


@pytest.mark.parametrize("shape", [(1, 2 * 96), (5, 2 * 1000), (2, 3, 2 * 64)])
def test_silu_mul_matches_reference(kern, shape) -> None:
    """Odd widths (a partial last column block), one row (decode), and leading batch dimensions."""
    if kern.big:
        shape = (*shape[:-1], 2 * 14336) if shape[-1] != 2 * 1000 else (*shape[:-1], 2 * 4100)
    for dtype in kern.dtypes:
        x = torch.randn(shape, dtype=dtype, device=kern.device) * 4
        out_shape = (*shape[:-1], shape[-1] // 2)
        poison(kern.device, (out_shape, dtype))
        out = kern.silu_mul_triton(x)
        ref = silu_mul_ref(x)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, silu_mul_ref(x.float())) < TOL[dtype] / 4
        assert rel_err(out, ref) < TOL[dtype] / 4
    strided = torch.randn(4, 2 * shape[-1], device=kern.device)[:, : shape[-1]]
    assert rel_err(kern.silu_mul_triton(strided), silu_mul_ref(strided)) < 1e-5
    with pytest.raises(ValueError, match="even"):
        kern.silu_mul_triton(torch.randn(2, 7, device=kern.device))


@pytest.mark.parametrize("n, k", [(5, 64), (96, 200), (33, 1100)])
def test_gemv_matches_reference(kern, n, k) -> None:
    """One row times a weight matrix: row counts that leave a partial last tile, K that is no multiple
    of the tile (on the GPU: Mistral-7B's o, down and head shapes, with an odd row count)."""
    if kern.big:
        n, k = {(5, 64): (4096, 4096), (96, 200): (4099, 14336), (33, 1100): (32000, 4096)}[(n, k)]
    for dtype in kern.dtypes:
        w = torch.randn(n, k, dtype=dtype, device=kern.device) * 0.02
        for x in (torch.randn(1, k, dtype=dtype, device=kern.device), torch.randn(2, k, dtype=dtype,
                                                                                 device=kern.device)[1:, :]):
            poison(kern.device, ((1, n), dtype))
            out = kern.gemv_triton(x, w)
            ref = gemv_ref(x.float(), w.float())
            assert out.shape == (1, n) and out.dtype == dtype
            assert rel_err(out, ref) < TOL[dtype] / 4
    with pytest.raises(ValueError, match="one row"):
        kern.gemv_triton(torch.randn(2, k, device=kern.device), torch.randn(n, k, device=kern.device))


@pytest.mark.parametrize("m", [2, 13, 33, 64])
def test_skinny_gemm_matches_reference(kern, m) -> None:
    """A few rows times a weight matrix, for row counts in each of the row tiles (16, 32, 64) and rows
    that leave a tile partly empty, with a partial last column tile and K no multiple of the tile. On
    the GPU: every shape with measured tiles, in bf16 with those tiles (as the engine calls it)."""
    from ragfuse.kernels.skinny_gemm_triton import _TILES, rows_bucket, skinny_tiles

    if not kern.big:
        for dtype in kern.dtypes:
            w = torch.randn(97, 200, dtype=dtype, device=kern.device) * 0.02
            x = torch.randn(m, 2 * 200, dtype=dtype, device=kern.device)[:, ::2]  # rows with a stride
            out = kern.skinny_gemm_triton(x, w, (32, 64, 4, 2))
            assert out.shape == (m, 97) and out.dtype == dtype
            assert rel_err(out, gemv_ref(x.float(), w.float())) < TOL[dtype] / 4
        return
    for (n, k), by_rows in _TILES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=kern.device) * 0.02
        x = torch.randn(1, m, k, dtype=torch.bfloat16, device=kern.device)
        tiles = skinny_tiles(x, w)
        assert tiles == by_rows.get(rows_bucket(m))
        poison(kern.device, ((m, n), torch.bfloat16))
        out = kern.skinny_gemm_triton(x, w, tiles)
        assert out.shape == (1, m, n)
        assert rel_err(out, gemv_ref(x.float(), w.float())) < TOL[torch.bfloat16] / 4
    assert skinny_tiles(torch.randn(65, 4096, dtype=torch.bfloat16, device=kern.device), w) is None
    assert skinny_tiles(torch.randn(m, 4096, dtype=torch.float16, device=kern.device), w.half()) is None
    with pytest.raises(ValueError, match="rows"):
        kern.skinny_gemm_triton(torch.randn(65, 64, device=kern.device), torch.randn(8, 64, device=kern.device))


@pytest.mark.parametrize("blocks,seq_len,expected", [
    ([3, 4, 5, 9], 40, slice(48, 88)),  # only the blocks the tokens need count
    ([3, 4, 6], 40, None),
    ([7], 5, slice(112, 117)),
    ([], 0, None),
    ([2, 3], 17, slice(32, 49)),
])
def test_consecutive_slots_is_the_slots_as_a_slice_or_none(blocks, seq_len, expected) -> None:
    """Consecutive blocks' slots as one slice (equal to the gathered slots), None across a gap."""
    run = consecutive_slots(blocks, seq_len, 16)
    assert run == expected
    if run is not None:
        slots = sequence_slots(torch.tensor(blocks, dtype=torch.int32), seq_len, 16)
        assert torch.equal(torch.arange(100 * 16)[run], slots)
