"""The LangChain and LlamaIndex connectors' async methods, as an asyncio app (FastAPI) uses them, with the real
default model on CPU: the event loop keeps running while the model does, streams arrive token by token and
add up to the plain answer, a cancelled or abandoned stream frees the engine, concurrent calls answer as
calls made one by one, and a bad request raises from the awaited call.

Timings are compared with the same run's own generation time, never with absolute numbers, so a loaded
machine slows both sides alike."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import NodeWithScore, QueryBundle

from ragfuse.app import shared_pipeline
from ragfuse.connectors.langchain import ChatRagfuse
from ragfuse.connectors.llamaindex import RagfuseLLM, RagfuseRetriever, ragfuse_query_engine
from ragfuse.engine import LLMEngine
from tests.store_helpers import connector_store

PARAMS = {"device": "cpu", "max_tokens": 24, "recompute_ratio": 0.2}
LONG = {**PARAMS, "max_tokens": 64}  # long enough that an abandoned request would still be decoding
STORY = "Write a long story about a lighthouse keeper and the sea."
QUESTION = "When was the Hollowpoint lighthouse electrified?"
QUESTIONS = ["Name a colour.", "What is the capital of France?", "Say hi.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


@pytest.fixture(scope="module")
def hi() -> str:
    """A short answer made synchronously, to check that the engine still answers as before."""
    return ChatRagfuse(**PARAMS).invoke("Say hi.").content


def engine() -> LLMEngine:
    """The engine every connector above shares (one per model and device)."""
    return shared_pipeline(None, device="cpu").engine


@dataclass
class Ticks:
    """A task ticking every 10 ms: its largest gap is how long the event loop was kept from running."""

    gaps: list[float] = field(default_factory=list)

    @property
    def largest(self) -> float:
        return max(self.gaps)


@asynccontextmanager
async def ticking() -> AsyncIterator[Ticks]:
    ticks = Ticks()
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            ticks.gaps.append(now - last)
            last = now

    task = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        yield ticks
    finally:
        done.set()
        await task


async def timed(call: Awaitable[Any]) -> tuple[Any, float, float]:
    """The call's result, its duration and the event loop's largest stall meanwhile."""
    async with ticking() as ticks:
        t0 = time.perf_counter()
        result = await call
        duration = time.perf_counter() - t0
    return result, duration, ticks.largest


async def until_busy() -> None:
    """Until the engine holds a request (a call started on its worker thread has reached it)."""
    for _ in range(3000):
        if engine().has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call never reached the engine")


async def read_all(stream: AsyncIterator[Any]) -> list[tuple[float, str]]:
    """(arrival time, text) of each chunk; LangChain chunks have ``content``, LlamaIndex ones ``delta``."""
    return [(time.perf_counter(), c.delta if hasattr(c, "delta") else c.content) async for c in stream]


async def test_calls_leave_the_event_loop_running(store):
    chat, llm = ChatRagfuse(**PARAMS), RagfuseLLM(**PARAMS)
    await chat.ainvoke("warm up")  # the engine's load is not what is measured
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "langchain ainvoke": lambda: chat.ainvoke(STORY),
        "langchain astream": lambda: read_all(chat.astream(STORY)),
        "langchain agenerate": lambda: chat.agenerate([[HumanMessage(STORY)]]),
        "llamaindex achat": lambda: llm.achat([ChatMessage(role="user", content=STORY)]),
        "llamaindex astream_complete": lambda: _await_then_read(llm.astream_complete(STORY)),
        "llamaindex aquery": lambda: ragfuse_query_engine(store, llm=RagfuseLLM(store=store, **PARAMS),
                                                          similarity_top_k=2).aquery(QUESTION),
    }
    for name, call in calls.items():
        _, duration, stall = await timed(call())
        assert stall < duration / 3, f"{name}: the loop stalled {stall:.2f}s of a {duration:.2f}s call"


async def _await_then_read(opened: Awaitable[AsyncIterator[Any]]) -> list[tuple[float, str]]:
    return await read_all(await opened)


async def test_llamaindex_retrieval_runs_off_the_event_loop(store):
    """LlamaIndex's default ``_aretrieve`` calls ``_retrieve`` on the loop: embedding the query (and, on first
    use, loading the embedding model) stalled every other task of the app."""
    threads: list[int] = []

    class Recording(RagfuseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            threads.append(threading.get_ident())
            return super()._retrieve(query_bundle)

    nodes = await Recording(store, 2).aretrieve(QUESTION)
    assert "1952" in nodes[0].node.get_content()
    assert threads and threads[0] != threading.get_ident()


async def test_streams_arrive_token_by_token_and_add_up_to_the_answer(store):
    chat, llm = ChatRagfuse(**PARAMS), RagfuseLLM(**PARAMS)
    messages = [ChatMessage(role="user", content=STORY)]
    plain = {"langchain": (await chat.ainvoke(STORY)).content,
             "llamaindex": (await llm.achat(messages)).message.content}
    streams = {"langchain": chat.astream(STORY), "llamaindex": await llm.astream_chat(messages)}
    for name, stream in streams.items():
        t0 = time.perf_counter()
        chunks = await read_all(stream)
        first, last = chunks[0][0] - t0, chunks[-1][0] - t0
        assert len(chunks) > 10 and first < last / 3, f"{name}: first chunk at {first:.2f}s, last at {last:.2f}s"
        assert "".join(text for _, text in chunks) == plain[name]
    engine_args = {"llm": RagfuseLLM(store=store, **PARAMS), "similarity_top_k": 2}
    answer = str(await ragfuse_query_engine(store, **engine_args).aquery(QUESTION))
    streamed = await ragfuse_query_engine(store, streaming=True, **engine_args).aquery(QUESTION)
    assert "".join([d async for d in streamed.async_response_gen()]) == answer and "1952" in answer


async def _cancel_langchain_stream(chat: ChatRagfuse, llm: RagfuseLLM, store: str) -> None:
    async for _ in chat.astream(STORY):
        pass  # cancelled while waiting for the next chunk


async def _cancel_llamaindex_stream(chat: ChatRagfuse, llm: RagfuseLLM, store: str) -> None:
    async for _ in await llm.astream_chat([ChatMessage(role="user", content=STORY)]):
        pass


async def _cancel_query_stream(chat: ChatRagfuse, llm: RagfuseLLM, store: str) -> None:
    response = await ragfuse_query_engine(store, llm=RagfuseLLM(store=store, **LONG), streaming=True,
                                          similarity_top_k=2).aquery(STORY)
    async for _ in response.async_response_gen():
        pass


@pytest.mark.parametrize("call", [
    lambda chat, llm, store: chat.ainvoke(STORY),
    _cancel_langchain_stream,
    lambda chat, llm, store: llm.acomplete(STORY),
    _cancel_llamaindex_stream,
    _cancel_query_stream,
], ids=["langchain-ainvoke", "langchain-astream", "llamaindex-acomplete", "llamaindex-astream_chat",
        "llamaindex-aquery-streaming"])
async def test_cancelled_call_has_aborted_its_request_when_it_returns(store, hi, call):
    """Before, the request was aborted only at the worker's next step after the cancelled call returned:
    an app checking (or a test asserting) right then found it still decoding."""
    chat, llm = ChatRagfuse(**LONG), RagfuseLLM(**LONG)
    task = asyncio.create_task(call(chat, llm, store))
    await until_busy()
    await asyncio.sleep(0.2)  # a few tokens in
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine().has_unfinished()
    assert (await ChatRagfuse(**PARAMS).ainvoke("Say hi.")).content == hi


async def test_breaking_out_of_a_stream_frees_the_engine(store):
    """Breaking out of ``async for`` leaves the stream to be closed by the event loop's finaliser; the engine
    must be free well before the request's remaining tokens could have been decoded. A LlamaIndex streaming
    query's answer was never closed while the response object lived: it decoded to the end."""
    chat, llm = ChatRagfuse(**LONG), RagfuseLLM(**LONG)
    t0 = time.perf_counter()
    full = await chat.ainvoke(STORY)
    duration = time.perf_counter() - t0
    assert full.usage_metadata["output_tokens"] == LONG["max_tokens"]  # the whole request is that long

    async def langchain() -> None:
        async for _ in chat.astream(STORY):
            break

    async def llamaindex() -> None:
        async for _ in await llm.astream_complete(STORY):
            break

    response = None

    async def query() -> None:
        nonlocal response  # an app keeping the response (for its sources) while the client went away
        response = await ragfuse_query_engine(store, llm=RagfuseLLM(store=store, **LONG), streaming=True,
                                              similarity_top_k=2).aquery(STORY)
        async for _ in response.async_response_gen():
            break

    for name, stop_early in {"langchain": langchain, "llamaindex": llamaindex, "query": query}.items():
        t0 = time.perf_counter()
        await stop_early()
        while engine().has_unfinished() and time.perf_counter() - t0 < duration / 2:
            await asyncio.sleep(0.01)
        assert not engine().has_unfinished(), f"{name}: still decoding {time.perf_counter() - t0:.2f}s later"
    assert response is not None and response.source_nodes


