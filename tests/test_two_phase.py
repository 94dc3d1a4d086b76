"""Two-phase decode attention over shared blocks: its plan, the torch reference against plain paged
attention, and the Triton kernels against the reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from ragfuse.kernels.paged_attention import paged_decode_attention_ref
from ragfuse.kernels.two_phase import build_two_phase_plan, two_phase_decode_ref

CPU = torch.device("cpu")


def shared_batch(
    paths: list[list[str]], private: list[int], page: int, kvh: int, d: int, dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Caches for sequences whose leading blocks are the labelled shared blocks of ``paths`` (one
    cache block per distinct label), followed by ``private[s]`` tokens of their own; all blocks in
    random order, with spare blocks of random data."""
    labels = sorted({x for p in paths for x in p})
    own = [-(-n // page) for n in private]
    num_blocks = len(labels) + sum(own) + 3
    perm = torch.randperm(num_blocks).tolist()
    block_of = {x: perm[i] for i, x in enumerate(labels)}
    at = len(labels)
    tables, tree_paths, lens = [], [], []
    for p, n, o in zip(paths, private, own, strict=True):
        tree_paths.append([block_of[x] for x in p])
        tables.append(tree_paths[-1] + perm[at : at + o])
        at += o
        lens.append(len(p) * page + n)
    width = max(map(len, tables)) + 1
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    k = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    v = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    return k, v, table, torch.tensor(lens, dtype=torch.int32, device=device), tree_paths


# a forest: seqs 0-3 share a0..a2, seqs 0 and 2 also share b0..b1 (a nested segment), seqs 4-5 share
# c0, seq 6 shares nothing, seq 7 is on the a-path alone past a0 (shares a0 only)
PATHS = [["a0", "a1", "a2", "b0", "b1"], ["a0", "a1", "a2", "x0"], ["a0", "a1", "a2", "b0", "b1", "b2"],
         ["a0", "a1", "a2"], ["c0"], ["c0", "y0"], [], ["a0", "z0"]]
PRIVATE = [1, 17, 5, 33, 2, 16, 40, 9]


def test_plan_finds_every_shared_segment_once():
    paths = [[10, 11, 12, 20, 21], [10, 11, 12, 30], [10, 11, 12, 20, 21, 22], [10, 11, 12], [40], [40, 41], [],
             [10, 50]]
    plan = build_two_phase_plan(paths, block_size=4, num_kv_heads=2, device=CPU)
    assert plan is not None
    segs = {(frozenset(plan.host_order[lo:hi]), k0, k1) for lo, hi, k0, k1, _ in plan.host_items}
    assert segs == {
        (frozenset({0, 1, 2, 3, 7}), 0, 4),  # a0: five sequences
        (frozenset({0, 1, 2, 3}), 4, 12),  # a1, a2: four (seq 7 left after a0)
        (frozenset({0, 2}), 12, 20),  # b0, b1
        (frozenset({4, 5}), 0, 4),  # c0
    }
    assert plan.host_shared_lens == [20, 12, 20, 12, 4, 4, 0, 4]
    assert plan.num_parts.tolist() == [3, 2, 3, 2, 1, 1, 0, 1]
    # splitting long segments adds items and partial slots but keeps each sequence's slots distinct
    split = build_two_phase_plan(paths, block_size=4, num_kv_heads=2, device=CPU, split_tokens=3)
    assert split.num_items > plan.num_items and split.shared_tokens == plan.shared_tokens
    for s in range(len(paths)):
        slots = [sl for lo, hi, _, _, sl in split.host_items if s in split.host_order[lo:hi]]
        assert sorted(slots) == list(range(split.num_parts[s].item()))
    assert build_two_phase_plan([[1, 2], [3], []], 4, 2, CPU) is None


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 64), (4, 2, 16), (2, 2, 32)])
@pytest.mark.parametrize("split", [None, 7, 16])
def test_reference_equals_paged_attention(heads, kv_heads, head_dim, split):
    torch.manual_seed(0)
    k, v, tables, lens, paths = shared_batch(PATHS, PRIVATE, 5, kv_heads, head_dim, torch.float32, CPU)
    q = torch.randn(len(PATHS), heads, head_dim)
    plan = build_two_phase_plan(paths, 5, kv_heads, CPU, split_tokens=split)
    out, lse = two_phase_decode_ref(q, k, v, tables, lens, plan, head_dim**-0.5)
    ref_out, ref_lse = paged_decode_attention_ref(q, k, v, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def target(request):
    """(device, dtypes, big): compiled on CUDA, or Triton's interpreter on CPU (see test_kernels)."""
    pytest.importorskip("triton")
    if request.param == "cuda":
        return torch.device("cuda"), (torch.bfloat16, torch.float32), True
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton compiles for CUDA here: the cuda variant covers the kernels")
    return CPU, (torch.float32,), False


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 64), (8, 2, 128), (4, 4, 64), (32, 8, 128)])
@pytest.mark.parametrize("page", [16, 5])
def test_triton_matches_reference(target, heads, kv_heads, head_dim, page):
    """GQA and MHA, head dims 64/128, odd lengths, shared segments ending off tile and page edges,
    nested segments, long segments split into several items, more sequences than one query tile."""
    from ragfuse.kernels.two_phase_triton import two_phase_decode_triton

    device, dtypes, big = target
    if not big and heads == 32:
        pytest.skip("large shape: GPU only")
    torch.manual_seed(1)
    paths, private = PATHS, PRIVATE
    if big:  # long shared prefixes (1000+ tokens) and 40 sequences on one of them
        long = [f"p{i}" for i in range(70)]
        paths = [long + p for p in PATHS] + [long + [f"q{i}"] for i in range(32)]
        private = PRIVATE + [1 + 37 * i % 300 for i in range(32)]
    for dtype in dtypes:
        k, v, tables, lens, tree_paths = shared_batch(paths, private, page, kv_heads, head_dim, dtype, device)
        q = torch.randn(len(paths), heads, head_dim, dtype=dtype, device=device)
        scale = head_dim**-0.5
        for split in (None, 3 * page + 1):
            plan = build_two_phase_plan(tree_paths, page, kv_heads, device, split_tokens=split)
            ref_out, ref_lse = two_phase_decode_ref(q.float(), k.float(), v.float(), tables, lens, plan, scale)
            out, lse = two_phase_decode_triton(q, k, v, tables, lens, plan, scale)
            assert out.dtype == dtype
            err = float((out.double() - ref_out.double()).norm() / ref_out.double().norm())
            assert err < TOL[dtype], (dtype, split, err)
            torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


