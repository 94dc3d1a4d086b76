"""Cache fusion on the default model: exactness where it must be exact, and what it approximates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ragfuse.engine import SamplingParams
from ragfuse.engine.config import RopeConfig
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.engine.fusion.stale_shift import (
    QUESTION_WINDOW,
    MassCap,
    ShiftIndex,
    begin_k_mass_cap,
    question_rows,
    segment_bounds,
    segment_shift,
)
from ragfuse.engine.layers import RotaryEmbedding
from ragfuse.kernels.paged_attention import attention_with_lse
from ragfuse.kernels.question_attention import question_attention_ref
from ragfuse.kernels.rope import apply_rope_ref
from ragfuse.shared_data import shared_data

DATA = shared_data("musique_dev.json")


@pytest.fixture(scope="module")
def rag_prompt(engine):
    """An instruction prefix, three stored passages of a real MuSiQue case (their first ~160 tokens,
    enough for reuse to be measurably approximate at a third of the full passages' prefill cost), and
    the question."""
    tok = engine.tokenizer
    ex = json.loads(DATA.read_text())[0]
    pre = tok.encode(
        "<|im_start|>system\nAnswer the question using the passages.<|im_end|>\n<|im_start|>user\n",
        add_special_tokens=False,
    )
    chunks = [tok.encode(f"{c['title']}\n{c['text'][:700]}\n\n", add_special_tokens=False) for c in ex["ctxs"][:3]]
    question = tok.encode(f"Question: {ex['question']}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    kvs = engine.compute_kv([pre, *chunks])
    segs = [Segment(pre, TensorKV(*kvs[0]))]
    segs += [Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, kvs[1:], strict=True)]
    segs.append(Segment(question))
    return segs


def test_compute_kv_after_a_context_keeps_only_the_lists_kv(engine):
    """KV computed after context tokens is the lists' part of the context+list sequence, batched or
    not, and differs from the list computed alone (the point of computing it after the context)."""
    tok = engine.tokenizer
    context = tok.encode("You answer questions about canals.", add_special_tokens=False)
    lists = [tok.encode(t, add_special_tokens=False) for t in
             ("The Marrow Canal opened in 1822.", "Agnes Voll designed it after a long journey through the hills.")]
    batched = engine.compute_kv(lists, context=context)
    for toks, (k, v) in zip(lists, batched, strict=True):
        (k_all, v_all), = engine.compute_kv([context + toks])
        assert k.shape[1] == len(toks) and k.is_contiguous()
        assert torch.allclose(k, k_all[:, len(context):], atol=1e-5)
        assert torch.allclose(v, v_all[:, len(context):], atol=1e-5)
        (k_alone, _), = engine.compute_kv([toks])
        assert not torch.allclose(k[1:], k_alone[1:], atol=1e-3)  # later layers see the context


def fused_logits(engine, segs, mode, policy=None):
    table: list[int] = []
    n = sum(len(s.token_ids) for s in segs)
    engine.blocks.grow(table, n)
    try:
        logits, stats = engine.runner.fused_prefill(table, segs, mode, policy or SelectionPolicy())
    finally:
        engine.blocks.release(table)
    return logits.log_softmax(-1), stats


def kl(p_log, q_log):
    return torch.nn.functional.kl_div(q_log, p_log, log_target=True, reduction="sum").item()


def test_full_and_fuse_at_ratio_one_equal_plain_prefill(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    full, st_full = fused_logits(engine, rag_prompt, "full")
    assert (full - ref).abs().max().item() == 0.0
    assert st_full.stored_tokens == 0
    every, st = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy(ratio=1.0))
    assert (every - ref).abs().max().item() < 1e-4
    assert st.recompute_ratio == 1.0 and st.reused_tokens == len(rag_prompt[0].token_ids)
    # recomputing every chunk, fusion loads only the exact prefix's stored KV, not the chunks' it would discard
    assert st.stored_tokens == len(rag_prompt[0].token_ids)


class _BlockingKV:
    """Stored KV in memory that says its reads block, as a disk's or Redis's do, and notes each
    layer read."""

    tier = "disk"
    blocking = True

    def __init__(self, kv: TensorKV) -> None:
        self.kv = kv
        self.read: list[int] = []

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(layer)
        return self.kv.load_layer(layer)


@pytest.mark.parametrize("mode", ["prefix", "reuse", "fuse"])
def test_blocking_sources_have_layer_zero_computed_not_read(engine, rag_prompt, mode):
    """Where stored KV comes from a blocking tier, the pass computes layer 0's KV from the tokens
    instead of waiting for its read: the same logits as reading it, and layer 0 never read."""
    want, _ = fused_logits(engine, rag_prompt, mode)
    segs = [Segment(s.token_ids, _BlockingKV(s.kv) if isinstance(s.kv, TensorKV) else None) for s in rag_prompt]
    got, stats = fused_logits(engine, segs, mode)
    assert (got - want).abs().max() < 1e-4
    read = [s.kv.read for s in segs if s.kv is not None]
    layers = list(range(1, engine.runner.model.config.num_layers))
    assert [sorted(r) for r in read] == [layers] * (1 if mode == "prefix" else len(read)) + [[]] * (
        len(read) - 1 if mode == "prefix" else 0)
    assert stats.stored_tokens == sum(len(s.token_ids) for s in segs[: 1 if mode == "prefix" else -1])


def test_prefix_mode_reuses_the_exact_prefix(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    got, st = fused_logits(engine, rag_prompt, "prefix")
    assert (got - ref).abs().max().item() < 1e-4
    assert st.reused_tokens == len(rag_prompt[0].token_ids) and st.recomputed_tokens == 0


def test_quality_improves_with_the_recompute_ratio(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    reuse, st = fused_logits(engine, rag_prompt, "reuse")
    assert st.recomputed_tokens == 0 and st.computed_tokens == len(rag_prompt[-1].token_ids)
    kls = [kl(ref, reuse)]
    for r in (0.15, 0.5):
        got, st = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy(ratio=r))
        assert abs(st.recompute_ratio - r) < 0.01
        assert st.active_per_layer[-1] == st.recomputed_tokens + st.computed_tokens
        kls.append(kl(ref, got))
    assert kls[0] > 0.01  # reuse without recompute really is approximate here
    assert kls[0] > kls[1] > kls[2]


def test_fuse_at_ratio_zero_is_reuse(engine, rag_prompt):
    """Recomputing 0% of the stored tokens is full reuse, exactly, and costs what reuse costs."""
    reuse, st_reuse = fused_logits(engine, rag_prompt, "reuse")
    for policy in (SelectionPolicy.default().with_ratio(0.0), SelectionPolicy.paper(0.0)):
        got, st = fused_logits(engine, rag_prompt, "fuse", policy)
        assert (got - reuse).abs().max().item() == 0.0
        assert st.recomputed_tokens == 0 and st.active_per_layer == st_reuse.active_per_layer


def cache_pages(engine, segs, mode, policy=None):
    """(K, V) the fused prefill leaves in the cache [layers, tokens, ...], and its stats."""
    n = sum(len(s.token_ids) for s in segs)
    table: list[int] = []
    engine.blocks.grow(table, n)
    try:
        _, stats = engine.runner.fused_prefill(table, segs, mode, policy or SelectionPolicy())
        k, v = engine.runner.kv_cache.gather(table, n)
        return k.clone(), v.clone(), stats
    finally:
        engine.blocks.release(table)


def test_dropped_candidates_get_their_stored_kv_back(engine, rag_prompt):
    """With ``revert_dropped`` a check layer's fresh KV stays only for the tokens it keeps: every
    stored token left out of the recompute holds its stored KV at every layer from the check on, as
    in full reuse; without it the check layer keeps every token's fresh KV."""
    k_reuse, v_reuse, _ = cache_pages(engine, rag_prompt, "reuse")
    policy = SelectionPolicy(ratio=0.15, check_layers=(2,), revert_dropped=True)
    k, v, st = cache_pages(engine, rag_prompt, "fuse", policy)
    chosen = st.recomputed_positions.tolist()
    assert len(chosen) == st.recomputed_tokens > 0
    first = len(rag_prompt[0].token_ids)  # the exact prefix is never a candidate
    stale = torch.ones(k.shape[1], dtype=torch.bool)
    stale[chosen] = False
    stale[-len(rag_prompt[-1].token_ids):] = stale[:first] = False
    assert (k[2:, stale] - k_reuse[2:, stale]).abs().max().item() < 1e-5
    assert (v[2:, stale] - v_reuse[2:, stale]).abs().max().item() < 1e-5
    assert (v[1:2, stale] - v_reuse[1:2, stale]).abs().max().item() > 1e-2  # before the check: all fresh
    k_all, v_all, _ = cache_pages(engine, rag_prompt, "fuse", SelectionPolicy(ratio=0.15, check_layers=(2,)))
    assert (v_all[2:3, stale] - v_reuse[2:3, stale]).abs().max().item() > 1e-2


def test_one_check_layer_selections_are_nested(engine, rag_prompt):
    """With one check layer the ranking does not depend on the ratio (every token is computed up to
    it), so a token recomputed at r stays recomputed at any larger r."""
    picked = []
    for r in (0.05, 0.15, 0.3):
        _, st = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy.paper(r))
        picked.append(set(st.recomputed_positions.tolist()))
    assert picked[0] < picked[1] < picked[2]


