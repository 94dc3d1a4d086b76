"""The accuracy gate: r* is the least probed ratio whose gap_closed reaches the target, cached per model."""

from __future__ import annotations

import json

import pytest

from ragfuse import gate
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.gate import RATIOS, calibrate, calibrated_r_star, calibration_prompts
from ragfuse.probes import PROBES

# the short probes keep these tests quick; the real calibration set is the same code on longer prompts
SHORT = ("probes", PROBES)
ONE = ("probes", PROBES[:1])  # where the test is about the gate's bookkeeping, not about r* itself


@pytest.fixture(scope="module")
def calibration(engine):
    return calibrate(engine, SelectionPolicy.default(), target=0.6, prompts=SHORT)


def test_calibration_set_is_real_rag_prompts_the_eval_never_scores():
    from ragfuse.eval_qa import load_dataset
    from ragfuse.shared_data import shared_data

    name, prompts = calibration_prompts()
    assert name == "shared-dev" and len(prompts) == gate.PER_DATASET * len(gate.CALIBRATION_DATASETS)
    assert all(len(p["passages"]) == 6 for p in prompts)
    evaluated = {ex.question for ds in gate.CALIBRATION_DATASETS for ex in load_dataset(shared_data(ds), 20, 6)}
    assert not evaluated & {p["question"] for p in prompts}


def test_calibration_falls_back_to_the_probes_without_shared_data(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "shared_data", lambda name: tmp_path / name)
    assert calibration_prompts() == ("probes", PROBES)


def test_r_star_is_the_least_ratio_reaching_the_target(calibration):
    gaps = {float(r): g for r, g in calibration.gap_closed.items()}
    assert calibration.r_star in RATIOS and not calibration.fallback_to_full
    assert gaps[calibration.r_star] >= 0.6
    assert all(g < 0.6 for r, g in gaps.items() if r < calibration.r_star)
    assert max(gaps) == calibration.r_star  # probing stops at r*
    assert calibration.kl_tf_reuse > 0


def test_unreachable_target_falls_back_to_full_recompute(engine):
    cal = calibrate(engine, SelectionPolicy.default(), target=1.01, prompts=ONE)  # gap_closed never exceeds 1
    assert cal.fallback_to_full and cal.r_star == 1.0
    assert [float(r) for r in cal.gap_closed] == list(RATIOS)  # every ratio was tried
    assert all(g <= 1.0 for g in cal.gap_closed.values())


def test_calibration_is_cached_per_model_and_policy(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFUSE_CACHE", str(tmp_path))
    low = 0.2  # reached at the first ratios: each calibration here stops early
    r = calibrated_r_star(engine, SelectionPolicy.default(), target=low, prompts=ONE)
    assert r == calibrate(engine, SelectionPolicy.default(), target=low, prompts=ONE).r_star
    (path,) = (tmp_path / "gate").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["r_star"] == r and saved["target_gap_closed"] == low
    path.write_text(json.dumps({**saved, "r_star": 0.42}))  # a second call reads the cache, never re-probes
    assert calibrated_r_star(engine, SelectionPolicy.default(), target=low, prompts=ONE) == 0.42
    path.write_text("{not json")  # an unreadable cache calibrates again and is rewritten
    assert calibrated_r_star(engine, SelectionPolicy.default(), target=low, prompts=ONE) == r
    assert json.loads(path.read_text())["r_star"] == r
