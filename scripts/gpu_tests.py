"""Run the GPU test files in parallel shards on one GPU machine.

Why: most of a GPU test's time is Triton compiling the kernel specialisations it touches, which is one CPU core
per process. Run serially, the GPU suite takes longer than one device call may last; split over the machine's
cores it fits. The tests' tensors are small, so the shards share the one GPU; each shard's engines take a small
share of its memory (RAGFUSE_TEST_GPU_SHARE, RAGFUSE_GPU_MEMORY_UTILIZATION) so that none starves the others.

Usage: python3 scripts/gpu_tests.py LOG [SHARDS] -- TEST_FILE...
Writes every shard's output into LOG (one file: a device call brings few files back), prints a summary and
exits non-zero when any shard fails. Tests that failed only because the shards together ran the card out of
memory are run once more, alone, after the shards: what fails then is a failure of the test.
GPU_TESTS_TIMEOUT (seconds, default 480) bounds the whole run: shards still running then are killed and reported,
so one device call always comes back with the logs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)(.*)$", re.M)
OUT_OF_MEMORY = ("OutOfMemoryError", "out of memory")


def collect(files: list[str]) -> list[str]:
    """The node ids of every GPU test in `files`, in file order."""
    res = subprocess.run([*PYTEST, "--collect-only", *files], capture_output=True, text=True, check=False)
    ids = [line.strip() for line in res.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no GPU tests collected:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return ids


def main() -> int:
    args = sys.argv[1:]
    sep = args.index("--")
    log_path, files = Path(args[0]), args[sep + 1:]
    shards = int(args[1]) if sep > 1 else 10
    out = Path(tempfile.mkdtemp(prefix="gpu-tests-"))
    ids = collect(files)
    groups = [ids[i::shards] for i in range(shards)]   # round robin spreads each file's slow tests
    # each shard keeps to its share of GPU memory (tests/conftest.py), and each engine a test builds takes its
    # KV cache from a small part of the free memory, leaving room for the other shards
    # (COLUMNS: the summary's FAILED lines keep the error's name, which tells an out-of-memory failure)
    env = {**os.environ, "RAGFUSE_TEST_GPU_SHARE": f"{0.95 / shards:.3f}",
           "RAGFUSE_GPU_MEMORY_UTILIZATION": f"{0.3 / shards:.3f}", "COLUMNS": "400"}
    procs = []
    for n, group in enumerate(g for g in groups if g):
        log = (out / f"gpu-tests-{n}.log").open("w")
        procs.append((n, subprocess.Popen([*PYTEST, "--durations=3", *group], stdout=log, stderr=subprocess.STDOUT,
                                         env=env)))
    deadline = time.monotonic() + float(os.environ.get("GPU_TESTS_TIMEOUT", "480"))
    failed = 0
    totals: dict[str, int] = {}
    retry: list[str] = []
    for n, proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"--- shard {n} killed at the time limit")
        text = (out / f"gpu-tests-{n}.log").read_text()
        for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1] if text else ""):
            totals[word] = totals.get(word, 0) + int(count)
        if proc.returncode != 0:
            failures = SUMMARY_LINE.findall(text)
            if failures and all(any(m in why for m in OUT_OF_MEMORY) for _, why in failures):
                retry += [node for node, _ in failures]
                print(f"--- shard {n}: {len(failures)} failed out of GPU memory, run again alone below")
                continue
            failed += 1
            print(f"--- shard {n} exit {proc.returncode}\n" + "\n".join(text.splitlines()[-40:]))
    summary = f"{len(ids)} GPU tests in {len(procs)} shards: " + ", ".join(f"{v} {k}" for k, v in totals.items())
    logs = [(f"shard {n}", out / f"gpu-tests-{n}.log") for n, _ in procs]
    if retry:  # the whole card for them now: no shard shares it any more
        rerun_log = out / "gpu-tests-rerun.log"
        with rerun_log.open("w") as log:
            rerun = subprocess.run([*PYTEST, *retry], stdout=log, stderr=subprocess.STDOUT, check=False)
        failed += rerun.returncode != 0
        last = rerun_log.read_text().splitlines()
        summary += f"; {len(retry)} out-of-memory failures run again alone: {last[-1] if last else 'no output'}"
        logs.append(("out-of-memory failures run again alone", rerun_log))
    print(summary)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("".join(f"===== {name}\n" + path.read_text() for name, path in logs) + summary + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