@pytest.mark.parametrize("k_share", [0.5, 0.25, 0.0])
def test_stale_shift_moves_each_segment_by_its_share_of_mean_deviation(k_share):
    """Two stored segments of 3 rows; the active rows are stored rows 1, 2 (segment 0) and 4 (segment
    1), plus a row without stored KV (the spare segment 2, which must shift nothing). V's share is
    0.5, K's its own."""
    k_st, v_st = torch.zeros(6, 1, 2), torch.ones(6, 1, 2)
    k_new = torch.tensor([[[2.0, 0.0]], [[4.0, 0.0]], [[0.0, 6.0]], [[9.0, 9.0]]])
    v_new = torch.ones(4, 1, 2) * torch.tensor([3.0, 5.0, 1.0, 9.0])[:, None, None]
    index = ShiftIndex(torch.tensor([k_share, 0.5]), torch.tensor([1, 2, 4, 0]), torch.tensor([0, 0, 1, 2]),
                       torch.tensor([0, 0, 0, 1, 1, 1]), 3)
    mk, mv, segment = segment_shift(index, k_new, v_new, k_st, v_st)
    k, v = k_st + mk.index_select(0, segment), v_st + mv.index_select(0, segment)
    assert torch.equal(k[:3, 0], torch.tensor([[3.0 * k_share, 0.0]] * 3))  # mean (3, 0), K's share of it
    assert torch.equal(k[3:, 0], torch.tensor([[0.0, 6.0 * k_share]] * 3))
    assert torch.equal(v[:3, 0], torch.full((3, 2), 2.5)) and torch.equal(v[3:, 0], torch.ones(3, 2))


