"""What the HTTP layer needs from an engine, in engine-neutral terms, so that ragfuse's own engine
and vLLM (with ragfuse's connector) serve the very same API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class TextPrompt:
    text: str | list[int]  # raw text (no chat template) or token ids


@dataclass(frozen=True)
class RagOptions:
    top_k: int = 5
    mode: str = "fuse"
    recompute_ratio: float | None = None


@dataclass
class Delta:
    """What one step added to a request, with the running totals a response's ``usage`` needs."""

    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class RagAnswer:
    """The pipeline's report of a RAG answer (sources, timing breakdown, fusion figures), and the tier
    each stored prompt piece's KV came from ("computed" when it was not stored)."""

    report: dict[str, Any]
    kv_tiers: list[str] = field(default_factory=list)


class Backend(Protocol):
    name: str  # "ragfuse" or "vllm"
    model_id: str

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

    def queue_depth(self) -> int: ...

    def running(self) -> int: ...

    def close(self) -> None: ...
