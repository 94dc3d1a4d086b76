"""A LangChain retriever over a ragfuse store: its documents are stored chunks, named by id."""

from __future__ import annotations

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field

from ragfuse.app import shared_retriever

from .documents import chunk_document


class RagfuseRetriever(BaseRetriever):
    """The top ``k`` chunks of the store for a query (cosine score in the metadata)."""

    store: str | None = None  # a store directory; None: $RAGFUSE_STORE or the default store
    k: int = Field(default=4, ge=1)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [chunk_document(hit) for hit in shared_retriever(self.store).search(query, self.k)]
