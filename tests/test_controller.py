"""The loading controller on synthetic delay profiles: the decisions of CacheBlend section 5.1."""

from __future__ import annotations

import json

import pytest

from ragfuse.engine.kvstore import DelayProfile, KVStoreError, LoadingController, profile_path

KV_PER_TOKEN = 128 * 1024  # Mistral-7B, bf16
GB = 1e9


# a fused pass's time as a share of a full prefill's: 10% with nothing recomputed (the check layers and
# the query), 25% at 15%, 60% at 50%, all at 100%
CURVE = [(0.0, 0.1), (0.15, 0.25), (0.5, 0.6), (1.0, 1.0)]


def profile(curve: list[tuple[float, float]] = CURVE, **bandwidth_gbs: float) -> DelayProfile:
    # full prefill: 0.1 ms/token up to 1000 tokens, then 0.2 ms/token (a convex curve); the recompute
    # curve measured over 2000 stored tokens
    return DelayProfile(model="m", device="cuda", dtype="bfloat16", kv_bytes_per_token=KV_PER_TOKEN,
                        prefill_points=[(1000, 0.1), (2000, 0.3)],
                        recompute_points=[(2000, r, f) for r, f in curve],
                        bandwidth={k: v * GB for k, v in bandwidth_gbs.items()})


def test_prefill_interpolates_and_extrapolates():
    p = profile(cpu=10)
    assert p.prefill_s(500) == pytest.approx(0.05)
    assert p.prefill_s(1500) == pytest.approx(0.2)
    assert p.prefill_s(3000) == pytest.approx(0.5)  # last slope carried on
    assert p.load_s(1000, "cpu") == pytest.approx(1000 * KV_PER_TOKEN / (10 * GB))


def test_recompute_follows_the_measured_curve_not_ratio_times_prefill():
    p = profile(cpu=10)
    assert p.recompute_s(0.0, 2000) == pytest.approx(0.03)  # 10% of 0.3 s: the pass's fixed part
    assert p.recompute_s(0.15, 2000) == pytest.approx(0.075)
    assert p.recompute_s(0.325, 2000) == pytest.approx(0.425 * 0.3)  # halfway between 15% and 50%
    assert p.ratio_for(0.425 * 0.3, 2000) == pytest.approx(0.325)
    assert p.ratio_for(0.01, 2000) == 0.0 and p.ratio_for(0.5, 2000) == 1.0


def test_a_dip_in_the_curve_is_not_taken_for_a_faster_pass():
    """A scattered pass at 50% measured slower than recomputing all (as on an H200): the model keeps
    the curve monotone, so no ratio past 50% is estimated faster than 50%."""
    p = profile([(0.0, 0.1), (0.5, 0.9), (1.0, 0.85)], cpu=10)
    assert p.recompute_s(1.0, 2000) == pytest.approx(0.9 * 0.3)
    assert p.recompute_s(0.75, 2000) == pytest.approx(0.9 * 0.3)
    assert p.ratio_for(0.88 * 0.3, 2000) == pytest.approx(0.5 * 0.78 / 0.8)


def test_the_curve_follows_the_stored_length_between_measured_ones():
    """Fixed costs weigh more in short prompts: curves measured at 500 and 2000 tokens are interpolated
    between them, and the nearest one holds outside them."""
    p = DelayProfile(model="m", device="cpu", dtype="float32", kv_bytes_per_token=KV_PER_TOKEN,
                     prefill_points=[(1000, 0.1), (2000, 0.3)],
                     recompute_points=[(500, 0.0, 0.3), (500, 1.0, 1.0), (2000, 0.0, 0.1), (2000, 1.0, 0.9)])
    assert p.recompute_s(0.0, 1250) == pytest.approx(0.2 * p.prefill_s(1250))
    assert p.recompute_s(1.0, 1250) == pytest.approx(0.95 * p.prefill_s(1250))
    assert p.recompute_s(0.0, 100) == pytest.approx(0.3 * p.prefill_s(100))
    assert p.recompute_s(0.5, 4000) == pytest.approx(0.5 * p.prefill_s(4000))
    with pytest.raises(KVStoreError, match="same ratios at every length"):
        DelayProfile(model="m", device="cpu", dtype="float32", kv_bytes_per_token=1, prefill_points=[(1, 1.0)],
                     recompute_points=[(500, 0.0, 0.3), (500, 1.0, 1.0), (2000, 0.0, 0.1), (2000, 0.5, 0.5),
                                       (2000, 1.0, 0.9)])


