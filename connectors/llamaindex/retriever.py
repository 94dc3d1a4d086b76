"""A LlamaIndex retriever over a ragfuse store: nodes are stored chunks, their text exactly the chunk's."""

from __future__ import annotations

import asyncio

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ragfuse.app import shared_retriever
from ragfuse.passage import CHUNK_ID
from ragfuse.retrieval import SearchResult


def chunk_node(hit: SearchResult) -> NodeWithScore:
    """The metadata stays out of the text the LLM sees, so a prompt holds the chunk verbatim (and its KV fits)."""
    meta = {CHUNK_ID: hit.id, "source": hit.source}
    node = TextNode(id_=f"ragfuse-chunk-{hit.id}", text=hit.text, metadata=meta,
                    excluded_llm_metadata_keys=list(meta), excluded_embed_metadata_keys=list(meta))
    return NodeWithScore(node=node, score=hit.score)


class RagfuseRetriever(BaseRetriever):
    def __init__(self, store: str | None = None, similarity_top_k: int = 4, **kwargs) -> None:
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
        super().__init__(**kwargs)
        self.store = store  # a store directory; None: $RAGFUSE_STORE or the default store
        self.similarity_top_k = similarity_top_k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [chunk_node(h) for h in shared_retriever(self.store).search(query_bundle.query_str,
                                                                            self.similarity_top_k)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """On a worker thread: LlamaIndex's default runs ``_retrieve`` on the event loop, which would stall
        every other task while the query is embedded (and, on first use, the embedding model loaded)."""
        return await asyncio.to_thread(self._retrieve, query_bundle)
