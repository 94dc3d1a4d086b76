"""A response synthesizer that answers from the retrieved nodes with their stored KV fused.

LlamaIndex's own synthesizers format the nodes into a prompt string; this one hands each node to
the pipeline as a separate passage of ragfuse's RAG prompt instead, so a node whose text is a stored
chunk (from ``RagfuseRetriever``, or from any index over the same text) brings its KV and the rest is
prefilled. The fusion statistics land in ``response.metadata["ragfuse"]`` (for a streaming response,
once its stream has been read to the end). The answer is an LLM call to LlamaIndex's callbacks and
instrumentation, as its own synthesizers' are (``RagfuseLLM.stream_answer``).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore

from ragfuse.passage import CHUNK_ID, Passage
from ragfuse.store_dir import StoreConfig, resolve_store_dir

from .llm import RagfuseLLM
from .retriever import RagfuseRetriever


class _Answer(str):
    """The answer text, carrying its statistics to ``_prepare_response_output``."""

    stats: dict[str, Any]


class _AsyncAnswerStream(AsyncStreamingResponse):
    """An async streaming answer whose reader stopping early (breaking out of ``async_response_gen()``, a
    cancelled task) closes the answer's stream, aborting the engine request. LlamaIndex's own leaves it
    decoding to the end for nothing: a stream read halfway never yields the rest (a later read gives the
    text read so far)."""

    async def _yield_response(self) -> AsyncGenerator[str, None]:
        try:
            async for text in super()._yield_response():
                yield text
        finally:
            await self.response_gen.aclose()


class _EachRead:
    """A sync answer's ``response_gen``: each ``for`` over it (``"".join`` included) reads through a
    generator of its own, which CPython frees as soon as the loop stops, closing the answer's stream. A
    generator handed out as it is stays open while the response holds it, however early the loop ended."""

    def __init__(self, read: Callable[[], Iterator[str]]) -> None:
        self._read = read
        self._stepped: Iterator[str] | None = None  # the one a caller steps with ``next``, kept

    def __iter__(self) -> Iterator[str]:
        # a ``for`` after ``next`` calls goes on where they stopped
        return self._stepped if self._stepped is not None else self._read()

    def __next__(self) -> str:
        """``next(response.response_gen)``, as on LlamaIndex's own generator: one generator for all
        such calls, closed with the response's stream at its end (or when the response is freed)."""
        if self._stepped is None:
            self._stepped = self._read()
        return next(self._stepped)


@dataclass
class _AnswerStream(StreamingResponse):
    """``_AsyncAnswerStream`` for sync readers, who iterate ``response_gen`` itself (LlamaIndex never
    closes it): breaking out of ``for tok in response.response_gen`` aborts the engine request when the
    loop exits. As there, the text read is recorded: a later read (``str(response)`` too) gives it, where
    LlamaIndex's own would give the rest only, or nothing once the stream was read to its end."""

    def __post_init__(self) -> None:
        self._tokens: Generator[str, None, None] = self.response_gen
        self.response_gen = _EachRead(self._yield_response)  # type: ignore[assignment]

    def _yield_response(self) -> Generator[str, None, None]:
        if self.response_txt is not None:  # read before: its stream is closed
            if self.response_txt:
                yield self.response_txt
            return
        self.response_txt = ""
        with closing(self._tokens) as tokens:
            for text in tokens:
                self.response_txt += text
                yield text


# LlamaIndex's streaming responses, and ours that close the answer's stream when their reader stops
_CLOSING_STREAMS: dict[type, type] = {StreamingResponse: _AnswerStream, AsyncStreamingResponse: _AsyncAnswerStream}


# a streaming answer's statistics, filled in when its stream ends (generators take weak references)
_STREAM_STATS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


