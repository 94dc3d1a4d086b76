"""What every route needs: the backend, the operator's settings and metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from .backend import Backend, Delta, Sampling
from .errors import APIError
from .metrics import ServerMetrics
from .schemas import SamplingFields
from .settings import ServerSettings

DEFAULT_MAX_TOKENS = 256
T = TypeVar("T")


@dataclass
class ServerState:
    backend: Backend
    settings: ServerSettings
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_id:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {self.backend.model_id!r})",
                           param="model", code="model_not_found")

    def sampling(self, body: SamplingFields, max_tokens: int | None, param: str = "max_tokens") -> Sampling:
        """The backend's sampling settings, with the server's token limit applied; ``param`` names the
        option ``max_tokens`` came from, so a refusal points at the option the client sent."""
        limit = self.settings.max_tokens
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"{param} must be at most {limit} on this server, got {max_tokens}", param=param)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return Sampling(max_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, limit), temperature=body.temperature,
                        top_p=body.top_p, seed=body.seed, stop=stop)

    async def within_context(self, items: AsyncIterator[T], max_tokens: int | None,
                             param: str = "max_tokens") -> AsyncIterator[T]:
        """``items`` (a backend's deltas), refused at the first delta, which tells the prompt's length,
        when the prompt and the ``max_tokens`` the client set exceed the model's context: the engine
        would cut the completion to what the context leaves and call that ``length``, a limit the
        client never set. Left out (None), ``max_tokens`` is what the context leaves, never an error.
        The refusal is raised before the first delta is passed on, so a stream has not started yet."""
        async with aclosing(items):
            async for item in items:
                if max_tokens is not None and isinstance(item, Delta):
                    check_context(item.prompt_tokens, max_tokens, self.backend.context_length, param)
                    max_tokens = None
                yield item


def check_context(prompt_tokens: int, max_tokens: int, context: int, param: str) -> None:
    """A 400 naming every number (context, total, prompt, completion) when they do not fit."""
    if prompt_tokens + max_tokens > context:
        raise APIError(400, f"the model's context is {context} tokens, but this request needs "
                            f"{prompt_tokens + max_tokens}: {prompt_tokens} for the prompt and {max_tokens} for "
                            f"the completion ({param}); shorten the prompt or lower {param}",
                       param=param, code="context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
