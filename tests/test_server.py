"""``ragfuse serve``'s API, through the official ``openai`` client and plain HTTP, against a live
uvicorn server on loopback over the default model on CPU (one engine loop for every request)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.server_helpers import DEMO, KEY, MODEL, LiveServer

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours."}]
QUESTION = "When was the Hollowpoint lighthouse electrified?"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, llm):
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline
    from ragfuse.engine import SamplingParams

    expected = llm.chat(CHAT, SamplingParams(max_tokens=12)).text  # before the server's loop owns the engine
    store = tmp_path_factory.mktemp("store")
    pipeline = open_store_pipeline(str(store), MODEL, engine=llm.engine, gate=False)
    backend = EngineBackend(pipeline, MODEL)
    app = create_app(backend, ServerSettings(api_key=KEY, max_body_bytes=1 << 20, max_tokens=64))
    with LiveServer(app) as srv:
        files = [("files", (p.name, p.read_bytes())) for p in sorted(DEMO.iterdir())]
        r = httpx.post(f"{srv.url}/v1/documents", files=files, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        assert {d["name"] for d in r.json()["data"]} == {p.name for p in DEMO.iterdir()}
        yield SimpleNamespace(url=srv.url, backend=backend, expected=expected, engine=llm.engine, store=store)


def metric(served, name: str, **labels: str) -> float:
    text = httpx.get(f"{served.url}/metrics", headers=AUTH).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


def wait_idle(served, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while served.backend.running() or served.backend.queue_depth():
        assert time.monotonic() < deadline, "the engine still runs a request nobody listens to"
        time.sleep(0.05)


# ---- the OpenAI API ---------------------------------------------------------------------------


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(f"{served.url}/health")  # the one route without the key
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_chat_matches_the_engine_streaming_or_not(served, client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert full.choices[0].message.content == served.expected
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == served.expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_stop_seed_and_stream(client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert len(text) > 4 and base.usage.completion_tokens >= 1
    cut = text.strip()[2:4]
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                        temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop" and cut not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    tiny = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                     temperature=3.7e-160)  # found by the fuzzer: once a NaN in the sampler
    assert tiny.choices[0].text == text
    sampled = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_concurrent_streams_share_one_engine_loop(served):
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c, i) for i in range(6)))

    seen_batched = []
    stop = False

    async def watch() -> None:
        while not stop:
            seen_batched.append(served.backend.running())
            await asyncio.sleep(0.01)

    async def both() -> list[str]:
        nonlocal stop
        w = asyncio.ensure_future(watch())
        try:
            return await main()
        finally:
            stop = True
            await w

    answers = asyncio.run(both())
    assert all(answers) and len(answers) == 6
    assert max(seen_batched) > 1  # requests decoded together, not one after another


def test_client_disconnect_cancels_its_request(served):
    before = metric(served, "ragfuse_requests_total", endpoint="chat", outcome="cancelled")
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event arrived: the request runs; now hang up
    wait_idle(served)
    assert metric(served, "ragfuse_requests_total", endpoint="chat", outcome="cancelled") == before + 1
    assert served.engine.blocks.num_free == served.engine.blocks.num_blocks


def test_client_disconnect_cancels_a_non_streaming_request(served):
    before = metric(served, "ragfuse_requests_total", endpoint="completions", outcome="cancelled")
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "prompt": "Once upon a time, in a long story,"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up while the answer is generated
        httpx.post(f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(10, read=0.3))
    wait_idle(served)
    assert metric(served, "ragfuse_requests_total", endpoint="completions", outcome="cancelled") == before + 1


# ---- security and malformed requests -----------------------------------------------------------


def test_a_body_without_the_key_is_refused_before_it_is_read():
    """The body limit buffers a body before the routes see it; without the key nothing of it may be
    read (an unauthenticated client must not make the server hold up to the limit per connection)."""
    import asyncio

    from ragfuse.connectors.server.security import BodyLimit

    reached: list[bytes] = []

    async def route(scope, receive, send) -> None:  # what stands behind the middleware: takes the body
        message = await receive()
        reached.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(authorization: bytes | None) -> tuple[int, int]:
        pulled, sent = 0, []

        async def receive():
            nonlocal pulled
            pulled += 1
            return {"type": "http.request", "body": b"x" * 1000, "more_body": pulled < 3}

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", authorization)] if authorization else []
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
        asyncio.run(BodyLimit(route, max_bytes=10_000, api_key="sk-test")(scope, receive, send))
        return sent[0]["status"], pulled

    assert call(None) == (401, 0)
    assert call(b"Bearer wrong") == (401, 0)
    assert call(b"Bearer sk-test") == (200, 3) and reached == [b"x" * 3000]


def test_api_key_is_required_everywhere_but_health(served):
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/documents"), ("GET", "/v1/sessions"),
                         ("POST", "/v1/rag/query"), ("DELETE", "/v1/documents/x")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, served.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": MODEL, "messages": CHAT, "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "messages": CHAT, "n": 3}, 400, "n"),
    ({"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "gpt-4", "messages": CHAT}, 404, "model"),
    ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL, "messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": MODEL, "messages": CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
])
def test_malformed_chat_requests_get_openai_errors(served, body, status, param):
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param) and err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error")
    assert "Traceback" not in r.text


def test_options_that_ask_for_nothing_are_accepted_and_completions_refuse_the_rest(served):
    """OpenAI options the server cannot honour are refused (an answer without the asked-for tool call
    or log-probabilities would pass for one), but their neutral values, which clients send by
    default, are served like a request without them."""
    neutral = {"tools": [], "tool_choice": "none", "logprobs": False, "presence_penalty": 0, "logit_bias": {},
               "response_format": {"type": "text"}, "user": "someone"}
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, **neutral})
    assert r.status_code == 200, r.text
    for option, value in [("echo", True), ("best_of", 3), ("suffix", "end"), ("logprobs", 0)]:
        r = httpx.post(f"{served.url}/v1/completions", headers=AUTH,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, option: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == option, r.text
        assert "does not support" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("content", [
    '"hi \\ud800"', '[{"type": "text", "text": "hi"}, {"type": "text", "text": "\\udc00"}]'], ids=["string", "parts"])
def test_chat_text_that_cannot_be_utf8_is_a_400(served, content, stream):
    """A lone surrogate is valid JSON (an escape), yet no tokenizer can encode it: the chat route
    refuses it as the completions route refuses it in a prompt, before a stream starts."""
    body = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {content}}}], "max_tokens": 2, '
            f'"stream": {json.dumps(stream)}}}')
    r = httpx.post(f"{served.url}/v1/chat/completions", content=body.encode(),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content" and "unicode string" in err["message"]
    assert err["type"] == "invalid_request_error"
    prompt = f'{{"model": "{MODEL}", "prompt": "hi \\ud800", "max_tokens": 2}}'
    r = httpx.post(f"{served.url}/v1/completions", content=prompt.encode(),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "unicode string" in r.json()["error"]["message"]


def test_limits_and_bad_bodies(served, client):
    post = lambda path, **kw: httpx.post(served.url + path, headers={**AUTH, **kw.pop("headers", {})}, **kw)
    r = post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post("/v1/completions", json={"model": MODEL, "prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    too_long = [1] * (served.engine.max_model_len + 10)
    with pytest.raises(openai.BadRequestError, match="the prompt alone takes"):
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="the prompt alone takes"):  # also before a stream starts
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=4, stream=True)
    r = post("/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_cors_is_closed_by_default(served):
    pre = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{served.url}/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{served.url}/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_opens_to_the_origins_given(served):
    from fastapi.testclient import TestClient

    from ragfuse.connectors.server import ServerSettings, create_app

    app = create_app(served.backend, ServerSettings(cors_origins=("https://app.example",)), close_backend=False)
    with TestClient(app) as tc:
        ok = tc.options("/v1/models", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = tc.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


# ---- RAG, documents, sessions, metrics ---------------------------------------------------------


def test_rag_query_answers_from_fused_kv_with_sources_and_timing(served):
    body = {"question": QUESTION, "top_k": 2, "max_tokens": 24}
    r = httpx.post(f"{served.url}/v1/rag/query", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    ans = r.json()
    assert "lighthouses.md" in ans["sources"][0]["source"] and len(ans["sources"]) == 2
    assert ans["fusion"]["mode"] == "fuse" and ans["fusion"]["reused_tokens"] > 0
    # the instruction prefix as a relay system prompt, then the 2 chunks' stored KV
    assert ans["kv_tiers"][0] == "relay" and set(ans["kv_tiers"][1:]) <= {"cpu", "disk", "computed"}
    assert len(ans["kv_tiers"]) == 3 and ans["fusion"]["relay_system_tokens"] > 0
    for key in ("retrieve_s", "ttft_s", "total_s", "load_s", "recompute_s", "server_ttft_s"):
        assert ans["timing"][key] >= 0
    assert ans["timing"]["total_s"] >= ans["timing"]["ttft_s"]
    assert ans["usage"]["completion_tokens"] >= 1
    events = []
    with httpx.stream("POST", f"{served.url}/v1/rag/query", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["object"] == "rag.answer" and final["answer"] == ans["answer"]  # greedy both times
    text = "".join(json.loads(e)["delta"] for e in events[:-2])
    assert text.strip() == final["answer"]
    assert metric(served, "ragfuse_kv_cache_hits_total", tier="cpu") + metric(
        served, "ragfuse_kv_cache_hits_total", tier="disk") >= 2
    assert metric(served, "ragfuse_kv_cache_hits_total", tier="relay") >= 2
    off = httpx.post(f"{served.url}/v1/rag/query", json={**body, "relay": False}, headers=AUTH, timeout=120).json()
    assert off["answer"] == ans["answer"] and off["fusion"]["relay_system_tokens"] == 0  # greedy, same tokens
    assert off["kv_tiers"][0] != "relay" and off["usage"]["prompt_tokens"] == ans["usage"]["prompt_tokens"]


def test_rag_query_rejects_bad_options(served):
    for body, param in [({"question": ""}, "question"), ({"question": "q", "top_k": 500}, "top_k"),
                        ({"question": "q", "mode": "magic"}, "mode"),
                        ({"question": "q", "recompute_ratio": 2}, "recompute_ratio")]:
        r = httpx.post(f"{served.url}/v1/rag/query", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_documents_upload_list_delete(served):
    url = f"{served.url}/v1/documents"
    text = "The Zephyr ferry to Isle Marrow leaves every day at 7:40 from pier nine."
    r = httpx.post(url, json={"documents": [{"name": "ferry.md", "text": text}]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    (doc,) = r.json()["data"]
    assert doc["name"] == "ferry.md" and doc["chunks"] == 1 and doc["uploaded"]
    listed = httpx.get(url, headers=AUTH).json()["data"]
    assert doc["id"] in {d["id"] for d in listed} and len(listed) == 4
    assert all("/" not in d["name"] for d in listed)  # no server paths in listings
    ans = httpx.post(f"{served.url}/v1/rag/query", json={"question": "When does the Zephyr ferry leave?",
                                                          "top_k": 1, "max_tokens": 4}, headers=AUTH, timeout=120)
    assert ans.json()["sources"][0]["text"] == text
    binary = httpx.post(url, files=[("files", ("blob.txt", b"\x00\x01\x02"))], headers=AUTH, timeout=60)
    assert binary.status_code == 422 and binary.json()["error"]["message"] == \
        "nothing ingested: blob.txt: binary (NUL bytes)"
    # a file read only in part is stored and noted; beside it, a skipped one is reported, not an error
    records = b'{"text": "The Zephyr carries 40 bicycles."}\n{"body": "no text field"}\n'
    mixed = httpx.post(url, files=[("files", ("bikes.jsonl", records)), ("files", ("blob.txt", b"\x00"))],
                       headers=AUTH, timeout=120)
    assert mixed.status_code == 200, mixed.text
    assert [d["name"] for d in mixed.json()["data"]] == ["bikes.jsonl"]
    assert mixed.json()["skipped"] == [{"name": "blob.txt", "reason": "binary (NUL bytes)"}]
    assert mixed.json()["notes"] == [{"name": "bikes.jsonl",
                                      "note": "left out 1 record without a string field 'text'"}]
    assert httpx.delete(f"{url}/{mixed.json()['data'][0]['id']}", headers=AUTH).json()["deleted"] is True
    assert httpx.delete(f"{url}/{doc['id']}", headers=AUTH).json()["deleted"] is True
    assert httpx.delete(f"{url}/{doc['id']}", headers=AUTH).status_code == 404
    assert doc["id"] not in {d["id"] for d in httpx.get(url, headers=AUTH).json()["data"]}


def test_streams_go_on_while_a_document_is_ingested(served):
    """An upload is chunked and embedded off the engine thread and its KV computed in batches between
    decode steps: a running stream's longest wait for a token during the upload is a fraction of the
    upload's time (it was all of it when the whole ingest ran as one call on the engine thread)."""
    text = " ".join(f"Ledger line {i}: the Quarrel Bay customs house weighed {i * 37 % 1000} crates of "
                    f"{('salt', 'tin', 'wool', 'amber')[i % 4]}." for i in range(240))
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "prompt": "1, 2, 3, 4, 5, 6,"}
    arrivals: list[float] = []
    window: list[float] = []

    async def stream() -> None:
        async with httpx.AsyncClient(timeout=300) as c, c.stream(
                "POST", f"{served.url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    async def upload() -> None:
        while len(arrivals) < 3:  # the stream runs
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(timeout=300) as c:
            window.append(time.monotonic())
            r = await c.post(f"{served.url}/v1/documents", headers=AUTH,
                             json={"documents": [{"name": "ledger.md", "text": text}]})
            window.append(time.monotonic())
        assert r.status_code == 200 and r.json()["data"][0]["chunks"] >= 4, r.text

    async def both() -> None:
        await asyncio.gather(stream(), upload())

    asyncio.run(both())
    start, end = window
    inside = [start, *[t for t in arrivals if start < t < end], min(end, arrivals[-1])]
    longest = max(b - a for a, b in zip(inside, inside[1:]))
    assert longest < 0.5 * (end - start), (longest, end - start, len(inside))
    doc = next(d for d in httpx.get(f"{served.url}/v1/documents", headers=AUTH).json()["data"]
               if d["name"] == "ledger.md")
    assert httpx.delete(f"{served.url}/v1/documents/{doc['id']}", headers=AUTH).json()["deleted"] is True


def test_an_upload_the_disk_has_no_room_for_is_a_507_and_changes_nothing(served):
    """The KV tier's real free-space check refuses (its reserve raised): the client gets a server
    error naming the cause, and neither the document list nor the uploads directory changes."""
    from ragfuse.engine.kvstore import DiskTier

    url = f"{served.url}/v1/documents"
    listed = httpx.get(url, headers=AUTH).json()["data"]
    disk = next(t for t in served.backend.pipeline.store.kv.tiers if isinstance(t, DiskTier))
    reserve, disk.reserve_bytes = disk.reserve_bytes, 1 << 62
    try:
        doc = {"name": "tides.md", "text": "Spring tides at Hollowpoint reach 6.1 metres in March."}
        r = httpx.post(url, json={"documents": [doc]}, headers=AUTH, timeout=120)
    finally:
        disk.reserve_bytes = reserve
    assert r.status_code == 507 and "no room on disk" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "server_error"
    assert httpx.get(url, headers=AUTH).json()["data"] == listed
    assert not (served.store / "uploads" / "tides.md").exists()


def test_a_read_only_store_refuses_uploads_and_deletes_with_403(served):
    """A server over a store it cannot write (opened read-only: tests/test_read_only_store.py) answers
    from it, and refuses what would change it with a 403 naming why, before anything is written."""
    store = served.backend.pipeline.store
    url = f"{served.url}/v1/documents"
    listed = httpx.get(url, headers=AUTH).json()["data"]
    store.read_only = True
    try:
        doc = {"name": "tides.md", "text": "Spring tides at Hollowpoint reach 6.1 metres in March."}
        up = httpx.post(url, json={"documents": [doc]}, headers=AUTH, timeout=120)
        gone = httpx.delete(f"{url}/{listed[0]['id']}", headers=AUTH)
        ask = httpx.post(f"{served.url}/v1/rag/query", json={"question": "How tall is the Hollowpoint tower?",
                                                             "max_tokens": 4}, headers=AUTH, timeout=120)
    finally:
        store.read_only = False
    for r in (up, gone):
        assert r.status_code == 403 and "is read-only" in r.json()["error"]["message"], r.text
    assert ask.status_code == 200 and ask.json()["answer"].strip()
    assert httpx.get(url, headers=AUTH).json()["data"] == listed
    assert not (served.store / "uploads" / "tides.md").exists()


@pytest.mark.parametrize("content", [b"   ", b"\x00\x01\x02"], ids=["blank", "binary"])
def test_a_skipped_replacement_loses_nothing(served, content):
    """Re-uploading a document with content the ingest skips (blank, binary) reports only the skip:
    the earlier upload stays listed with its chunks and on disk with its bytes."""
    url = f"{served.url}/v1/documents"
    text = "Alpha beta gamma delta: the four harbour buoys of Hollowpoint."
    r = httpx.post(url, json={"documents": [{"name": "buoys.md", "text": text}]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    (doc,) = r.json()["data"]
    listed = httpx.get(url, headers=AUTH).json()["data"]
    r = httpx.post(url, files=[("files", ("buoys.md", content))], headers=AUTH, timeout=120)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith("nothing ingested: buoys.md: ")
    assert httpx.get(url, headers=AUTH).json()["data"] == listed
    assert (served.store / "uploads" / "buoys.md").read_text() == text
    r = httpx.post(url, files=[("files", ("new-blank.md", content))], headers=AUTH, timeout=120)
    assert r.status_code == 422 and not (served.store / "uploads" / "new-blank.md").exists()
    assert httpx.get(url, headers=AUTH).json()["data"] == listed
    assert httpx.delete(f"{url}/{doc['id']}", headers=AUTH).json()["deleted"] is True  # the next tests' store


def test_an_upload_nested_too_deeply_is_skipped_not_a_server_error(served):
    """JSON deeper than the decoder can recurse (a 100 kB upload of "[") is a file the ingest skips
    with its reason, like any unreadable one; the server stays up and keeps nothing of it."""
    url = f"{served.url}/v1/documents"
    listed = httpx.get(url, headers=AUTH).json()["data"]
    r = httpx.post(url, files=[("files", ("deep.json", b"[" * 100_000))], headers=AUTH, timeout=120)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == "nothing ingested: deep.json: JSON nested too deeply to read"
    assert httpx.get(url, headers=AUTH).json()["data"] == listed
    assert not (served.store / "uploads" / "deep.json").exists()


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "a/b.txt", "notes.exe", "", ".hidden.txt"])
def test_documents_are_only_uploaded_content(served, name):
    r = httpx.post(f"{served.url}/v1/documents", json={"documents": [{"name": name, "text": "x"}]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{served.url}/v1/documents", content=b"/etc/passwd", headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415


def test_sessions_reuse_the_engines_stored_kv_list_and_delete(served, client):
    """A chat naming a session continues it from the engine's session store: the second turn's
    history KV is reused (usage says how much), the answer is the one a stateless request gets,
    and the session is listed (tokens, tier, last access) and deleted (its KV files too)."""
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"session_id": "s-1"})
    assert first.usage.model_extra["ragfuse"]["session_tokens_reused"] == 0
    chat = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And two animals?"}]
    turns0 = metric(served, "ragfuse_session_turns_total", tier="cpu")
    second = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0,
                                            extra_body={"session_id": "s-1"})
    reuse = second.usage.model_extra["ragfuse"]
    assert reuse["session_id"] == "s-1" and reuse["session_tier"] == "cpu"
    assert reuse["session_tokens_reused"] >= first.usage.prompt_tokens  # the first turn's prompt, at least
    assert second.usage.prompt_tokens_details.cached_tokens >= reuse["session_tokens_reused"]
    stateless = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0)
    assert second.choices[0].message.content == stateless.choices[0].message.content
    assert metric(served, "ragfuse_session_turns_total", tier="cpu") == turns0 + 1
    assert metric(served, "ragfuse_session_reused_tokens_total") >= reuse["session_tokens_reused"]

    sessions = httpx.get(f"{served.url}/v1/sessions", headers=AUTH).json()["data"]
    (s1,) = [s for s in sessions if s["id"] == "s-1"]
    assert s1["tokens"] == second.usage.total_tokens
    assert s1["stored_tokens"] == s1["tokens"]  # the answer's last token too: its closing step computed it
    assert s1["tier"] == "cpu" and s1["last_access"] >= s1["created"] > 0 and s1["bytes"] > 0
    records = served.store / "sessions" / "records"  # under the store directory by default
    deadline = time.monotonic() + 20
    while not (records / "s-1.json").exists():
        assert time.monotonic() < deadline, "the session's KV never reached disk"
        time.sleep(0.05)
    assert httpx.delete(f"{served.url}/v1/sessions/s-1", headers=AUTH).json()["deleted"] is True
    assert httpx.delete(f"{served.url}/v1/sessions/s-1", headers=AUTH).status_code == 404
    assert "s-1" not in {s["id"] for s in httpx.get(f"{served.url}/v1/sessions", headers=AUTH).json()["data"]}
    deadline = time.monotonic() + 20
    while (records / "s-1.json").exists():
        assert time.monotonic() < deadline, "the deleted session's files stayed"
        time.sleep(0.05)
    again = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, extra_body={"session_id": "s-1"})
    assert again.usage.model_extra["ragfuse"]["session_tokens_reused"] == 0  # deleted: a new conversation
    r = httpx.delete(f"{served.url}/v1/sessions/bad%20id", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_session_turns_stream_with_usage(served, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"session_id": "s-stream"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat = [*CHAT, {"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"session_id": "s-stream"}))
    usage = chunks[-1].usage
    assert usage.model_extra["ragfuse"]["session_tokens_reused"] > 0
    assert usage.prompt_tokens_details.cached_tokens >= usage.model_extra["ragfuse"]["session_tokens_reused"]


def test_rag_query_as_a_session_turn(served):
    body = {"question": QUESTION, "top_k": 1, "max_tokens": 6, "session_id": "rag-1"}
    first = httpx.post(f"{served.url}/v1/rag/query", json=body, headers=AUTH, timeout=120).json()
    assert first["session"]["session_tokens_reused"] == 0
    second = httpx.post(f"{served.url}/v1/rag/query", json={**body, "question": "Who built it?"}, headers=AUTH,
                        timeout=120).json()
    assert second["session"]["session_tokens_reused"] >= first["usage"]["prompt_tokens"]
    assert second["usage"]["ragfuse"]["session_tier"] == "cpu"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["session"]["session_tokens_reused"]
    assert "rag-1" in {s["id"] for s in httpx.get(f"{served.url}/v1/sessions", headers=AUTH).json()["data"]}


SYSTEM_CHAT = [{"role": "system", "content": "You are a terse assistant for a lighthouse museum. Answer in "
                                              "one short sentence and never use lists."},
               {"role": "user", "content": "What does a lighthouse keeper do?"}]


def test_relay_serves_system_messages_with_the_tokens_of_plain_prefill(served, client):
    """A chat with a system message registers it once and runs through relay attention; greedy
    output equals the same request without relay, streaming or not."""
    before = served.engine.relay_prompts.reuses
    kw = {"model": MODEL, "max_tokens": 16, "temperature": 0}
    off = client.chat.completions.create(messages=SYSTEM_CHAT, extra_body={"relay": False}, **kw)
    on = client.chat.completions.create(messages=SYSTEM_CHAT, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.usage.prompt_tokens == off.usage.prompt_tokens  # the system prompt counts either way
    relay = on.usage.model_extra["ragfuse"]["relay_system_tokens"]
    assert off.usage.model_extra["ragfuse"]["relay_system_tokens"] == 0 and 20 < relay < on.usage.prompt_tokens
    # the first request's system KV was computed for it, not served from a cache
    assert on.usage.prompt_tokens_details.cached_tokens == on.usage.model_extra["ragfuse"]["prefix_cached_tokens"]
    other = [SYSTEM_CHAT[0], {"role": "user", "content": "Why are lighthouses tall?"}]
    streamed = list(client.chat.completions.create(messages=other, stream=True,
                                                   stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    plain = client.chat.completions.create(messages=other, extra_body={"relay": False}, **kw)
    assert text == plain.choices[0].message.content
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= relay  # the next one's is cached
    assert served.engine.relay_prompts.reuses == before + 1  # registered once, found by the second request
    assert metric(served, "ragfuse_relay_system_prompts") >= 1
    assert metric(served, "ragfuse_relay_requests_total") >= 2
    assert metric(served, "ragfuse_relay_system_tokens_total") >= 2 * relay


def test_metrics_report_ttft_tokens_and_queue(served, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert metric(served, "ragfuse_time_to_first_token_seconds_count", endpoint="chat") >= 1
    assert metric(served, "ragfuse_generated_tokens_total") >= 4
    text = httpx.get(f"{served.url}/metrics", headers=AUTH).text
    assert "ragfuse_queue_depth 0.0" in text and "ragfuse_decode_tokens_per_second_bucket" in text
    assert "ragfuse_kv_cache_usage_ratio " in text and "ragfuse_swap_space_bytes 0.0" in text


def test_serve_command_refuses_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "ragfuse.cli", "serve", "--port", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("ragfuse: error: --port")
    r = subprocess.run([sys.executable, "-m", "ragfuse.cli", "serve", "--backend", "tgi"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_vllm_backend_without_vllm_says_how_to_install(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ragfuse.cli", "serve", "--backend", "vllm", "--store",
                        str(tmp_path / "store")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "scripts/test_vllm.sh" in r.stderr and "Traceback" not in r.stderr


def test_serve_on_a_port_in_use_says_so_before_loading_a_model(capsys, monkeypatch):
    """uvicorn binds once the app is built: a second server on a port took its model's loading time
    (seconds to minutes) to fail, with uvicorn's log. The port is bound first, one line, exit 2."""
    import socket

    from ragfuse.cli import main
    from ragfuse.commands import serve

    def no_model(args):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(serve, "build_backend", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ragfuse: error: cannot serve on 127.0.0.1:{port}: in use (another server?)"
