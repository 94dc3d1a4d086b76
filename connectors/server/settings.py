"""What an operator sets for a server: who may call it and how much one request may ask for."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    """``api_key`` None leaves the API open (loopback use); ``cors_origins`` empty means no
    cross-origin browser access at all (closed by default)."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = field(default_factory=tuple)
    max_body_bytes: int = 8 << 20  # whole request body, uploads included
    max_tokens: int = 1024  # most tokens one request may generate
    max_top_k: int = 20  # most chunks one RAG query may retrieve
    relay: bool = True  # chats' leading system messages served by relay attention (a request may say otherwise)