@pytest.mark.parametrize("curve", [[], [(0.0, 0.1)], [(0.1, 0.2), (1.0, 1.0)], [(0.0, 0.1), (0.9, 0.8)],
                                   [(0.0, 0.1), (0.6, 0.7), (0.5, 0.6), (1.0, 1.0)], [(0.0, 0.0), (1.0, 1.0)]])
def test_a_curve_that_does_not_span_0_to_1_in_order_is_refused(curve):
    with pytest.raises(KVStoreError, match="recompute (curve|point)"):
        profile(curve, cpu=10)


def test_fast_tier_recomputes_r_star():
    c = LoadingController(profile(cpu=20))
    d = c.decide(2000, "cpu")
    assert d.t_load_s == pytest.approx(2000 * KV_PER_TOKEN / (20 * GB))  # 13 ms
    assert d.r_balanced == 0.0  # the load hides behind even a pass recomputing nothing (30 ms)
    assert d.recompute_ratio == 0.15 and "hides behind" in d.reason
    assert d.ttft_estimate_s == pytest.approx(0.25 * 0.3)  # the curve's 15% point, not 0.15 x 0.3


def test_slow_tier_raises_ratio_to_balance_load():
    c = LoadingController(profile(disk=2))  # 2000 tokens: 131 ms to load vs 300 ms full prefill
    d = c.decide(2000, "disk")
    assert d.t_recompute_s == pytest.approx(d.t_load_s)  # recompute exactly as long as loading
    assert 0.15 < d.recompute_ratio < d.t_load_s / 0.3  # less than ratio x prefill would take: the fixed part
    assert d.recompute_ratio == pytest.approx(0.15 + (d.t_load_s / 0.3 - 0.25))  # the curve's slope is 1 there


def test_tier_slower_than_prefill_recomputes_all():
    d = LoadingController(profile(disk=0.5)).decide(2000, "disk")
    assert d.recompute_ratio == 1.0 and "recompute all" in d.reason
    assert d.ttft_estimate_s == pytest.approx(0.3) and d.t_load_s > 0.5  # nothing loaded but the exact prefix


def test_choose_cheapest_tier_that_hides_behind_r_star():
    # budget at r* for 2000 tokens: 75 ms; loads: gpu 0.3 ms, cpu 10 ms, disk 87 ms, redis 26 ms
    c = LoadingController(profile(gpu=900, cpu=25, disk=3, redis=10))
    d = c.choose_tier(2000)
    fits = {e.tier: e.hides_behind_recompute for e in d.estimates}
    assert fits == {"gpu": True, "cpu": True, "disk": False, "redis": True}
    assert d.tier == "redis"  # cheaper than cpu and gpu; disk is cheapest but too slow
    assert d.recompute_ratio == 0.15
    cheap_disk = LoadingController(profile(gpu=900, cpu=25, disk=3, redis=10), cost_per_gb_hour={"redis": 1.0})
    assert cheap_disk.choose_tier(2000).tier == "cpu"


def test_longer_context_lets_a_slower_tier_fit():
    c = LoadingController(profile(cpu=25, disk=3.2))
    assert c.choose_tier(2000).tier == "cpu"  # disk load 82 ms > 75 ms budget
    assert c.choose_tier(4000).tier == "disk"  # budget grows faster (convex prefill): 164 ms < 175 ms


def test_no_tier_fits_picks_fastest():
    d = LoadingController(profile(disk=0.5, redis=1)).choose_tier(2000)
    assert d.tier == "redis" and "fastest" in d.reason and d.recompute_ratio > 0.15


def test_r_star_configurable_and_validated():
    assert LoadingController(profile(cpu=20), r_star=0.3).decide(2000, "cpu").recompute_ratio == 0.3
    with pytest.raises(KVStoreError):
        LoadingController(profile(cpu=20), r_star=0)
    with pytest.raises(KVStoreError, match="no bandwidth"):
        LoadingController(profile(cpu=20)).decide(100, "disk")


def test_profile_roundtrip(tmp_path):
    p = profile(cpu=20, disk=3)
    path = p.save(profile_path(tmp_path, p.model, p.device, p.dtype))
    assert DelayProfile.load(path) == p
    assert profile_path(tmp_path, "m", "cpu", "float32") != path


