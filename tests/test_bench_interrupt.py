"""Ctrl-C in ``ragfuse bench``: the rows finished so far are written (json, md, png where it can be
drawn), marked ``interrupted``, one line on stderr and exit status 130; none finished: nothing written.

The long benchmarks (fusion, relay) get a real SIGINT in a subprocess once their progress output shows
a later part running; the others share ``ragfuse.bench.partial.Report``, tested here directly and
through the command line with a KeyboardInterrupt raised where a benchmark starts a part.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ragfuse.bench.partial import BenchInterrupted, Report
from ragfuse.bench.report import write_report
from ragfuse.cli import main

FUSION = ["fusion", "--shape", "tiny-llama", "--chunks", "2", "--chunk-tokens", "16", "--query-tokens", "4",
          "--repeats", "1"]
RELAY = ["relay", "--shapes", "tiny-llama", "--systems", "64", "--contexts", "16", "--batches", "2",
         "--e2e-systems", "64", "--requests", "3", "--max-prompt", "8", "--max-output", "3"]


def _interrupt_when(argv: list[str], marker: bytes, out: Path) -> tuple[int, str]:
    """Run ``ragfuse bench ARGV --out OUT`` and send it SIGINT once ``marker`` shows in its progress
    output (stderr); its exit status and stderr."""
    cmd = [sys.executable, "-m", "ragfuse.cli", "bench", *argv, "--device", "cpu", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},  # a background job ignores SIGINT:
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[bytes] = []
    seen = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        while chunk := proc.stderr.read1(4096):
            err.append(chunk)
            if marker in b"".join(err):
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert seen.wait(240), b"".join(err).decode(errors="replace")[-3000:]
        assert proc.poll() is None, "the benchmark finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    finally:
        proc.kill()
        proc.wait()
    reader.join(10)
    return code, b"".join(err).decode(errors="replace")


def _last_line(stderr: str) -> str:
    return stderr.replace("\r", "\n").strip().splitlines()[-1]


def _ends_with_line(stderr: str, message: str) -> bool:
    """``stderr`` ends with the one line ``message``. (A progress bar stopped in the microseconds
    between drawing itself and taking note of it cannot be closed, and the message then follows its
    text on the same line: the tests signal right as a bar appears.)"""
    return "\n" not in message and stderr.endswith(message + "\n")


def test_fusion_interrupted_in_the_ratio_sweep_keeps_the_modes_rows(tmp_path):
    """SIGINT in the ratio sweep (thousands of points: it cannot end first): the modes' rows are
    written, the sweep's points so far beside them, and the plot is drawn; the controller, which
    decides from the whole sweep, has not run."""
    out = tmp_path / "fusion"
    sweep = ",".join(["0.5"] * 4000)
    code, err = _interrupt_when([*FUSION, "--sweep", sweep], b"ratio sweep", out)
    assert code == 130, err[-2000:]
    results = json.loads((out / "results.json").read_text())
    modes = [(r["tier"], r["mode"]) for r in results["rows"]]
    assert modes == [(t, m) for t in ("cpu", "disk") for m in ("full", "prefix", "reuse", "fuse")]
    assert all(r["speedup_vs_full"] > 0 for r in results["rows"] if r["mode"] != "full")
    mark = results["interrupted"]
    assert mark.startswith("stopped by the user during ratio sweep [tiny-llama] after 8 rows")
    assert "finished: modes [tiny-llama]; not finished: ratio sweep [tiny-llama] (started), controller" in mark
    assert len(results["sweeps"]["tiny-llama"]) < 4000
    assert (out / "results.md").read_text().startswith(f"# ragfuse bench fusion\n\n**Interrupted:** {mark}\n")
    assert (out / "results.png").stat().st_size > 1000
    assert _ends_with_line(err, f"ragfuse: bench fusion: {mark}; the finished rows are in {out}")


def test_relay_interrupted_in_the_end_to_end_part_keeps_the_op_rows(tmp_path):
    """SIGINT once the end-to-end part runs (many rounds: it cannot end first): the op part's rows are
    written, marked, and the end-to-end part named as not finished."""
    out = tmp_path / "relay"
    code, err = _interrupt_when([*RELAY, "--repeats", "5000"], b"relay e2e", out)
    assert code == 130, err[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["part"] for r in results["rows"]] == ["op"]
    assert results["rows"][0]["rel_err"] < 1e-5
    assert results["interrupted"] == ("stopped by the user during e2e tiny-llama after 1 row; finished: op tiny-llama; "
                                      "not finished: e2e tiny-llama (started)")
    assert "**Interrupted:** stopped by the user during e2e" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 1000
    assert _ends_with_line(err, f"ragfuse: bench relay: {results['interrupted']}; the finished rows are in {out}")


TREE = ["bench", "tree", "--shape", "tiny-llama", "--shared", "32", "--batches", "2", "--private", "5",
        "--repeats", "1", "--e2e", "--e2e-prefix", "24", "--e2e-requests", "2", "--e2e-tokens", "2", "--device", "cpu"]


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, module: str, desc: str) -> None:
    """Ctrl-C where ``ragfuse.bench.MODULE`` starts the part whose progress bar is ``desc``."""
    import importlib

    bench = importlib.import_module(f"ragfuse.bench.{module}")
    real = bench.tqdm

    def progress(*args: object, **kwargs: object) -> object:
        if kwargs.get("desc") == desc:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "tqdm", progress)


def test_tree_interrupted_through_the_command_line(tmp_path, monkeypatch, capsys):
    """Before any row: nothing written, a line that says so, exit status 130. After the op
    part: its rows written, marked, one line on stderr, exit status 130, and a results.png of an
    earlier run in the folder replaced by this run's."""
    out = tmp_path / "none"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, "tree", "bench tree (attention op)")
        assert main([*TREE, "--out", str(out)]) == 130
    assert list(out.iterdir()) == []
    assert _last_line(capsys.readouterr().err) == ("ragfuse: bench tree: stopped by the user before any row "
                                                   "finished (during attention op): nothing written")

    out = tmp_path / "tree"
    out.mkdir()
    (out / "results.png").write_bytes(b"an earlier run's plot")
    _interrupt_at(monkeypatch, "tree", "bench tree (engine)")
    assert main([*TREE, "--out", str(out)]) == 130
    results = json.loads((out / "results.json").read_text())
    assert len(results["rows"]) == 1 and results["rows"][0]["part"] == "op"
    assert results["interrupted"] == ("stopped by the user during engine, tree on and off after 1 row; "
                                      "finished: attention op; not finished: engine, tree on and off (started)")
    assert (out / "results.png").read_bytes().startswith(b"\x89PNG")
    err = capsys.readouterr().err
    assert _last_line(err) == f"ragfuse: bench tree: {results['interrupted']}; the finished rows are in {out}"


