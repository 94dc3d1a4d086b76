"""What README.md promises a user, checked where a walk-through of it found the code doing otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ragfuse.engine.kvstore import DelayProfile
from ragfuse.engine.kvstore.entry import dtype_name
from tests.store_helpers import ingest_demo

QUESTION = "When was the Hollowpoint lighthouse electrified?"


def test_profiled_store_never_raises_the_ratio_above_the_gates_r_star(engine, tmp_path, monkeypatch):
    """README: after `ragfuse profile` the ratio "comes from the loading controller ... and never goes
    below the gate's r*". The controller was built with its own default floor (15%), so on a store
    with a profile every fused answer recomputed 15% where the gate had measured 5% safe (and the
    decision reported r* = 15%): profiling made answers slower. With loading far faster than
    recompute the controller has no reason to go above r*."""
    from ragfuse.app import open_pipeline, store_profile_path
    from ragfuse.engine import SamplingParams
    from ragfuse.engine.fusion import SelectionPolicy
    from ragfuse.gate import DEFAULT_TARGET, calibration_prompts, gate_cache_path

    monkeypatch.setenv("RAGFUSE_CACHE", str(tmp_path / "cache"))
    store = ingest_demo(tmp_path / "store", engine)
    gate_file = gate_cache_path(engine, SelectionPolicy.default(), DEFAULT_TARGET, calibration_prompts()[0],
                                "instruction")
    gate_file.parent.mkdir(parents=True)
    gate_file.write_text(json.dumps({"r_star": 0.05}))  # as a calibration of this model would leave it
    dtype = dtype_name(engine.dtype)
    prof_file = DelayProfile(
        model=engine.fingerprint, device=str(engine.device), dtype=dtype,
        kv_bytes_per_token=engine.model_config.kv_bytes_per_token(engine.dtype),
        prefill_points=[(512, 1.0), (4096, 8.0)], recompute_points=[(512, 0.0, 0.1), (512, 1.0, 1.0)],
        bandwidth={"cpu": 1e12, "disk": 1e12},
    ).save(store_profile_path(store, engine))

    pipeline = open_pipeline(str(store), engine=engine)
    result = pipeline.ask(QUESTION, mode="fuse", top_k=2, params=SamplingParams(max_tokens=4))
    assert result.decision is not None  # the controller chose
    assert result.decision["r_star"] == 0.05
    assert 0.04 < result.recompute_ratio < 0.07, result.recompute_ratio

    # README: a damaged profile "is set aside with a warning; answers go on at r*" (a string where a
    # rate belongs crashed every fused answer with a TypeError); the answer's notes say so too
    prof = json.loads(prof_file.read_text())
    prof_file.write_text(json.dumps({**prof, "bandwidth": {"cpu": "1e12", "disk": 1e12}}))
    pipeline = open_pipeline(str(store), engine=engine)
    result = pipeline.ask(QUESTION, mode="fuse", top_k=2, params=SamplingParams(max_tokens=4))
    assert result.decision is None and 0.04 < result.recompute_ratio < 0.07
    assert any("is unusable" in n and "without the loading controller" in n for n in result.notes), result.notes
    chosen = pipeline.ask(QUESTION, mode="fuse", ratio=0.5, top_k=2, params=SamplingParams(max_tokens=4))
    assert not any("unusable" in n for n in chosen.notes)  # a ratio the caller chose needs no controller

    # a store profiled only for another device or dtype (its profile's name says which) was used
    # without a word: the answer says why no controller chose
    prof_file.write_text(json.dumps(prof))
    prof_file.rename(prof_file.with_name("profile-0000000000000000.json"))
    pipeline = open_pipeline(str(store), engine=engine)
    result = pipeline.ask(QUESTION, mode="fuse", top_k=2, params=SamplingParams(max_tokens=4))
    assert result.decision is None
    assert any(f"not smollm2-135m-instruct on cpu in {dtype}" in n for n in result.notes), result.notes

    # README: a `ragfuse profile` beside a running server is its next answer's, no restart (the
    # profile was read once, when the store opened): saved by rename, as `profile` saves it
    fresh = prof_file.with_name(".new.json")
    fresh.write_text(json.dumps(prof))
    fresh.replace(prof_file)
    result = pipeline.ask(QUESTION, mode="fuse", top_k=2, params=SamplingParams(max_tokens=4))
    assert result.decision is not None and not any("loading controller" in n for n in result.notes)
    prof_file.unlink()  # and a profile removed is no longer used
    (prof_file.parent / "profile-0000000000000000.json").unlink()
    result = pipeline.ask(QUESTION, mode="fuse", top_k=2, params=SamplingParams(max_tokens=4))
    assert result.decision is None and not result.notes


def test_generate_takes_the_sessions_dir_spelling_serve_uses(tmp_path):
    """`ragfuse serve --sessions-dir` and `ragfuse generate --session-dir` named one thing two ways, and
    generate refused serve's spelling ("unrecognized arguments"): both now keep the turn there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAGFUSE_SESSIONS", None)
    run = subprocess.run([sys.executable, "-m", "ragfuse.cli", "generate", "Hi, I am Ana.", "--session", "ana",
                          "--sessions-dir", str(tmp_path), "--max-tokens", "2", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["session_id"] == "ana"
    assert (tmp_path / "chats" / "ana.json").exists()


def test_eval_help_says_the_plot_comes_with_a_sweep_only():
    """`eval qa --out` writes results.png only for a sweep (the plot is the sweep's): its help said
    every run wrote one, and a user looked for a file that was never there."""
    run = subprocess.run([sys.executable, "-m", "ragfuse.cli", "eval", "qa", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "with --sweep also results.png" in " ".join(run.stdout.split())
