"""Consuming a backend's deltas for HTTP: as server-sent events, or whole, and in both cases the
request is cancelled (its engine request aborted) as soon as the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request

from .errors import ClientDisconnected, describe_error, error_body

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
POLL_S = 0.25


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (Starlette does not cancel a
    non-streaming handler by itself, and a long generation would otherwise run for nobody)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()


async def first_item(request: Request, items: AsyncIterator[T]) -> T:
    """The first item, awaited before the response starts, so a request the engine refuses (prompt
    too long, empty store) gets a proper 4xx instead of an error inside a 200 stream."""
    try:
        return await unless_disconnected(request, anext(items))
    except BaseException:
        await items.aclose()
        raise


async def collect(request: Request, items: AsyncIterator[T]) -> list[T]:
    async def drain() -> list[T]:
        async with aclosing(items):
            return [x async for x in items]

    return await unless_disconnected(request, drain())


async def event_stream(first: T, rest: AsyncIterator[T], render: Callable[[T], list[str]],
                       tail: Callable[[], list[str]]) -> AsyncIterator[str]:
    """SSE lines for ``first`` and then every item of ``rest``; ``tail`` after the last. An error
    mid-stream becomes one OpenAI-format error event (no traceback). Closing this generator (a client
    disconnect cancels it) closes ``rest``, which aborts the engine request."""
    try:
        for line in render(first):
            yield line
        async for item in rest:
            for line in render(item):
                yield line
        for line in tail():
            yield line
    except Exception as exc:
        yield sse(error_body(*describe_error(exc)))
    finally:
        await rest.aclose()
    yield DONE

