"""ragfuse's own engine as the server's backend: one ``AsyncEngine`` loop shared by every request
(continuous batching across clients), with RAG, ingest and store access run on that loop's thread
so the engine and its store are only ever used from one thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from ragfuse.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams
from ragfuse.pipeline import RagPipeline, Started

from .backend import ChatPrompt, Delta, RagAnswer, RagOptions, Sampling, TextPrompt
from .library import DocumentLibrary


def ensure_store(store: str | None, model: str) -> Path:
    """The store directory, created empty (default embedding, 512-token chunks) when there is none
    yet: a fresh server fills it through ``POST /v1/documents``."""
    from ragfuse.embeddings import Embedder
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreConfig, resolve_store_dir

    root = resolve_store_dir(store)
    if StoreConfig.load(root) is None:
        embedder = Embedder()
        config = StoreConfig(model=model, embedding_model=embedder.name, embedding_dim=embedder.dim,
                             index_kind="flat", chunk_tokens=512, chunk_overlap=0)
        RagStore(root, config).close()
    return root


def open_store_pipeline(store: str | None, model: str, device: str = "auto", dtype: str | None = None,
                        engine: LLMEngine | None = None, gate: bool = True) -> RagPipeline:
    """The pipeline over ``store`` (created if missing) with ragfuse's engine on ``model``."""
    from ragfuse.app import open_pipeline

    return open_pipeline(str(ensure_store(store, model)), model, device, dtype, engine=engine, gate=gate)


def engine_params(s: Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                          stop=list(s.stop))


def to_delta(out: RequestOutput) -> Delta:
    return Delta(out.delta_text, out.finished, out.finish_reason, out.prompt_tokens, len(out.token_ids))


class EngineBackend:
    name = "ragfuse"

    def __init__(self, pipeline: RagPipeline, model_id: str) -> None:
        from ragfuse.ingest import Ingestor

        self.pipeline = pipeline
        self.model_id = model_id
        self.loop = AsyncEngine(pipeline.engine)
        ingestor = Ingestor(pipeline.store, pipeline.engine, pipeline.retriever.embedder, progress=False)
        self.library = DocumentLibrary(pipeline.store, ingestor)

    async def generate(self, prompt: ChatPrompt | TextPrompt, sampling: Sampling,
                       request_id: str) -> AsyncIterator[Delta]:
        params = engine_params(sampling)

        def start(engine: LLMEngine) -> str:
            ids = engine.chat_token_ids(prompt.messages) if isinstance(prompt, ChatPrompt) else prompt.text
            return engine.add_request(ids, params, request_id)

        async with aclosing(self.loop.generate_with(start)) as outputs:
            async for out in outputs:
                yield to_delta(out)

    async def rag(self, question: str, options: RagOptions, sampling: Sampling,
                  request_id: str) -> AsyncIterator[Delta | RagAnswer]:
        params = engine_params(sampling)
        started: list[Started] = []

        def start(_: LLMEngine) -> str:
            started.append(self.pipeline.start(question, options.mode, options.recompute_ratio, options.top_k,
                                               params))
            return started[0].request_id

        last: RequestOutput | None = None
        async with aclosing(self.loop.generate_with(start)) as outputs:
            async for out in outputs:
                last = out
                yield to_delta(out)
        assert last is not None and started
        report = self.pipeline.result(started[0], last).as_dict()
        report.pop("token_ids")
        yield RagAnswer(report, [s.tier for s in started[0].prep.sources])

    async def add_documents(self, files: list[tuple[str, bytes]]) -> dict[str, Any]:
        return await self.loop.call(lambda _: self.library.add(files))

    async def list_documents(self) -> list[dict[str, Any]]:
        return await self.loop.call(lambda _: self.library.list())

    async def delete_document(self, doc_id: str) -> bool:
        return await self.loop.call(lambda _: self.library.delete(doc_id))

    def queue_depth(self) -> int:
        return self.loop.queue_depth

    def running(self) -> int:
        return self.loop.num_running

    def close(self) -> None:
        self.loop.shutdown()
        self.pipeline.store.close()