def test_report_interrupted_writes_its_rows_and_skips_a_plot_they_cannot_draw(tmp_path):
    """A plot written for a whole run that fails on the finished rows costs the PNG only (the earlier
    run's is removed, not left beside the new table), and results.md says why it is missing."""
    out = tmp_path / "out"
    write_report(out, "t", {}, [{"x": 1}], lambda fig: fig.add_subplot().plot([1, 2]))
    assert (out / "results.png").exists()

    def plot(fig: object) -> None:
        (second,) = [r for r in report.rows if r["part"] == "b"]

    report = Report(out, "bench t", {"settings": 1}, ["a", "b", "c"], plot=plot, notes=lambda: "n rows")
    with pytest.raises(BenchInterrupted) as info, report.interruptible():
        report.begin("a")
        report.rows.append({"part": "a", "x": 1.5})
        report.begin("b")
        raise KeyboardInterrupt
    mark = "stopped by the user during b after 1 row; finished: a; not finished: b (started), c"
    assert str(info.value) == f"{mark}; the finished rows are in {out}"
    assert json.loads((out / "results.json").read_text()) == {"settings": 1, "interrupted": mark,
                                                               "rows": [{"part": "a", "x": 1.5}]}
    md = (out / "results.md").read_text()
    assert md.startswith(f"# bench t\n\n**Interrupted:** {mark}\n\nNo plot: drawing it failed (ValueError: ")
    assert "n rows" in md and "| a | 1.5 |" in md
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]


def test_report_interrupted_before_any_row_writes_nothing_and_says_so(tmp_path):
    report = Report(tmp_path / "out", "bench t", {}, ["a"])
    with pytest.raises(BenchInterrupted, match=r"before any row finished \(during a\): nothing written"), \
            report.interruptible():
        report.begin("a")
        raise KeyboardInterrupt
    assert not (tmp_path / "out").exists()


def test_write_report_plot_error_of_a_whole_run_keeps_the_rows_and_is_raised(tmp_path):
    """A plot bug after a long run: the table and results.json are written (no stale PNG beside them),
    then the error is raised."""
    out = tmp_path / "out"
    write_report(out, "t", {}, [{"x": 1}], lambda fig: fig.add_subplot().plot([1, 2]))

    def plot(fig: object) -> None:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError, match="a bug"):
        write_report(out, "t", {"run": 2}, [{"x": 2}], plot)
    assert json.loads((out / "results.json").read_text()) == {"run": 2, "rows": [{"x": 2}]}
    assert "No plot: drawing it failed (ZeroDivisionError: a bug)" in (out / "results.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]
