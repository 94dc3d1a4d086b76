"""What a user closes or drops is released: no object, thread or open file of it outlives it.

A server app made in-process (a restart, each server test) stayed reachable for the life of the process
through FastAPI's process-wide caches of the route functions it inspects, and with it the backend: the
pipeline, its open stores and session store, and an engine it loaded (weights and KV cache). An
``AsyncEngine`` dropped without ``shutdown`` kept its thread and engine for good, and one shut down while
a request ran left that request in the engine, holding its cache blocks, and its caller waiting forever."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from ragfuse.engine import AsyncEngine, RequestError, SamplingParams
from tests.server_helpers import KEY, MODEL, LiveServer
from tests.test_engine_scheduling import random_engine


def _collected(ref: weakref.ref[object]) -> bool:
    gc.collect()
    return ref() is None


@pytest.mark.slow
def test_a_stopped_server_app_frees_its_backend_and_stores(llm, tmp_path: Path):
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline

    backend = EngineBackend(open_store_pipeline(str(tmp_path / "store"), MODEL, engine=llm.engine, gate=False), MODEL)
    app = create_app(backend, ServerSettings(api_key=KEY, max_tokens=8))
    auth = {"Authorization": f"Bearer {KEY}"}
    with LiveServer(app) as srv:
        assert httpx.get(f"{srv.url}/health", timeout=60).json()["model"] == MODEL
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            assert httpx.get(f"{srv.url}{path}", headers=auth, timeout=60).status_code == 200, path
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, headers=auth, timeout=300)
        assert r.status_code == 200, r.text
    refs = {"app": weakref.ref(app), "backend": weakref.ref(backend), "pipeline": weakref.ref(backend.pipeline),
            "sessions": weakref.ref(backend.sessions)}
    del app, backend, srv
    assert [name for name, ref in refs.items() if not _collected(ref)] == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("ragfuse-engine", "ragfuse-session"))]


@pytest.mark.slow
def test_an_app_never_started_is_freed_with_its_backend(llm, tmp_path: Path):
    """Making the app is enough for FastAPI to cache its routes: the backend went with them."""
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline

    backend = EngineBackend(open_store_pipeline(str(tmp_path / "store"), MODEL, engine=llm.engine, gate=False), MODEL)
    app = create_app(backend, ServerSettings(api_key=KEY), close_backend=False)
    ref = weakref.ref(backend)
    del app
    backend.close()
    del backend
    assert _collected(ref)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ragfuse-engine"]


def test_an_async_engine_dropped_without_shutdown_ends_its_thread_and_frees_the_engine():
    engine = random_engine(kv_blocks=64)
    aeng = AsyncEngine(engine)

    async def ask(front: AsyncEngine) -> list[int]:
        return [o async for o in front.generate([4, 5], SamplingParams(max_tokens=2))][-1].token_ids

    assert len(asyncio.run(ask(aeng))) == 2
    ref, threads = weakref.ref(engine), _engine_threads()
    del aeng, engine
    gc.collect()
    for t in threads:
        t.join(timeout=10)
    assert [t for t in threads if t.is_alive()] == []
    assert _collected(ref)


def test_shutdown_aborts_the_requests_running_and_tells_their_callers():
    """The engine may be shared (``LLM.from_engine`` over the server's): a request left in it kept its
    cache blocks and would be stepped by the next user; its caller waited forever."""
    engine = random_engine(kv_blocks=200)
    aeng = AsyncEngine(engine)
    free = engine.blocks.num_free

    async def shut_down_midway() -> None:
        stream = aeng.generate([4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
        assert not (await anext(stream)).finished
        aeng.shutdown()
        with pytest.raises(RequestError, match="shut down while this request ran"):
            async with asyncio.timeout(10):
                async for out in stream:  # the outputs delivered before the shutdown, then the refusal
                    assert not out.finished
        with pytest.raises(RequestError, match="was shut down"):
            await aeng.call(lambda e: e.has_unfinished())

    asyncio.run(shut_down_midway())
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == free


@pytest.mark.slow
def test_a_request_in_flight_when_the_server_stops_is_a_503(llm, tmp_path: Path):
    """A server told to stop ends its engine's requests (``AsyncEngine.stop``): a non-streamed answer
    still being generated then failed as a 400 ``invalid_request_error``, as if the request were bad;
    it is a 503, which clients retry."""
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline

    backend = EngineBackend(open_store_pipeline(str(tmp_path / "store"), MODEL, engine=llm.engine, gate=False), MODEL)
    app = create_app(backend, ServerSettings(api_key=KEY, max_tokens=2000))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
            "temperature": 0}
    replies: list[httpx.Response] = []
    with LiveServer(app) as srv:
        asking = threading.Thread(target=lambda: replies.append(httpx.post(
            f"{srv.url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)))
        asking.start()
        while backend.running() == 0:
            assert asking.is_alive(), replies[0].text
            time.sleep(0.02)
        backend.loop.stop()
        asking.join(60)
    (reply,) = replies
    assert reply.status_code == 503, reply.text
    assert "shut down while this request ran" in reply.json()["error"]["message"], reply.text


def test_shutdown_waits_for_a_long_call_to_end_and_says_so(caplog):
    """A step or call on the engine thread cannot be cut short; a shutdown that returned while it ran
    let its caller close stores under it and hand the engine to others. It waits, and logs that it does."""
    engine = random_engine(kv_blocks=64)
    aeng = AsyncEngine(engine)
    release = threading.Event()
    ended: list[float] = []

    def long_call(_engine) -> None:
        release.wait(timeout=30)
        time.sleep(0.2)  # still inside the call after it is released
        ended.append(time.perf_counter())

    async def start_call() -> asyncio.Task:
        task = asyncio.create_task(aeng.call(long_call))
        await asyncio.sleep(0.2)  # the engine thread is now inside the call
        return task

    loop = asyncio.new_event_loop()
    try:
        task = loop.run_until_complete(start_call())
        threading.Timer(0.5, release.set).start()
        with caplog.at_level("WARNING", logger="ragfuse.engine"):
            aeng.shutdown(notice_every=0.1)
        returned = time.perf_counter()
        loop.run_until_complete(task)
    finally:
        loop.close()
    assert ended and returned >= ended[0]
    assert "waiting for the engine's current step or call to end" in caplog.text
