"""Stopping ``ragfuse serve`` and ``ragfuse ingest`` the way users do (SIGTERM, Ctrl-C) through the real
CLI in a subprocess: the process ends promptly with a clean word, an in-flight stream ends with an
error event and ``[DONE]`` (not a cut connection), and nothing stored is lost or redone."""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import MODEL
from tests.test_cli import ragfuse

WORDS = ["lighthouse", "keeper", "lamp", "storm", "ship", "coast", "harbor", "fog", "beacon", "night", "sea",
         "rock", "wave", "tower", "light"]


class Proc:
    """A ``ragfuse`` subprocess whose stderr is read on a thread (tqdm's progress has no newlines)."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "ragfuse.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        self.err = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        while chunk := self.p.stderr.read1(65536):
            self.err += chunk

    def wait_for(self, pattern: bytes, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.err):
            assert self.p.poll() is None, self.err.decode(errors="replace")
            assert time.monotonic() < deadline, self.err.decode(errors="replace")
            time.sleep(0.05)

    def stop(self, sig: signal.Signals, within: float) -> tuple[int, str]:
        """Send ``sig``; the exit status and stderr, the process having ended within ``within`` seconds."""
        t0 = time.monotonic()
        self.p.send_signal(sig)
        try:
            self.p.wait(timeout=within)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"no exit {within} s after {sig.name}")
        self._reader.join(5)
        assert time.monotonic() - t0 < within
        return self.p.returncode, self.err.decode(errors="replace")


def _serve(store: Path) -> tuple[Proc, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = Proc("serve", "--store", str(store), "--port", str(port), "--device", "cpu", "--no-gate",
                "--log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    proc.wait_for(b"Loading weights")
    deadline = time.monotonic() + 120
    while True:
        assert proc.p.poll() is None and time.monotonic() < deadline, proc.err.decode(errors="replace")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)


def _chat(url: str, messages: list[dict[str, str]], **extra: object) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stopped_mid_stream_ends_the_stream_and_keeps_the_session(tmp_path, sig) -> None:
    """A stream in flight at the signal was cut mid-chunk when the 5 s grace period ran out (the
    client's "incomplete chunked read"; with Ctrl-C a CancelledError traceback on stderr). A session
    turn answered before the signal is on disk: the restarted server continues it from its KV."""
    proc, url = _serve(tmp_path / "store")
    first = [{"role": "user", "content": "Hi, I am Ana."}]
    answer = _chat(url, first, max_tokens=4, session_id="ana")["choices"][0]["message"]
    lines: list[str] = []
    long = [{"role": "user", "content": "Write a long, detailed history of lighthouses around the world."}]
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,  # a minute of tokens on a CPU
                      json={"model": MODEL, "messages": long, "max_tokens": 1000, "temperature": 0,
                            "stream": True}) as r:
        stream = r.iter_lines()
        lines += [next(stream), next(stream)]  # the stream is running
        code, err = proc.stop(sig, within=15)
        lines += list(stream)
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and "shut down" in events[-2], events[-3:]
    assert code == 0 and "error" not in err.lower() and "Traceback" not in err, err
    if sig == signal.SIGINT:  # the session's save after a signal: once is enough (a restart costs seconds)
        return
    proc, url = _serve(tmp_path / "store")
    try:
        listed = httpx.get(f"{url}/v1/sessions").json()["data"]
        assert [s["id"] for s in listed] == ["ana"] and listed[0]["tokens"] > 0
        again = first + [answer, {"role": "user", "content": "What is my name?"}]
        usage = _chat(url, again, max_tokens=2, session_id="ana")["usage"]
        assert usage["ragfuse"]["session_tokens_reused"] == listed[0]["tokens"]
    finally:
        proc.stop(signal.SIGINT, within=15)


def test_ingest_sigterm_mid_kv_is_a_clean_stop_and_the_rerun_reuses_the_kv(tmp_path) -> None:
    """SIGTERM killed an ingest outright (exit -15, no word, no cleanup). Now it stops like Ctrl-C:
    one line, status 143; the store holds nothing half-done, and the re-run reuses the KV of the
    chunks computed before the signal (a first batch of 4096 tokens, then the rest)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for i in range(3):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(1400)))
    store = str(tmp_path / "store")
    proc = Proc("ingest", str(docs), "--store", store, "--device", "cpu")
    proc.wait_for(rb"precomputing KV:\s+[1-9]\d*%")  # the first batch is stored
    code, err = proc.stop(signal.SIGTERM, within=15)
    assert code == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "ragfuse: terminated (SIGTERM)", err
    assert "Traceback" not in err
    assert "the same command again adds what is missing, reusing the chunk KV already stored" in err, err
    stats = ragfuse("store", "stats", "--store", store)
    assert stats.returncode == 0 and "0 files, 0 chunks" in stats.stdout, stats.stdout + stats.stderr
    rerun = ragfuse("ingest", str(docs), "--store", store, "--device", "cpu", "--json")
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert len(report["new_files"]) == 3 and report["kv_reused"] >= 8 and report["kv_computed"] >= 1, report
