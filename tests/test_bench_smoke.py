"""The benchmarks run end to end on a tiny random-weight shape and write their report files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ragfuse.cli import main


@pytest.mark.parametrize("args", [
    ["engine", "--shape", "tiny-llama", "--prefill", "32", "--decode-batches", "2", "--context", "16",
     "--decode-steps", "3", "--repeats", "1"],
    ["fusion", "--shape", "tiny-llama", "--chunks", "3", "--chunk-tokens", "32", "--query-tokens", "4",
     "--repeats", "1", "--sweep", "0,0.5"],
    ["relay", "--shapes", "tiny-llama", "--systems", "64", "--contexts", "16", "--batches", "2,4",
     "--e2e-systems", "64", "--requests", "3", "--max-prompt", "8", "--max-output", "3", "--repeats", "2"],
    ["tree", "--shape", "tiny-llama", "--shared", "64", "--batches", "3", "--private", "5", "--repeats", "1", "--e2e",
     "--e2e-prefix", "40", "--e2e-requests", "3", "--e2e-tokens", "3"],
    # one 64 MiB entry: bigger than glibc ever serves from its heap, so fresh buffers really fault
    ["store", "--chunks", "1", "--tokens", "512", "--repeats", "2", "--redis", "redis://127.0.0.1:1/0"],
    ["server", "--clients", "2", "--seconds", "3", "--max-tokens", "4"],  # the real default model, served
    ["server-reuse", "--conversations", "1", "--turns", "2", "--message-chars", "200", "--questions", "2",
     "--system-chars", "600", "--max-tokens", "6"],
])
def test_bench_writes_results_table_and_plot(args, tmp_path):
    """Through the CLI's own entry point, in this process: a subprocess would spend more time importing
    torch and the engine than the tiny benchmark itself takes (test_cli runs the real executable). The
    store benchmark counts the page faults of its process, so it gets a fresh one, whose heap no earlier
    test has shaped."""
    out = tmp_path / args[0]
    argv = ["bench", *args, "--device", "cpu", "--out", str(out)]
    if args[0] == "store":
        r = subprocess.run([sys.executable, "-m", "ragfuse.cli", *argv], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["rows"]
    assert (out / "results.md").read_text().count("|") > 10
    assert (out / "results.png").stat().st_size > 1000
    if args[0] == "server":
        (row,) = results["rows"]
        assert row["errors"] == 0 and row["requests"] >= 2 and row["rss_end_mib"] > 100
    if args[0] == "store":
        rows = {r["path"]: r for r in results["rows"]}
        pooled, fresh = rows["disk -> cpu"], rows["disk -> cpu, fresh buffers (no pool)"]
        assert pooled["ratio"] > 0 and pooled["goal"] == 0.7 and fresh["ratio"] > 0
        assert pooled["page faults"] * 10 < fresh["page faults"]  # the pool's buffers are already touched
        assert any("Redis tier skipped" in n for n in results["notes"])
    if args[0] == "server-reuse":
        turn1, turn2, relay = results["rows"]
        assert turn1["session_reused_tokens"] == 0 and turn2["session_reused_tokens"] > turn1["prompt_tokens"]
        assert relay["part"] == "relay" and relay["session_reused_tokens"] > 50
        assert all(row["same_answers"] == row["n"] for row in results["rows"])  # greedy: reuse changes nothing
    if args[0] == "fusion":
        modes = {row["mode"] for row in results["rows"]}
        assert {"full", "prefix", "reuse", "fuse", "fuse@controller"} <= modes
        assert {row["tier"] for row in results["rows"]} == {"cpu", "disk"}
        # prefix computes every chunk after the first: ratio 1, as `ask` reports it (the table said 0)
        assert {row["ratio"] for row in results["rows"] if row["mode"] in ("prefix", "full")} == {1.0}
        assert {row["ratio"] for row in results["rows"] if row["mode"] == "reuse"} == {0.0}
        sweep = results["sweeps"]["tiny-llama"]  # the ratio sweep as a table in results.md too
        assert "Ratio sweep, tiny-llama" in (out / "results.md").read_text() and sweep
        assert f"| {sweep[-1]['ratio']:.4g} | {sweep[-1]['ttft_s']:.4g} |" in (out / "results.md").read_text()
    if args[0] == "relay":
        assert {row["part"] for row in results["rows"]} == {"op", "e2e"}
        ops = [row for row in results["rows"] if row["part"] == "op"]
        assert all(row["rel_err"] < 1e-5 and row["rel_err_paged"] < 1e-5 for row in ops)
        e2e = {row["mode"]: row for row in results["rows"] if row["part"] == "e2e"}
        assert set(e2e) >= {"none", "shared", "relay"}
        for mode in ("none", "shared", "relay"):  # each mode ran twice; its row is the median
            runs = e2e[mode]["runs_s"]
            assert len(runs) == 2 and min(runs) - 1e-4 <= e2e[mode]["seconds"] <= max(runs) + 1e-4


def test_ab_setup_serves_both_sharing_modes_behind_its_system_prompt() -> None:
    """The A/B scripts' engine: a registered system prompt, and each timed run produces every
    request's full answer length in either mode."""
    import torch

    from ragfuse.bench.relay import SHAREGPT, ab_setup

    run = ab_setup("tiny-llama", torch.device("cpu"), 32, 3, SHAREGPT)
    assert len(run.system) == 32 and len(run.reqs) == len(run.outs) == 3
    for mode in ("shared", "relay"):
        secs, tokens = run.time(mode)
        assert secs > 0 and tokens == sum(run.outs)
    assert not run.eng.has_unfinished()
