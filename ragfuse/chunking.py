"""Chunking by tokens of the serving model's tokenizer.

Chunks are measured in the serving model's tokens because each chunk's KV is precomputed by that
model: a chunk of N tokens is exactly N positions of KV. LangChain's recursive splitter cuts at
paragraph, line, sentence and word boundaries before it cuts inside words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragfuse.engine.errors import RagfuseError

DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]


class TokenChunker:
    def __init__(self, tokenizer: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: int = 0) -> None:
        if chunk_tokens < 16:
            raise RagfuseError(f"--chunk-tokens must be at least 16, got {chunk_tokens}")
        if not 0 <= overlap < chunk_tokens:
            raise RagfuseError(f"--chunk-overlap must be in [0, {chunk_tokens}), got {overlap}")
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self._splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
            tokenizer, chunk_size=chunk_tokens, chunk_overlap=overlap,
        )

    def split(self, text: str) -> list[Chunk]:
        chunks = []
        for piece in self._splitter.split_text(text):
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            # The splitter counts tokens of pieces it joins; re-tokenizing the joined text can add
            # a token or two at the seams. The KV must never exceed the chunk size: trim those.
            ids = ids[: self.chunk_tokens]
            chunks.append(Chunk(self.tokenizer.decode(ids) if len(ids) == self.chunk_tokens else piece, tuple(ids)))
        return [c for c in chunks if c.token_ids]