def test_a_profile_without_a_recompute_curve_is_refused_with_what_to_do(tmp_path):
    """Profiles made before the curve was measured hold none: reading one says to profile again."""
    path = tmp_path / "old.json"
    d = json.loads(profile(cpu=20).save(path).read_text())
    del d["recompute_points"]
    path.write_text(json.dumps(d))
    with pytest.raises(KVStoreError, match=r"no 'recompute_points'.*run `ragfuse profile` again"):
        DelayProfile.load(path)
    path.write_text(json.dumps({**d, "recompute_points": [[2000, 0.0, 0.2]]}))
    with pytest.raises(KVStoreError, match="recompute curve needs increasing ratios"):
        DelayProfile.load(path)


@pytest.mark.parametrize("edit", [
    {"prefill_points": [[1000, 0.1], [2000, "fast"]]}, {"prefill_points": [[1000]]}, {"prefill_points": []},
    {"prefill_points": [[1000, -0.1]]}, {"kv_bytes_per_token": "46080"}, {"kv_bytes_per_token": None},
    {"bandwidth": {"cpu": "2e9"}}, {"bandwidth": {"cpu": 0}}, {"bandwidth": {"cpu": -2e9}}, {"bandwidth": [1, 2]},
    {"recompute_points": [[2000, 0.0, 0.1], [2000, 1.0, float("inf")]]}, {"schema": 2}, {"model": ["m"]},
])
def test_a_damaged_profile_is_refused_where_it_is_read(tmp_path, edit):
    """Each of these crashed a request later (a TypeError, a ZeroDivisionError) or steered it with a
    negative time: loading refuses them all with one message saying what to do."""
    path = tmp_path / "p.json"
    d = json.loads(profile(cpu=20).save(path).read_text())
    path.write_text(json.dumps({**d, **edit}))
    with pytest.raises(KVStoreError, match=r"is unusable \(.+\): run `ragfuse profile` again"):
        DelayProfile.load(path)


def test_a_slow_tier_loads_only_the_first_pieces_where_that_answers_sooner():
    """Four pieces of 500 tokens, the first an exact prefix, from a tier that loads all of them in 262 ms
    (a 300 ms full prefill, 75 ms at r*): loading all is load-bound at 262 ms, recomputing all takes
    300 ms, and loading three while the fourth is computed takes 197 ms (their load, with the loaded
    ones' ratio raised to fill it), the best split (two: 232 ms of compute)."""
    c = LoadingController(profile(disk=1))
    whole = c.decide(2000, "disk")
    d = c.decide(2000, "disk", sources=[500] * 4, exact_prefix=True)
    assert whole.loaded_sources is None and whole.ttft_estimate_s == pytest.approx(2000 * KV_PER_TOKEN / GB)
    assert d.loaded_sources == 3 and "the first 3 load" in d.reason
    assert d.t_load_s == pytest.approx(1500 * KV_PER_TOKEN / GB)
    assert d.ttft_estimate_s == pytest.approx(d.t_load_s) == pytest.approx(0.75 * whole.ttft_estimate_s)
    assert d.t_recompute_s == pytest.approx(d.t_load_s)  # the loaded pieces' ratio fills their load
    # two of the three fusable pieces loaded at ratio r, the third computed: the pass recomputes
    # 1 - (1 - r) x 2/3 of the stored tokens, which the curve says takes as long as the load
    assert c.t_recompute(1 - (1 - d.recompute_ratio) * 2 / 3, 2000) == pytest.approx(d.t_load_s)
    assert 0.15 < d.recompute_ratio < whole.recompute_ratio
    assert c.decide(2000, "disk", sources=[500] * 4).loaded_sources == 3  # no exact prefix: 3 of 4 fused


def test_pieces_whose_whole_load_hides_or_is_hopeless_are_all_loaded_or_recomputed():
    fast = LoadingController(profile(cpu=20)).decide(2000, "cpu", sources=[500] * 4, exact_prefix=True)
    assert fast.loaded_sources is None and fast.recompute_ratio == 0.15
    # each piece loads slower than the whole prompt recomputes: nothing but the exact prefix, as before
    slow = LoadingController(profile(disk=0.1)).decide(2000, "disk", sources=[500] * 4, exact_prefix=True)
    assert slow.loaded_sources is None and slow.recompute_ratio == 1.0
    with pytest.raises(KVStoreError, match="hold 1500 tokens, not 2000"):
        LoadingController(profile(disk=1)).decide(2000, "disk", sources=[500] * 3)
