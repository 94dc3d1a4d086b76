"""``ragfuse bench sessions`` end to end on a tiny random-weight shape: report files, both parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragfuse.bench.sessions import SHAREGPT
from ragfuse.cli import main


def test_bench_sessions_smoke(tmp_path):
    if not Path(SHAREGPT).exists():
        pytest.skip(f"{SHAREGPT} not present")
    out = tmp_path / "sessions"
    # the CLI's entry point in this process: a subprocess would mostly import torch and the engine
    assert main(["bench", "sessions", "--parts", "ttft,replay", "--device", "cpu", "--history", "64",
                 "--new-tokens", "16", "--repeats", "1", "--conversations", "30", "--settings", "tight:0.05:0.15",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    ttft = [row for row in results["rows"] if row["part"] == "ttft"]
    assert {row["tier"] for row in ttft} == {"cpu", "disk", "disk-prefetched"}
    assert all(row["ttft_session_ms"] > 0 for row in ttft)
    assert all((row["prefetch_ms"] is not None) == (row["tier"] == "disk-prefetched") for row in ttft)
    replay = [row for row in results["rows"] if row["part"] == "replay"]
    assert {row["policy"] for row in replay} == {"scheduler", "lru", "fifo"}
    assert all(0 <= row["hit_rate"] <= 1 for row in replay)
    assert (out / "results.png").stat().st_size > 1000
