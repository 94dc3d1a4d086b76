"""LangChain ``Document``s and ragfuse passages: a stored chunk's id travels in the metadata."""

from __future__ import annotations

from langchain_core.documents import Document

from ragfuse.passage import CHUNK_ID, Passage
from ragfuse.retrieval import SearchResult


def chunk_document(hit: SearchResult) -> Document:
    return Document(id=str(hit.id), page_content=hit.text,
                    metadata={CHUNK_ID: hit.id, "source": hit.source, "score": hit.score})


def document_passage(doc: Document | str | Passage) -> Passage:
    """Any document is a passage; one from a ragfuse store also names its chunk."""
    if isinstance(doc, Passage):
        return doc
    if isinstance(doc, str):
        return Passage(doc)
    if not isinstance(doc, Document):
        raise ValueError(f"documents are LangChain Documents, strings or ragfuse Passages, not {type(doc).__name__}")
    cid = doc.metadata.get(CHUNK_ID)
    return Passage(doc.page_content, int(cid) if isinstance(cid, int | str) and str(cid).isdigit() else None,
                   str(doc.metadata.get("source", "")), Passage.score_of(doc.metadata.get("score")))
