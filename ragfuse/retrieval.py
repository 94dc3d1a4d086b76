"""Retrieval: the top-k chunks of a store for a query, with id, text, source and cosine score."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ragfuse.embeddings import Embedder
from ragfuse.engine.errors import RagfuseError
from ragfuse.rag_store import RagStore


@dataclass(frozen=True)
class SearchResult:
    id: int
    text: str
    source: str
    score: float
    kv_key: str | None = None
    # read with the text, in one query: a second read by id could miss a chunk that an ingest in
    # another process replaced meanwhile
    token_ids: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("kv_key")
        d.pop("token_ids")
        return d


class Retriever:
    def __init__(self, store: RagStore, embedder: Embedder | None = None) -> None:
        self.store = store
        self.embedder = embedder or Embedder(store.config.embedding_model)
        if self.embedder.name != store.config.embedding_model:
            raise RagfuseError(f"store was embedded with {store.config.embedding_model!r}, not {self.embedder.name!r}")

    def search(self, query: str, top_k: int = 5) -> list[SearchResult]:
        if not query.strip():
            raise RagfuseError("the query is empty")
        if top_k < 1:
            raise RagfuseError(f"--top-k must be at least 1, got {top_k}")
        index = self.store.current_index()
        if len(index) == 0:
            return []
        scores, ids = index.search(self.embedder.encode([query])[0], min(top_k, len(index)))
        found = self.store.docs.chunks([int(i) for i in ids if i >= 0])
        return [
            SearchResult(int(i), c.text, c.source, float(s), c.kv_key, c.token_ids)
            for s, i in zip(scores, ids) if (c := found.get(int(i))) is not None
        ]
