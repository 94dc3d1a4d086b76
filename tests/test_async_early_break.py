"""Breaking out of a connector's async stream early, in a script's ``asyncio.run``, with the real default model
on CPU: nothing is logged when the loop closes and the engine holds no request once ``asyncio.run`` returns.

Before, the frameworks' wrappers (LlamaIndex's callback wrapper, LangChain's ``astream``) left the worker's
stream to asyncio's generator finaliser, which closed it in a task created while the loop was shutting down:
"Task was destroyed but it is pending!", or "aclose(): asynchronous generator is already running", and the
request still decoding after the loop had closed (the worker killed mid-step at exit aborted the process)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing

import pytest
from llama_index.core.base.llms.types import ChatMessage

from ragfuse.app import shared_pipeline
from ragfuse.connectors.async_iter import iterate_in_thread
from ragfuse.connectors.langchain import ChatRagfuse
from ragfuse.connectors.llamaindex import RagfuseLLM, ragfuse_query_engine
from tests.store_helpers import connector_store

PARAMS = {"device": "cpu", "max_tokens": 64, "recompute_ratio": 0.2}  # long enough to be left decoding
STORY = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


async def _first(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        break


async def _llamaindex_complete(store: str) -> None:
    await _first(await RagfuseLLM(**PARAMS).astream_complete(STORY))


async def _llamaindex_chat(store: str) -> None:
    await _first(await RagfuseLLM(**PARAMS).astream_chat([ChatMessage(role="user", content=STORY)]))


async def _langchain(store: str) -> None:
    await _first(ChatRagfuse(**PARAMS).astream(STORY))


async def _langchain_aclosing(store: str) -> None:
    async with aclosing(ChatRagfuse(**PARAMS).astream(STORY)) as stream:
        await _first(stream)


async def _query(store: str) -> None:
    response = await ragfuse_query_engine(store, llm=RagfuseLLM(store=store, **PARAMS), streaming=True,
                                          similarity_top_k=2).aquery(STORY)
    await _first(response.async_response_gen())


async def _cancelled_reader(store: str) -> None:
    """A reader task cancelled and left behind when ``main`` returns: its close is cut short by the loop's
    shutdown cancelling it again."""
    first = asyncio.Event()

    async def read() -> None:
        async for _ in await RagfuseLLM(**PARAMS).astream_complete(STORY):
            first.set()

    task = asyncio.create_task(read())
    await first.wait()
    task.cancel()


@pytest.mark.parametrize("stop_early", [_llamaindex_complete, _llamaindex_chat, _langchain, _langchain_aclosing,
                                        _query, _cancelled_reader],
                         ids=["llamaindex-astream_complete", "llamaindex-astream_chat", "langchain-astream",
                              "langchain-astream-aclosing", "llamaindex-aquery-streaming", "cancelled-reader"])
def test_early_break_in_asyncio_run_is_cleaned_up_within_the_loop(
        store: str, stop_early: Callable[[str], Awaitable[None]], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio.run(stop_early(store))
        assert not shared_pipeline(None, device="cpu").engine.has_unfinished()
        gc.collect()  # a task left pending is reported when it is collected
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_dropped_stream_has_closed_its_generator_when_asyncio_run_returns() -> None:
    """Without the engine: the worker's generator is closed (its ``finally`` has run) by the time the loop
    is gone, also when the stream is dropped unread after its first item."""
    closed = threading.Event()

    def numbers() -> Iterator[int]:
        try:
            n = 0
            while True:
                yield n
                n += 1
                threading.Event().wait(0.01)  # a step of work, as the engine's
        finally:
            closed.set()

    async def main() -> None:
        await _first(iterate_in_thread(numbers))

    asyncio.run(main())
    assert closed.is_set()