def test_padded_plan_runs_like_the_plan(target):
    """A plan copied into larger fixed buffers (as a CUDA graph replays it) over a batch padded with
    empty rows: the real rows' attention is the plan's, the padding rows attend to nothing, and
    whatever the buffers held before (here: rows that would attend and fold) is made inert."""
    from ragfuse.kernels.two_phase import TwoPhasePlan
    from ragfuse.kernels.two_phase_triton import two_phase_decode_triton

    device, dtypes, _ = target
    torch.manual_seed(2)
    n, size, page, kvh, heads, d = len(PATHS), len(PATHS) + 3, 5, 2, 8, 64
    k, v, tables, lens, tree_paths = shared_batch(PATHS, PRIVATE, page, kvh, d, torch.float32, device)
    plan = build_two_phase_plan(tree_paths, page, kvh, device, split_tokens=7)
    i32 = dict(dtype=torch.int32, device=device)
    padded = TwoPhasePlan.padded(
        size, torch.tensor([[0, n, 0, 10, 0]], **i32).repeat(plan.num_items + 5, 1), torch.zeros(size, **i32),
        torch.full((size,), 9, **i32), torch.full((size,), 2, **i32), plan.max_parts + 2,
    )
    plan.load_into(padded)
    with pytest.raises(ValueError, match="exceeds"):
        build_two_phase_plan(tree_paths, page, kvh, device, split_tokens=2).load_into(padded)
    q = torch.randn(size, heads, d, device=device)
    tables_p = torch.cat([tables, torch.zeros(size - n, tables.shape[1], **i32)])
    lens_p = torch.cat([lens, torch.zeros(size - n, **i32)])
    out, lse = two_phase_decode_triton(q, k, v, tables_p, lens_p, padded, d**-0.5)
    want_out, want_lse = two_phase_decode_triton(q[:n], k, v, tables, lens, plan, d**-0.5)
    torch.testing.assert_close(out[:n], want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:n], want_lse, atol=1e-5, rtol=1e-5)
    assert bool((out[n:] == 0).all()) and bool(torch.isinf(lse[n:]).all())
