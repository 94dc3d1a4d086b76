"""Finding stored chunks inside text a framework flattened (a "stuff documents" chain's prompt).

A chain that formats its retrieved documents into one string hands the model text, not documents.
The chunks in it are found again by exact match against the docstore: every chunk is indexed by its
first ``HEAD`` characters, the text is scanned once for those heads, and each candidate counts only
if the whole chunk text follows verbatim. A match is therefore the stored chunk itself (same text,
so same tokens and same KV key); anything else stays plain text and is prefilled.
"""

from __future__ import annotations

from ragfuse.passage import Passage
from ragfuse.rag_store import RagStore

HEAD = 32  # chunks shorter than this are never matched: too short to be told from ordinary text


class PassageFinder:
    def __init__(self, store: RagStore) -> None:
        self.store = store
        self._generation = -1
        self._heads: dict[str, list[int]] = {}

    def _index(self) -> dict[str, list[int]]:
        """Chunk heads, reread whenever the docstore changed (an ingest or removal bumps its generation)."""
        gen = self.store.docs.generation
        if gen != self._generation:
            heads: dict[str, list[int]] = {}
            for cid, head in self.store.docs.chunk_heads(HEAD):
                heads.setdefault(head, []).append(cid)
            self._heads, self._generation = heads, gen
        return self._heads

    def split(self, text: str) -> list[str | Passage]:
        """``text`` as plain-text parts and the stored chunks found in it, in order; empty parts dropped."""
        heads = self._index()
        if not heads or len(text) < HEAD:
            return [text] if text else []
        parts: list[str | Passage] = []
        start = i = 0
        while i <= len(text) - HEAD:
            ids = heads.get(text[i:i + HEAD])
            match = None
            if ids:
                for chunk in self.store.docs.chunks(ids).values():
                    if text.startswith(chunk.text, i) and (match is None or len(chunk.text) > len(match.text)):
                        match = chunk
            if match is None:
                i += 1
                continue
            if i > start:
                parts.append(text[start:i])
            parts.append(Passage(match.text, match.id, match.source))
            i = start = i + len(match.text)
        if start < len(text):
            parts.append(text[start:])
        return parts