def _mass_case(seed: int):
    """Random queries and stored K of 2 KV heads x 2 query heads, three stored segments (4, 3, 5
    rows) and the spare, at scattered positions, and a K shift per segment."""
    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(8, RopeConfig(), 256)
    at = torch.tensor([3, 4, 5, 6, 20, 21, 22, 40, 41, 42, 43, 44])
    segment = torch.tensor([0] * 4 + [1] * 3 + [2] * 5)
    k_st = torch.randn(12, 2, 8, generator=g)
    q = apply_rope_ref(torch.randn(6, 4, 8, generator=g), torch.arange(60, 66), rotary.cos, rotary.sin)
    mk = torch.randn(4, 2, 8, generator=g) * 2.0
    mk[3] = 0.0  # the spare shifts nothing
    return rotary, at, segment, k_st, q, mk


def _mass_move(q, k_st, at, rotary, scale, segment, s, g, delta):
    """The question's mean (over its tokens and KV head g's query heads) log attention mass on
    segment s, with ``delta`` added to its K before RoPE: the quantity the cap bounds the change of."""
    rows = (segment == s).nonzero().flatten()
    k = apply_rope_ref((k_st[rows] + delta).float(), at[rows], rotary.cos, rotary.sin)[:, g]
    qg = q[:, 2 * g : 2 * g + 2]  # KV head g's query heads
    return (torch.einsum("jhd,td->jht", qg, k) * scale).logsumexp(-1).mean()


