"""Which stored tokens cache fusion recomputes: the policy's funnel, the deviation ranking, and the
fusor following the planned active-set sizes layer by layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.fusion.selection import check_keep, deviation, keep_count, true_indices
from ragfuse.kernels.question_attention import question_attention_ref
from tests.test_fusion import fused_logits, rag_prompt  # noqa: F401 (rag_prompt is a fixture)


def test_shipped_funnel_narrows_evenly_from_three_r_to_r():
    pol = SelectionPolicy.default()
    shares = [pol.keep_share(i) for i in range(len(pol.check_layers))]
    assert pol.check_layers == (1, 2, 3, 4, 5)
    assert shares == pytest.approx([0.45, 0.375, 0.3, 0.225, 0.15])
    assert pol.with_ratio(0.5).keep_share(0) == 1.0  # capped: never more than every token


def test_paper_baseline_is_one_check_layer_on_v():
    pol = SelectionPolicy.paper(0.2)
    assert (pol.check_layers, pol.metric, pol.keep_share(0)) == ((1,), "v", pytest.approx(0.2))
    assert pol != SelectionPolicy.default().with_ratio(0.2)


@pytest.mark.parametrize("bad", [dict(ratio=1.5), dict(metric="q"), dict(check_layers=(0, 1)), dict(check_layers=())])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        SelectionPolicy(**bad)


def test_deviation_ranks_by_the_chosen_part_of_the_kv():
    torch.manual_seed(0)
    k, v = torch.randn(6, 3, 8), torch.randn(6, 3, 8)
    k2, v2 = k.clone(), v.clone()
    k2[1] += 5.0  # token 1's K moved
    v2[4] += 5.0  # token 4's V moved
    assert deviation("v", k2, v2, k, v).argmax() == 4 and deviation("v", k2, v2, k, v)[1] == 0
    assert deviation("k", k2, v2, k, v).argmax() == 1 and deviation("k", k2, v2, k, v)[4] == 0
    both = deviation("kv", k2, v2, k, v)
    assert both[1] > 0 and both[4] > 0 and (both[[0, 2, 3, 5]] == 0).all()


def test_check_keep_keeps_the_must_rows_then_the_largest_deviations_in_ascending_order():
    torch.manual_seed(0)
    k_st, v_st = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    rows = torch.tensor([0, 1, 2, 3, 4, 0])  # row 5 (position 6): the question, no stored KV
    positions = torch.tensor([1, 2, 3, 4, 5, 6])
    v_new = v_st[rows].clone()
    v_new[1] += 3.0
    v_new[3] += 2.0
    v_new[4] += 1.0
    v_new[5] += 9.0  # compared with a placeholder row: must-keep anyway
    must_keep = torch.tensor([False, False, False, False, False, True, True])  # position 5 forced in, 6 the question
    keep = check_keep("v", 0.0, (k_st[rows], v_new), (k_st, v_st), rows, positions, must_keep, None, 4, 4)
    assert keep.tolist() == [1, 3, 4, 5]  # positions 2, 4 (largest deviations), 5 (forced), 6 (question)
    assert check_keep("v", 0.0, (k_st[rows], v_new), (k_st, v_st), rows, positions, must_keep, None, 6, 6).tolist() \
        == list(range(6))
    assert keep_count(0.15, 100) == 15 and keep_count(1.0, 7) == 7


@pytest.mark.parametrize("metric", ["v", "k", "kv"])
def test_check_keep_with_padding_and_a_device_count_keeps_what_the_exact_call_keeps(metric):
    """A check layer's CUDA graph runs the selection over capacities: padded rows (marked invalid,
    deviating wildly), ``total`` rounded up and the real count as a tensor; it must keep the rows the
    exact call keeps, then padding markers (one past any row)."""
    torch.manual_seed(1)
    a, pad, stored = 40, 24, 50
    k_st, v_st = torch.randn(stored, 2, 8), torch.randn(stored, 2, 8)
    rows = torch.randperm(stored)[:a]
    positions = torch.arange(3, 3 + a)
    k_new, v_new = k_st[rows] + torch.randn(a, 2, 8), v_st[rows] + torch.randn(a, 2, 8)
    must_keep = torch.rand(80) < 0.2
    weight = torch.rand(80)
    exact = check_keep(metric, 0.1, (k_new, v_new), (k_st, v_st), rows, positions, must_keep, weight, 25, 25)
    noise = (torch.randn(pad, 2, 8) * 100, torch.randn(pad, 2, 8) * 100)
    padded = check_keep(metric, 0.1, (torch.cat([k_new, noise[0]]), torch.cat([v_new, noise[1]])), (k_st, v_st),
                        torch.cat([rows, torch.zeros(pad, dtype=torch.long)]),
                        torch.cat([positions, torch.zeros(pad, dtype=torch.long)]), must_keep, weight, 32,
                        torch.tensor(25), torch.arange(a + pad) < a)
    assert padded[:25].tolist() == exact.tolist() and (padded[25:] == a + pad).all()


def test_question_attention_over_padded_queries_and_keys_equals_the_exact_one():
    """A CUDA graph's capacities: padding queries (any values, marked invalid) count for nothing and
    padding positions past the real length get no attention."""
    torch.manual_seed(2)
    n, m = 30, 4
    q, k_cache = torch.randn(m, 4, 8), torch.randn(10, 4, 2, 8)
    slots = torch.randperm(40)
    exact = question_attention_ref(q, k_cache, slots[:n], torch.arange(n - m, n), torch.tensor(n), 0.3)
    q_pad = torch.cat([q, torch.full((3, 4, 8), float("nan"))])  # padding queries may hold anything
    q_pos = torch.tensor([26, 27, 28, 29, n - 1, n - 1, n - 1])
    padded = question_attention_ref(q_pad, k_cache, slots, q_pos, torch.tensor(n), 0.3, torch.arange(7) < m)
    torch.testing.assert_close(padded[:n], exact)
    assert (padded[n:] == 0).all()


def test_fusor_follows_the_funnel_layer_by_layer(engine, rag_prompt):  # noqa: F811
    """Layer 0 runs every token but the exact prefix (its stored KV is what full prefill computes);
    each check layer computes K/V for its active tokens, keeps that
    check's share of the stored ones (plus the always-computed tokens) and runs attention and MLP
    for those only; after the last check the set stays at r to the last layer."""
    pol = SelectionPolicy.default().with_ratio(0.1)
    _, st = fused_logits(engine, rag_prompt, "fuse", pol)
    fusable = st.stored_tokens - len(rag_prompt[0].token_ids)  # the exact prefix is never a candidate
    want = [keep_count(pol.keep_share(i), fusable) + st.computed_tokens for i in range(5)]
    layers = st.active_per_layer
    assert layers[0] == fusable + st.computed_tokens
    assert layers[1:6] == want and layers[6:] == [want[-1]] * (len(layers) - 6)
    assert st.recomputed_tokens == keep_count(0.1, fusable)


def test_true_indices_are_ascending_and_padded_with_fill():
    mask = torch.tensor([False, True, True, False, False, True, False])
    assert true_indices(mask, 3).tolist() == [1, 2, 5]
    assert true_indices(mask, 5, fill=7).tolist() == [1, 2, 5, 7, 7]
    assert true_indices(torch.zeros(4, dtype=torch.bool), 2, fill=-1).tolist() == [-1, -1]


def test_pass_indices_reach_the_device_whole_in_one_buffer():
    """The fusor's one-transfer packing: every array comes back with its dtype, shape and values,
    a scalar as a 0-d tensor, an empty one empty; the int64 ones share one buffer."""
    from ragfuse.engine.fusion.fusor import _to_device

    arrays = {"a": np.arange(5), "mask": np.array([True, False, True]), "t": np.arange(6, dtype=np.int32).reshape(2, 3),
              "share": np.float32(0.5), "none": np.arange(0), "b": np.arange(7, 10)}
    out = _to_device(torch.device("cpu"), arrays)
    for name, want in arrays.items():
        got = out[name]
        assert got.shape == np.shape(want) and got.numpy().dtype == np.asarray(want).dtype
        assert np.array_equal(got.numpy(), want)
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
