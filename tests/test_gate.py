"""The accuracy gate: r* is the least probed ratio whose gap_closed reaches the target, cached per model."""

from __future__ import annotations

import json

import pytest

from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.gate import RATIOS, calibrate, calibrated_r_star


@pytest.fixture(scope="module")
def calibration(engine):
    return calibrate(engine, SelectionPolicy.default(), target=0.6)


def test_r_star_is_the_least_ratio_reaching_the_target(calibration):
    gaps = {float(r): g for r, g in calibration.gap_closed.items()}
    assert calibration.r_star in RATIOS and not calibration.fallback_to_full
    assert gaps[calibration.r_star] >= 0.6
    assert all(g < 0.6 for r, g in gaps.items() if r < calibration.r_star)
    assert max(gaps) == calibration.r_star  # probing stops at r*
    assert calibration.kl_tf_reuse > 0


def test_unreachable_target_falls_back_to_full_recompute(engine):
    cal = calibrate(engine, SelectionPolicy.default(), target=1.01)  # gap_closed never exceeds 1
    assert cal.fallback_to_full and cal.r_star == 1.0
    assert [float(r) for r in cal.gap_closed] == list(RATIOS)  # every ratio was tried
    assert all(g <= 1.0 for g in cal.gap_closed.values())


def test_calibration_is_cached_per_model_and_policy(engine, tmp_path, monkeypatch, calibration):
    monkeypatch.setenv("RAGFUSE_CACHE", str(tmp_path))
    r = calibrated_r_star(engine, SelectionPolicy.default(), target=0.6)
    assert r == calibration.r_star
    (path,) = (tmp_path / "gate").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["r_star"] == r and saved["target_gap_closed"] == 0.6
    path.write_text(json.dumps({**saved, "r_star": 0.42}))  # a second call reads the cache, never re-probes
    assert calibrated_r_star(engine, SelectionPolicy.default(), target=0.6) == 0.42
    path.write_text("{not json")  # an unreadable cache calibrates again and is rewritten
    assert calibrated_r_star(engine, SelectionPolicy.default(), target=0.6) == r
    assert json.loads(path.read_text())["r_star"] == r
