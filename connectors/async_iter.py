"""Iterating a blocking generator from async code: the generator runs on a worker thread.

The framework connectors' async methods stream from the pipeline, which drives the engine
synchronously. The worker hands items over through the caller's event loop; when the caller stops
early (a cancelled task, a closed stream), the worker closes the generator at its next item, which
aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield what ``make()``'s generator yields; its exceptions are raised here."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    stop = threading.Event()

    def put(item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            gen = make()
            try:
                for item in gen:
                    put(item)
                    if stop.is_set():
                        break
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # handed to the caller, raised there
            put(exc)
            return
        put(_DONE)

    thread = threading.Thread(target=work, name="ragfuse-connector", daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