@pytest.mark.parametrize("limit", [0.05, 0.5, 1e6])
def test_k_mass_cap_bounds_the_question_mass_move_of_each_segment_and_head(limit):
    """The move ``begin_k_mass_cap``'s capper caps is the first-order change of the question's log attention mass on
    a segment (checked here by a finite difference of the mass itself); after the cap no segment and
    KV head moves more than ``limit``, the ones under it keep their shift, and only along the
    direction of the move: the shift's component across it is untouched."""
    rotary, at, segment, k_st, q, mk = _mass_case(0)
    scale = 8 ** -0.5
    bounds = torch.from_numpy(segment_bounds(segment.numpy(), 4))
    cap = MassCap(torch.tensor([limit]), torch.arange(2, 6), torch.ones(4, dtype=torch.bool), bounds)  # last 4 rows
    index = ShiftIndex(torch.tensor([0.5, 0.5]), torch.zeros(6, dtype=torch.long), torch.full((6,), 3),
                       segment, 4, cap)
    capped = begin_k_mass_cap(index, q, k_st, at, rotary, scale)(mk)
    qq = q[2:]
    for s in range(3):
        for g in range(2):
            eps = 1e-3
            base = _mass_move(qq, k_st, at, rotary, scale, segment, s, g, 0.0)
            grad = torch.stack([(_mass_move(qq, k_st, at, rotary, scale, segment, s, g, eps * e) - base) / eps
                                for e in torch.eye(8)])
            move, after = float(grad @ mk[s, g]), float(grad @ capped[s, g])
            assert abs(after) <= limit + 1e-2 * max(1.0, abs(move))
            if abs(move) <= limit * 0.99:
                assert torch.allclose(capped[s, g], mk[s, g])
            else:
                assert after == pytest.approx(limit if move > 0 else -limit, rel=2e-2, abs=2e-3)
                cut = mk[s, g] - capped[s, g]
                assert abs(float(cut @ grad)) / float(cut.norm() * grad.norm()) > 0.999  # along the move only
    assert torch.equal(capped[3], mk[3])
    if limit > 1e5:
        assert torch.equal(capped, mk)


def test_k_mass_cap_reads_only_the_real_question_rows():
    """A graph pads the question's rows to a fixed window: padded rows (``ok`` false, pointing at any
    row) change nothing."""
    rotary, at, segment, k_st, q, mk = _mass_case(1)
    share = torch.tensor([0.5, 0.5])

    def capped(rows, ok):
        cap = MassCap(torch.tensor([0.1]), torch.tensor(rows), torch.tensor(ok),
                      torch.from_numpy(segment_bounds(segment.numpy(), 4)))
        index = ShiftIndex(share, torch.zeros(6, dtype=torch.long), torch.full((6,), 3), segment, 4, cap)
        return begin_k_mass_cap(index, q, k_st, at, rotary, 8 ** -0.5)(mk)

    exact = capped([3, 4, 5], [True, True, True])
    padded = capped([3, 4, 5, 5, 0], [True, True, True, False, False])
    assert torch.allclose(exact, padded, atol=1e-6) and not torch.allclose(exact, mk)


def test_k_mass_cap_host_indices():
    """What a pass makes once on the host for the cap: each segment's run of stored rows (a segment
    without rows, here the second and the spare, gets an empty one), and per layer the question's
    last rows padded to the window by repeating the last row, the padding not counted."""
    assert segment_bounds(np.array([0, 0, 2, 2, 2, 3]), 5).tolist() == [0, 2, 2, 5, 6, 6]
    rows, ok = question_rows(np.array([10, 6]), 3)
    assert rows.shape == (2, QUESTION_WINDOW) and ok.tolist() == [True] * 3 + [False] * (QUESTION_WINDOW - 3)
    assert rows[0, :4].tolist() == [7, 8, 9, 9] and rows[1, :3].tolist() == [3, 4, 5] and (rows[1, 3:] == 5).all()
    long_rows, long_ok = question_rows(np.array([200]), 150)  # only the question's last QUESTION_WINDOW tokens
    assert long_ok.all() and long_rows[0].tolist() == list(range(200 - QUESTION_WINDOW, 200))
    assert question_rows(np.array([0]), 2)[0].min() == 0  # no row at all (a capture run): still a valid index


def test_policy_k_mass_cap_is_checked_and_needs_a_k_shift():
    assert SelectionPolicy.default().caps_k_mass()
    assert not SelectionPolicy(stale_shift=0.5, stale_shift_k=0.0, k_mass_cap=2.0).caps_k_mass()
    assert not SelectionPolicy(stale_shift=0.5).caps_k_mass()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="K mass cap"):
            SelectionPolicy(k_mass_cap=bad)


