"""The loading controller on synthetic delay profiles: the decisions of CacheBlend section 5.1."""

from __future__ import annotations

import pytest

from ragfuse.engine.kvstore import DelayProfile, KVStoreError, LoadingController, profile_path

KV_PER_TOKEN = 128 * 1024  # Mistral-7B, bf16
GB = 1e9


def profile(**bandwidth_gbs: float) -> DelayProfile:
    # full prefill: 0.1 ms/token up to 1000 tokens, then 0.2 ms/token (a convex curve)
    return DelayProfile(model="m", device="cuda", dtype="bfloat16", kv_bytes_per_token=KV_PER_TOKEN,
                        prefill_points=[(1000, 0.1), (2000, 0.3)],
                        bandwidth={k: v * GB for k, v in bandwidth_gbs.items()})


def test_prefill_interpolates_and_extrapolates():
    p = profile(cpu=10)
    assert p.prefill_s(500) == pytest.approx(0.05)
    assert p.prefill_s(1500) == pytest.approx(0.2)
    assert p.prefill_s(3000) == pytest.approx(0.5)  # last slope carried on
    assert p.load_s(1000, "cpu") == pytest.approx(1000 * KV_PER_TOKEN / (10 * GB))


def test_fast_tier_recomputes_r_star():
    c = LoadingController(profile(cpu=20))
    d = c.decide(2000, "cpu")
    assert d.t_load_s == pytest.approx(2000 * KV_PER_TOKEN / (20 * GB))  # 13 ms
    assert d.r_balanced == pytest.approx(d.t_load_s / 0.3)
    assert d.recompute_ratio == 0.15 and "hides behind" in d.reason
    assert d.ttft_estimate_s == pytest.approx(max(0.15 * 0.3, d.t_load_s))


def test_slow_tier_raises_ratio_to_balance_load():
    c = LoadingController(profile(disk=2))  # 2000 tokens: 131 ms to load vs 300 ms full prefill
    d = c.decide(2000, "disk")
    assert d.recompute_ratio == pytest.approx(d.t_load_s / 0.3) and d.recompute_ratio > 0.15
    assert d.t_recompute_s == pytest.approx(d.t_load_s)  # recompute exactly as long as loading


def test_tier_slower_than_prefill_recomputes_all():
    d = LoadingController(profile(disk=0.5)).decide(2000, "disk")
    assert d.recompute_ratio == 1.0 and "recompute all" in d.reason


def test_choose_cheapest_tier_that_hides_behind_r_star():
    # budget at r* for 2000 tokens: 45 ms; loads: gpu 0.3 ms, cpu 10 ms, disk 52 ms, redis 26 ms
    c = LoadingController(profile(gpu=900, cpu=25, disk=5, redis=10))
    d = c.choose_tier(2000)
    fits = {e.tier: e.hides_behind_recompute for e in d.estimates}
    assert fits == {"gpu": True, "cpu": True, "disk": False, "redis": True}
    assert d.tier == "redis"  # cheaper than cpu and gpu; disk is cheapest but too slow
    assert d.recompute_ratio == 0.15
    cheap_disk = LoadingController(profile(gpu=900, cpu=25, disk=5, redis=10), cost_per_gb_hour={"redis": 1.0})
    assert cheap_disk.choose_tier(2000).tier == "cpu"


def test_longer_context_lets_a_slower_tier_fit():
    c = LoadingController(profile(cpu=25, disk=5))
    assert c.choose_tier(2000).tier == "cpu"  # disk load 52 ms > 45 ms budget
    assert c.choose_tier(4000).tier == "disk"  # budget grows faster (convex prefill): 105 ms vs 105 ms


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
