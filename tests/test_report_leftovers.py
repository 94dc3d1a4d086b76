"""A benchmark killed while `write_report` stages its files leaves its hidden staging folder in --out:
the next `write_report` into that folder removes it, and never the folder of a writer still at work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ragfuse.bench.report import STALE_STAGE_S, write_report

ROOT = Path(__file__).resolve().parents[1]

# a writer that stops inside its plot (staging folder made, nothing renamed in) until told to go on
WRITER = """
    import sys
    from ragfuse.bench.report import write_report

    def plot(fig):
        print("drawing", flush=True)
        sys.stdin.readline()
        fig.add_subplot().plot([0, 1])

    write_report(sys.argv[1], "writer", {"who": sys.argv[2]}, [{"who": sys.argv[2]}], plot=plot)
    print("done", flush=True)
"""


def _writer(out: Path, who: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(out), who], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "drawing", proc.stderr.read()
    return proc


def _stages(out: Path) -> set[Path]:
    return set(out.glob(".results-*"))


def test_the_next_write_removes_a_killed_writers_staging_folder_and_keeps_a_live_ones(tmp_path):
    out = tmp_path / "out"
    killed = _writer(out, "killed")
    (killed_stage,) = _stages(out)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert killed_stage.is_dir()  # what a SIGKILL leaves behind
    # a folder of an older version (no owner in its name), untouched for longer than any write takes
    # (a writer that died, or one of another host sharing the folder); and one of the same kind, fresh
    old = out / ".results-k2j4h6g8"
    old.mkdir()
    (old / "results.md").write_text("# half a report\n")
    long_ago = time.time() - STALE_STAGE_S - 60
    os.utime(old, (long_ago, long_ago))
    fresh = out / ".results-q1w2e3r4"
    fresh.mkdir()

    live = _writer(out, "live")
    (live_stage,) = _stages(out) - {killed_stage, old, fresh}
    write_report(out, "this run", {"who": "me"}, [{"who": "me"}])
    assert _stages(out) == {live_stage, fresh}
    assert json.loads((out / "results.json").read_text())["who"] == "me"

    live.stdin.write("\n")
    live.stdin.flush()
    assert live.stdout.readline().strip() == "done", live.stderr.read()
    assert live.wait() == 0
    assert json.loads((out / "results.json").read_text())["who"] == "live"
    assert (out / "results.png").is_file() and _stages(out) == {fresh}