def test_fused_pass_applies_the_k_mass_cap(engine, rag_prompt):
    """The cap reaches the fused prefill: a cap too large to bind gives the uncapped pass's logits
    exactly, a tight one other logits."""
    from dataclasses import replace

    policy = SelectionPolicy.default()
    off, _ = fused_logits(engine, rag_prompt, "fuse", replace(policy, k_mass_cap=0.0))
    loose, _ = fused_logits(engine, rag_prompt, "fuse", replace(policy, k_mass_cap=1e6))
    tight, _ = fused_logits(engine, rag_prompt, "fuse", replace(policy, k_mass_cap=0.01))
    assert torch.equal(off, loose)
    assert not torch.allclose(off, tight, atol=1e-4)


def test_the_tail_of_the_passage_nearest_the_question_is_always_recomputed_within_the_budget(engine, rag_prompt):
    """``tail_tokens``: the last tokens before the question's segment are recomputed whatever their
    deviation, and count toward the ratio; at ratio 0 they alone are (the pass is then no plain reuse)."""
    from dataclasses import replace

    plain = SelectionPolicy.default()
    ends = np.cumsum([len(s.token_ids) for s in rag_prompt])  # instruction, 3 passages, the question
    tail = set(range(int(ends[3]) - 20, int(ends[3])))
    _, chosen = fused_logits(engine, rag_prompt, "fuse", plain)
    _, forced = fused_logits(engine, rag_prompt, "fuse", replace(plain, tail_tokens=20))
    assert not tail <= set(chosen.recomputed_positions.tolist())
    assert tail <= set(forced.recomputed_positions.tolist())
    assert forced.recomputed_tokens == chosen.recomputed_tokens
    _, alone = fused_logits(engine, rag_prompt, "fuse", replace(plain, ratio=0.0, tail_tokens=20))
    assert set(alone.recomputed_positions.tolist()) == tail


def test_policy_gives_k_its_own_stale_shift_share_or_the_common_one():
    assert SelectionPolicy(stale_shift=0.5).shift_shares() == (0.5, 0.5)
    assert SelectionPolicy(stale_shift=0.5, stale_shift_k=0.0).shift_shares() == (0.0, 0.5)
    assert SelectionPolicy(stale_shift=0.0, stale_shift_k=0.3).shift_shares() == (0.3, 0.0)
    with pytest.raises(ValueError, match="K stale shift"):
        SelectionPolicy(stale_shift_k=1.5)


def test_default_policy_is_exact_at_the_ends_of_the_ratio_range(engine, rag_prompt):
    """The shipped policy (stale shift, reverted drops) still gives reuse at 0% and full at 100%."""
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    every, _ = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy.default().with_ratio(1.0))
    assert (every - ref).abs().max().item() < 1e-4
    reuse, _ = fused_logits(engine, rag_prompt, "reuse")
    none, _ = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy.default().with_ratio(0.0))
    assert (none - reuse).abs().max().item() == 0.0


