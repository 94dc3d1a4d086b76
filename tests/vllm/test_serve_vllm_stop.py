"""SIGTERM to ``ragfuse serve --backend vllm`` with requests in flight, through the real CLI in a
subprocess (vLLM venv only): they end at once as stopped requests, as on ragfuse's own engine."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")
pytest.importorskip("faiss")  # the server's RAG routes need ragfuse's [rag] extra in this venv too

import httpx  # noqa: E402

from tests.test_interrupted_jobs import Proc  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the server's start on a loaded 2-core CI box took over 7 minutes
MODEL = "smollm2-135m-instruct"
LONG = {"model": MODEL, "max_tokens": 1000, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a long, detailed history of lighthouses around the world."}]}


def _running(url: str) -> int:
    """The server's ``ragfuse_running_requests`` gauge: requests vLLM is generating for."""
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r"^ragfuse_running_requests (\S+)$", metrics, re.M).group(1)))


def _wait_until(ready: Callable[[], bool], proc: Proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.p.poll() is None, proc.err.decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{what}: {proc.err.decode(errors='replace')[-3000:]}"
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def test_sigterm_ends_a_stream_and_a_whole_answer_in_flight(tmp_path, monkeypatch) -> None:
    """The vLLM backend's requests ran on through uvicorn's 5 s grace period, then the stream's
    connection was cut mid-chunk (the client's "incomplete chunked read") with a CancelledError
    traceback on stderr. Now the stream ends with an error event and ``[DONE]``, the whole answer
    is a 503, and the server exits 0 promptly with no error on stderr."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = Proc("serve", "--backend", "vllm", "--store", str(tmp_path / "store"), "--port", str(port),
                "--log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, proc, 840, "no start")
        whole: list[httpx.Response] = []
        asker = threading.Thread(target=lambda: whole.append(
            httpx.post(f"{url}/v1/chat/completions", json=LONG, timeout=120)))
        asker.start()
        _wait_until(lambda: _running(url) == 1, proc, 60, "the whole answer is not generating")
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
            stream = r.iter_lines()
            lines += [next(stream), next(stream)]  # the stream is running
            assert _running(url) == 2
            before = len(proc.err)
            code, _ = proc.stop(signal.SIGTERM, within=15)
            lines += list(stream)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    asker.join(10)
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and "shut down while this request ran" in events[-2], events[-3:]
    assert whole[0].status_code == 503 and "shut down" in whole[0].json()["error"]["message"], whole[0].text
    after = proc.err[before:].decode(errors="replace")
    assert code == 0 and "Traceback" not in after and "ERROR" not in after, after
