"""Second connector audit, the server: ``/v1/rag/query`` streamed as server-sent events (each event
valid JSON, the answer event last with its finish reason and usage, then ``[DONE]``) and a client
that hangs up mid-answer, against a live server over the default model on CPU."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server_helpers import KEY

pytestmark = pytest.mark.slow
QUESTION = "When was the Hollowpoint lighthouse electrified?"
AUTH = {"Authorization": f"Bearer {KEY}"}


def events(served, body: dict) -> list[str]:
    out = []
    with httpx.stream("POST", f"{served.url}/v1/rag/query", json=body, headers=AUTH, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line:
                assert line.startswith("data: "), line
                out.append(line[6:])
    return out


def cancelled(served) -> float:
    want = 'ragfuse_requests_total{endpoint="rag",outcome="cancelled"} '
    text = httpx.get(f"{served.url}/metrics", headers=AUTH).text
    return next((float(line[len(want):]) for line in text.splitlines() if line.startswith(want)), 0.0)


def test_rag_stream_events_are_json_answer_last_then_done(served):
    body = {"question": QUESTION, "top_k": 1, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    got = events(served, body)
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    parsed = [json.loads(e) for e in got[:-1]]
    deltas, final = parsed[:-1], parsed[-1]
    assert deltas and all(d["object"] == "rag.answer.delta" and d["delta"] for d in deltas)
    assert final["object"] == "rag.answer" and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 8
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 8
    assert "".join(d["delta"] for d in deltas).strip() == final["answer"]


def test_rag_stream_client_disconnect_aborts_the_request(served):
    body = {"question": "Tell me a long story about the Hollowpoint lighthouse.", "top_k": 1, "max_tokens": 64,
            "stream": True}
    before = cancelled(served)
    with httpx.stream("POST", f"{served.url}/v1/rag/query", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event arrived: the request runs; now hang up
    deadline = time.monotonic() + 30
    while served.backend.running() or served.backend.queue_depth():
        assert time.monotonic() < deadline, "the engine still runs a request nobody listens to"
        time.sleep(0.05)
    assert cancelled(served) == before + 1  # aborted, not run to its end for nobody
    # the next request is served at once and whole
    assert events(served, {**body, "max_tokens": 4})[-1] == "[DONE]"