def test_question_attention_is_the_tail_queries_mean_attention():
    torch.manual_seed(2)
    q, k = torch.randn(5, 6, 8), torch.randn(20, 2, 8)
    slots = torch.randperm(24)[:20]  # position p's key sits at slot slots[p] of 6 pages of 4
    k_cache = torch.zeros(24, 2, 8)
    k_cache[slots] = k
    got = question_attention_ref(q, k_cache.view(6, 4, 2, 8), slots, torch.arange(15, 20), torch.tensor(20), 0.3)
    ref = torch.zeros(20)
    for i in range(5):  # query i sits at position 15 + i and sees keys 0..15+i
        for h in range(6):
            ref[: 16 + i] += (0.3 * k[: 16 + i, h // 3] @ q[i, h]).softmax(0) / 30
    assert torch.allclose(got, ref, atol=1e-6) and abs(got.sum().item() - 1) < 1e-5


def test_fused_prefill_is_the_same_over_scattered_cache_blocks(engine, rag_prompt):
    """Consecutive blocks are read as one view, others through their slots: the pass must not care."""
    n = sum(len(s.token_ids) for s in rag_prompt)
    policy = SelectionPolicy.default()
    in_order, _ = fused_logits(engine, rag_prompt, "fuse", policy)
    table: list[int] = []
    engine.blocks.grow(table, n + 4 * engine.runner.kv_cache.block_size)
    try:
        scattered = list(reversed(table))[: -(-n // engine.runner.kv_cache.block_size)]
        logits, _ = engine.runner.fused_prefill(scattered, rag_prompt, "fuse", policy)
    finally:
        engine.blocks.release(table)
    assert torch.allclose(logits.log_softmax(-1), in_order, atol=1e-4)


def test_stored_keys_are_rotated_to_their_real_offset(engine, rag_prompt):
    """Layer 0's K depends only on the token and its position, so a stored chunk moved to offset p
    must hold exactly the keys that full prefill computes at p."""
    ids = [t for s in rag_prompt for t in s.token_ids]
    table: list[int] = []
    engine.blocks.grow(table, len(ids))
    try:
        engine.runner.fused_prefill(table, rag_prompt, "reuse", SelectionPolicy())
        fused_k, _ = engine.runner.kv_cache.gather(table, len(ids))
        fused_k0 = fused_k[0].clone()
    finally:
        engine.blocks.release(table)
    table = []
    engine.blocks.grow(table, len(ids))
    try:
        engine.runner.fused_prefill(table, rag_prompt, "full", SelectionPolicy())
        full_k, _ = engine.runner.kv_cache.gather(table, len(ids))
    finally:
        engine.blocks.release(table)
    assert (fused_k0 - full_k[0]).abs().max().item() < 1e-4


def test_scattered_query_positions_get_an_exact_causal_mask():
    torch.manual_seed(0)
    q = torch.randn(30, 4, 16)
    k, v = torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    full_out, full_lse = attention_with_lse(q, k, v, 0.25, 0)
    pick = torch.tensor([0, 3, 4, 17, 29])
    out, lse = attention_with_lse(q[pick], k, v, 0.25, 0, q_positions=pick)
    assert torch.allclose(out, full_out[pick], atol=1e-5) and torch.allclose(lse, full_lse[pick], atol=1e-5)


def test_many_scattered_queries_match_full_causal_attention():
    """Blocks of scattered queries (unmasked keys before each block, a small mask inside it) give
    exactly the rows of full causal attention, whether a block starts at position 0 or not."""
    torch.manual_seed(1)
    q = torch.randn(400, 9, 32)
    k, v = torch.randn(400, 3, 32), torch.randn(400, 3, 32)
    full_out, full_lse = attention_with_lse(q, k, v, 0.2, 0)
    pick = torch.cat([torch.tensor([0, 1]), torch.randperm(397)[:120].sort().values + 2, torch.arange(380, 400)])
    pick = pick.unique()
    out, lse = attention_with_lse(q[pick], k, v, 0.2, 0, q_positions=pick)
    assert torch.allclose(out, full_out[pick], atol=1e-5) and torch.allclose(lse, full_lse[pick], atol=1e-5)



@pytest.mark.parametrize("run", [(0, 90), (37, 300), (150, 400), (399, 400)])
def test_scattered_positions_forming_one_run_match_full_causal_attention(run):
    """Positions that happen to form one run (fusion's first layer) take the contiguous path: from
    position 0, after a prefix (query heads folded over its keys), or stopping short of the last key,
    or one last token (the decode path), the rows equal full attention's."""
    torch.manual_seed(2)
    q = torch.randn(400, 9, 32)
    k, v = torch.randn(400, 3, 32), torch.randn(400, 3, 32)
    full_out, full_lse = attention_with_lse(q, k, v, 0.2, 0)
    pick = torch.arange(*run)
    out, lse = attention_with_lse(q[pick], k, v, 0.2, 0, q_positions=pick)
    assert torch.allclose(out, full_out[pick], atol=1e-5) and torch.allclose(lse, full_lse[pick], atol=1e-5)

def test_decoding_continues_from_the_fused_cache(llm, rag_prompt):
    eng = llm.engine
    ids = [t for s in rag_prompt for t in s.token_ids]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = llm.generate([ids], params)[0].token_ids
    rid, stats = eng.add_fused_request(rag_prompt, params, mode="fuse", policy=SelectionPolicy(ratio=1.0))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out = o
    assert out is not None and out.finished and out.token_ids == plain
    assert eng.blocks.num_free == eng.blocks.num_blocks
