"""What the HTTP layer needs from an engine, in engine-neutral terms, so that ragfuse's own engine
and vLLM (with ragfuse's connector) serve the very same API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import APIError


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings. ``max_tokens``: the client's limit on the completion; None
    (left out) lets it run to what the context leaves after the prompt, up to ``limit`` (the server's
    ``--max-tokens``), on every backend alike. ``param``: the option ``max_tokens`` came from, which
    a refusal names. The limit is settled by ``completion_tokens`` once the backend has the prompt's
    tokens, before the engine sees the request."""

    max_tokens: int | None
    limit: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    param: str = "max_tokens"

    def completion_tokens(self, prompt_tokens: int, context: int, prompt_param: str, part: str = "the prompt") -> int:
        """The completion's token limit for a prompt of ``prompt_tokens`` in a ``context``-token model;
        ``prompt_param``: the field the prompt came from (``messages``, ``prompt``, ``question``). A
        prompt that fills the context by itself (``refuse_full_prompt``), or an explicit ``max_tokens``
        past what the context leaves, is a 400 naming the numbers, raised before any prefill: the
        engine would otherwise prefill the prompt and cut the completion to a ``length`` the client
        never set. ``part``: what ``prompt_tokens`` counts, where it is not the whole prompt (a
        session turn's least prompt, its new message and kept header, as the engine may cut the rest)."""
        refuse_full_prompt(prompt_tokens, context, prompt_param, part)
        if self.max_tokens is None:
            return min(self.limit, context - prompt_tokens)
        total = prompt_tokens + self.max_tokens
        if total > context:
            raise APIError(400, f"the model's context is {context} tokens, but this request needs {total}: "
                                f"{prompt_tokens} for {part} and {self.max_tokens} for the completion "
                                f"({self.param}); shorten {part} or lower {self.param}",
                           param=self.param, code="context_length_exceeded")
        return self.max_tokens


def refuse_full_prompt(prompt_tokens: int, context: int, prompt_param: str, part: str = "the prompt") -> None:
    """Refuse a prompt that leaves no room in the context for even one completion token, as a 400
    ``context_length_exceeded`` on ``prompt_param`` naming both numbers, as a prompt that only the
    completion pushes past the context is refused: the engine's own refusal of it came as a plain
    400 without a code, which clients that check the code (to trim and retry) did not recognise.
    ``part``: what ``prompt_tokens`` counts, named in the message, where it is not the whole prompt
    (a session turn's new message with its kept header, which must fit however much of the history is cut)."""
    if prompt_tokens >= context:
        raise APIError(400, f"the model's context is {context} tokens, but {part} alone takes {prompt_tokens} "
                            f"({prompt_param}), leaving none for the completion; shorten {part}",
                       param=prompt_param, code="context_length_exceeded")


@dataclass(frozen=True)
class ChatPrompt:
    """A chat; ``session_id``: continue that session (its stored KV reused); ``relay``: serve a
    leading system message by relay attention (registered once, shared by every request with it).
    ``add_generation_prompt``, ``continue_final_message``: how the template renders the chat's end,
    as vLLM's request fields of these names ask (a new assistant turn opened, or the final message
    left open for the model to continue)."""

    messages: list[dict[str, str]]
    session_id: str | None = None
    relay: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def rendering(self) -> dict[str, bool]:
        """The chat template options these ask for, as ``render_chat`` and ``LLM.chat_ids`` take them."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


@dataclass(frozen=True)
class TextPrompt:
    text: str | list[int]  # raw text (no chat template) or token ids


@dataclass(frozen=True)
class RagOptions:
    top_k: int = 5
    mode: str = "fuse"
    recompute_ratio: float | None = None
    session_id: str | None = None  # the question is this session's next turn
    relay: bool = True  # the instruction prefix served as a relay system prompt where the mode allows


@dataclass
class Delta:
    """What one step added to a request, with the running totals a response's ``usage`` needs.

    ``cached_tokens``: prompt tokens whose KV was reused rather than computed for this request (a
    session's stored history, a relay system prompt, shared prefix blocks); ``reuse`` says which
    (``REUSE_KEYS``), for the ``ragfuse`` part of ``usage``. ``preemptions``: how often ragfuse's
    engine took the request's cache blocks for others so far, ``swapped`` of them keeping its KV in
    host memory (the rest recomputed it), for the server's metrics (vLLM keeps its own).
    """

    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reuse: dict[str, Any] | None = None
    preemptions: int = 0
    swapped: int = 0

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object (with ``prompt_tokens_details.cached_tokens``), plus ``ragfuse``."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reuse is not None:
            usage["ragfuse"] = self.reuse
        return usage


# what ``Delta.reuse`` may hold: where a request's reused KV came from
REUSE_KEYS = ("session_id", "session_tokens_reused", "session_tier", "session_truncated_tokens", "session_notes",
              "relay_system_tokens", "prefix_cached_tokens")


@dataclass
class RagAnswer:
    """The pipeline's report of a RAG answer (sources, timing breakdown, fusion figures), and the tier
    each stored prompt piece's KV came from ("computed" when it was not stored)."""

    report: dict[str, Any]
    kv_tiers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CacheUsage:
    """The engine's KV cache right now, for the metrics: blocks held (by requests and registered
    system prompts; cached blocks nobody uses count as free, as a new request may take them), all
    blocks, and the host memory holding preempted requests' swapped KV."""

    blocks_used: int
    blocks_total: int
    swap_bytes: int


class Backend(Protocol):
    name: str  # "ragfuse" or "vllm"
    model_id: str
    context_length: int  # tokens the model attends over: prompt and completion together

    def generate(self, prompt: ChatPrompt | TextPrompt, sampling: Sampling, request_id: str) -> AsyncIterator[Delta]:
        """Stream a completion; closing the iterator early aborts the request."""
        ...

    def rag(self, question: str, options: RagOptions, sampling: Sampling,
            request_id: str) -> AsyncIterator[Delta | RagAnswer]:
        """Retrieve, fuse, answer: the answer's deltas, then one ``RagAnswer``."""
        ...

    async def add_documents(self, files: list[tuple[str, bytes]]) -> dict[str, Any]: ...

    async def list_documents(self) -> list[dict[str, Any]]: ...

    async def delete_document(self, doc_id: str) -> bool: ...

    async def list_sessions(self) -> list[dict[str, Any]]:
        """Stored sessions, most recently used first: id, tokens, tier, last access."""
        ...

    async def delete_session(self, session_id: str) -> bool:
        """Drop a session's stored KV; False if there is none."""
        ...

    def relay_prompts(self) -> int:
        """System prompts registered for relay right now."""
        ...

    def queue_depth(self) -> int: ...

    def running(self) -> int: ...

    def cache_usage(self) -> CacheUsage | None:
        """The KV cache's use now; None where the serving engine reports its own (vLLM's metrics)."""
        ...

    def close(self) -> None: ...