async def test_concurrent_calls_answer_as_calls_one_by_one():
    chat, llm = ChatRagfuse(**PARAMS), RagfuseLLM(**PARAMS)
    one_by_one = [(await chat.ainvoke(q)).content for q in QUESTIONS]
    together = await asyncio.wait_for(asyncio.gather(*(chat.ainvoke(q) for q in QUESTIONS)), 600)
    assert [r.content for r in together] == one_by_one
    assert [r.content for r in await chat.abatch(QUESTIONS)] == one_by_one
    mixed = await asyncio.wait_for(asyncio.gather(
        *(llm.achat([ChatMessage(role="user", content=q)]) for q in QUESTIONS[:2]),
        *(_text_of(chat.astream(q)) for q in QUESTIONS[2:])), 600)
    assert [m.message.content for m in mixed[:2]] + mixed[2:] == one_by_one  # a completion is one user turn
    assert not engine().has_unfinished()


async def _text_of(stream: AsyncIterator[Any]) -> str:
    return "".join(text for _, text in await read_all(stream))


async def test_bad_request_raises_from_the_awaited_call():
    """A streaming LlamaIndex call handed back a stream that failed only when read; now it raises where it is
    made, as the other calls do. No call leaves a hung task or a request behind."""
    chat, llm = ChatRagfuse(**PARAMS), RagfuseLLM(**PARAMS)
    image = ChatMessage(role="user", blocks=[{"block_type": "image", "url": "http://x/y.png"}])
    with pytest.raises(ValueError, match="does not take top_k"):
        await asyncio.wait_for(llm.astream_complete("hi", top_k=5), 60)
    with pytest.raises(ValueError, match="does not take top_k"):
        await asyncio.wait_for(llm.astream_chat([ChatMessage(role="user", content="hi")], top_k=5), 60)
    with pytest.raises(ValueError, match="text only"):
        await asyncio.wait_for(llm.astream_chat([image]), 60)
    with pytest.raises(ValueError, match="does not take top_k"):
        await asyncio.wait_for(llm.acomplete("hi", top_k=5), 60)
    with pytest.raises(ValueError, match="does not take top_k"):
        await asyncio.wait_for(chat.ainvoke("hi", top_k=5), 60)
    with pytest.raises(ValueError, match="does not take top_k"):
        await asyncio.wait_for(_text_of(chat.astream("hi", top_k=5)), 60)
    with pytest.raises(ValueError, match="unknown mode"):
        await asyncio.wait_for(RagfuseLLM(mode="magic", device="cpu").acomplete("hi"), 60)
    assert not engine().has_unfinished()
    assert (await llm.acomplete("Say hi.")).text