class RagfuseSynthesizer(BaseSynthesizer):
    def __init__(self, llm: RagfuseLLM | None = None, streaming: bool = False, **kwargs: Any) -> None:
        self._ragfuse = llm or RagfuseLLM()
        super().__init__(llm=self._ragfuse, streaming=streaming, **kwargs)

    def _get_prompts(self) -> dict[str, Any]:
        return {}  # the prompt is ragfuse's RAG prompt: its instruction prefix is stored KV too

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        if prompts:
            raise ValueError("RagfuseSynthesizer uses ragfuse's RAG prompt; it has no prompts to update")

    def synthesize(self, query: Any, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any) -> Any:
        """As LlamaIndex's, with the nodes themselves handed on to ``get_response`` (which gets their text
        only): a node's chunk id and source then reach the answer's ``metadata["ragfuse"]["sources"]``."""
        return super().synthesize(query, nodes, additional_source_nodes, ragfuse_nodes=list(nodes),
                                  **response_kwargs)

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> Any:
        return await super().asynthesize(query, nodes, additional_source_nodes, ragfuse_nodes=list(nodes),
                                         **response_kwargs)

    def _passages(self, text_chunks: Sequence[str], kwargs: dict[str, Any]) -> list[Passage]:
        nodes: list[NodeWithScore] | None = kwargs.pop("ragfuse_nodes", None)
        if nodes is not None and len(nodes) == len(text_chunks):
            return [_node_passage(n) for n in nodes]
        return [Passage(t) for t in text_chunks]  # get_response called directly, with text only

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> Any:
        responses = self._ragfuse.stream_answer(query_str, self._passages(text_chunks, kwargs), **kwargs)
        if self._streaming:
            stats: dict[str, Any] = {}
            gen = _text_stream(responses, stats)
            _STREAM_STATS[gen] = stats
            return gen
        return _collect(responses)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> Any:
        responses = await self._ragfuse.astream_answer(query_str, self._passages(text_chunks, kwargs), **kwargs)
        if self._streaming:
            stats: dict[str, Any] = {}
            agen = _atext_stream(responses, stats)
            _STREAM_STATS[agen] = stats
            return agen
        last = None
        async for response in responses:
            last = response
        return _answer(last)

    def _prepare_response_output(self, response_str: Any, source_nodes: list[NodeWithScore]) -> Any:
        response = super()._prepare_response_output(response_str, source_nodes)
        closing_stream = _CLOSING_STREAMS.get(type(response))
        if closing_stream is not None:
            response = closing_stream(response.response_gen, response.source_nodes, response.metadata)
        stats = response_str.stats if isinstance(response_str, _Answer) else _STREAM_STATS.get(response_str)
        if stats is not None:
            response.metadata = {**(response.metadata or {}), "ragfuse": stats}
        return response


def _node_passage(node: NodeWithScore) -> Passage:
    """The node's own text (LlamaIndex's text chunks open with a metadata header, "file_path: ...",
    which made a stored chunk retrieved by any other index a passage no stored KV matched), naming the
    stored chunk it is (``RagfuseRetriever``'s nodes carry the chunk id) and its source document."""
    text = node.node.get_content(metadata_mode=MetadataMode.NONE)
    meta = node.node.metadata or {}
    cid = meta.get(CHUNK_ID)
    chunk_id = int(cid) if isinstance(cid, int | str) and str(cid).isdigit() else None
    return Passage(text, chunk_id, str(meta.get("source") or meta.get("file_path") or meta.get("file_name") or ""),
                   Passage.score_of(node.score))


def _answer(last: CompletionResponse | None) -> _Answer:
    """The last response holds the whole text and the statistics."""
    assert last is not None
    out = _Answer(last.text)
    out.stats = last.additional_kwargs["ragfuse"]
    return out


def _collect(responses: Iterator[CompletionResponse]) -> _Answer:
    last = None
    for response in responses:
        last = response
    return _answer(last)


def _text_stream(responses: Iterator[CompletionResponse], stats: dict[str, Any]) -> Generator[str, None, None]:
    for response in responses:
        if "ragfuse" in response.additional_kwargs:
            stats.update(response.additional_kwargs["ragfuse"])  # the response's metadata holds this very dict
        if response.delta:
            yield response.delta


async def _atext_stream(responses: AsyncIterator[CompletionResponse],
                        stats: dict[str, Any]) -> AsyncGenerator[str, None]:
    """Closing this stream closes the answer's (aborting the engine request) before it returns: LlamaIndex's
    ``AsyncStreamingResponse`` does not close it when its reader stops, so ``response.response_gen.aclose()``
    is how an app that stops reading frees the engine at once."""
    async with aclosing(responses) as stream:
        async for response in stream:
            if "ragfuse" in response.additional_kwargs:
                stats.update(response.additional_kwargs["ragfuse"])
            if response.delta:
                yield response.delta


def ragfuse_query_engine(
    store: str | None = None, retriever: BaseRetriever | None = None, llm: RagfuseLLM | None = None,
    similarity_top_k: int = 4, streaming: bool = False,
) -> RetrieverQueryEngine:
    """A ``RetrieverQueryEngine`` that fuses: over ``store`` (ragfuse's retriever) or any ``retriever``
    (e.g. ``index.as_retriever()``); ``llm`` defaults to one over the same store. ``store=None`` is the
    default store (``$RAGFUSE_STORE`` or the per-user one) for both, with any ``retriever`` too where one
    was ingested there: an LLM left with no store at all prefills the retrieved chunks, fusing nothing."""
    root = resolve_store_dir(store)
    if retriever is None:
        retriever = RagfuseRetriever(str(root), similarity_top_k)
    elif store is None and StoreConfig.load(root) is None:  # no default store: nothing stored to fuse
        root = None
    llm = llm or RagfuseLLM(store=str(root) if root is not None else None)
    return RetrieverQueryEngine(retriever, RagfuseSynthesizer(llm, streaming=streaming))
