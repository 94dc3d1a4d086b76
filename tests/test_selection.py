"""Which stored tokens cache fusion recomputes: the policy's funnel, the deviation ranking, and the
fusor following the planned active-set sizes layer by layer."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.fusion.selection import deviation, keep_count, keep_rows
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


def test_keep_rows_keeps_the_must_rows_then_the_largest_deviations_in_ascending_order():
    dev = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.0, 0.5, float("nan")])
    must = torch.tensor([False, False, False, False, True, False, True])  # row 6: no stored KV, its deviation unread
    assert keep_rows(dev, must, 4).tolist() == [1, 3, 4, 6]
    assert keep_rows(dev[:6], torch.zeros(6, dtype=torch.bool), 3).tolist() == [1, 3, 5]
    assert keep_rows(dev, must, 7).tolist() == list(range(7))
    assert keep_count(0.15, 100) == 15 and keep_count(1.0, 7) == 7


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
