"""Chunking by tokens of the serving model's tokenizer.

Chunks are measured in the serving model's tokens because each chunk's KV is precomputed by that
model: a chunk of N tokens is exactly N positions of KV. LangChain's recursive splitter cuts at
paragraph, line and word boundaries; a piece it cannot cut that way (a word, or a line without
spaces, longer than a chunk) is cut at token boundaries from one tokenization of it. The splitter's
own last resort, cutting into single characters and counting each one's tokens, costs a tokenizer
call per character: a 1 MB line took minutes.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ragfuse.store_dir import check_chunking

DEFAULT_CHUNK_TOKENS = 512
# a run of characters without a separator is handed to the splitter (which tokenizes it whole) in
# pieces of at most this many characters per chunk token: far more than a chunk holds (a token is
# a few characters), so only a cut every that many characters may leave a chunk short
_RUN_CHARS_PER_TOKEN = 64
_SEPARATORS = ["\n\n", "\n", " "]
# the splitter counts a piece's words with the separator before each; the piece it returns is stripped,
# and its first word alone can take a token more: it aims this much under the chunk size
_SEAM_TOKENS = 2
_RUN = re.compile(r"[^\n ]+")


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]


class TokenChunker:
    def __init__(self, tokenizer: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: int = 0) -> None:
        check_chunking(chunk_tokens, overlap)
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.overlap = overlap
        self._splitter = RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
            tokenizer, chunk_size=chunk_tokens - min(_SEAM_TOKENS, chunk_tokens - 1 - overlap), chunk_overlap=overlap,
            separators=_SEPARATORS,
        )

    def split(self, text: str) -> list[Chunk]:
        chunks = []
        for segment in self._segments(text):
            for piece in self._splitter.split_text(segment):
                tokens = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
                # The KV must never exceed the chunk size: a piece without separators comes back whole,
                # and re-tokenizing a joined piece may still add a token at a seam. Such a piece is cut
                # further, losing no text.
                if len(tokens["input_ids"]) <= self.chunk_tokens:
                    chunks.append(Chunk(piece, tuple(tokens["input_ids"])))
                else:
                    chunks += self._cut(piece, [a for a, _ in tokens["offset_mapping"]])
        return [c for c in chunks if c.token_ids]

    def _segments(self, text: str) -> Iterator[str]:
        """``text`` in consecutive pieces, cut only inside runs without a separator, every
        ``_RUN_CHARS_PER_TOKEN * chunk_tokens`` characters: the splitter tokenizes a run it cannot cut
        whole, and its pieces a few times over; this keeps each such call small."""
        limit = _RUN_CHARS_PER_TOKEN * self.chunk_tokens
        start = 0
        if len(text) > limit:
            for run in _RUN.finditer(text):
                for cut in range(run.start() + limit, run.end(), limit):
                    yield text[start:cut]
                    start = cut
        yield text[start:]

    def _cut(self, piece: str, starts: list[int]) -> list[Chunk]:
        """``piece`` in chunks of at most ``chunk_tokens`` tokens, cut at token boundaries of its
        tokenization (``starts``: the character each token starts at), overlapping by ``overlap``
        tokens; together they hold all its text."""
        chunks = []
        begin = 0  # character where the next chunk begins
        while begin < len(piece):
            shortest = bisect_right(starts, begin)  # the chunk ends at this token's start or later: not empty
            last = max(bisect_left(starts, begin) + self.chunk_tokens, shortest)  # the token it ends before
            while True:
                end = starts[last] if last < len(starts) else len(piece)
                ids = self._encode(piece[begin:end])
                if len(ids) <= self.chunk_tokens or last <= shortest:
                    break
                # a cut inside a character's bytes, or tokens merging differently without their
                # neighbours, made it longer: end it as many tokens earlier
                last = max(min(last, len(starts)) - (len(ids) - self.chunk_tokens), shortest)
            chunks.append(Chunk(piece[begin:end], ids))
            if end == len(piece):
                break
            begin = max(starts[max(last - self.overlap, 0)], begin + 1)
        return chunks

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))
