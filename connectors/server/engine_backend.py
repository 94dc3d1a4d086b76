"""ragfuse's own engine as the server's backend: one ``AsyncEngine`` loop shared by every request
(continuous batching across clients), with RAG and store access run on that loop's thread so the
engine and its store are only ever used from one thread. An upload is read, chunked and embedded on
a worker thread (its own tokenizer and embedder); its store accesses and KV batches are calls on the
loop's thread, between decode steps, so running streams go on while a document is ingested.

Sessions are the engine's own session store (``engine.sessions``: each conversation's KV kept in
host memory and on disk between turns, under the store's ``sessions/`` directory by default, the
same place ``ragfuse ask --session`` keeps them). Chats with a leading system message run through
relay attention, the system prompt registered once (``engine.relay_prompts``, LRU-bounded).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

from ragfuse.engine import LLM, AsyncEngine, LLMEngine, RequestOutput, SamplingParams
from ragfuse.engine.folder_lock import FolderLock
from ragfuse.engine.sessions import SessionStore
from ragfuse.engine.sessions.history import turn_floor
from ragfuse.pipeline import Prepared, RagPipeline, Started

from .backend import (
    REUSE_KEYS,
    CacheUsage,
    ChatPrompt,
    Delta,
    RagAnswer,
    RagOptions,
    Sampling,
    TextPrompt,
    refuse_full_prompt,
)
from .library import DocumentLibrary

T = TypeVar("T")
# an upload's KV is computed in batches of about this many tokens, each one call on the engine
# thread: running streams wait at most one batch for their next token
UPLOAD_KV_BATCH_TOKENS = 512

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


def engine_params(s: Sampling, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                          stop=list(s.stop))


# what a session turn's least prompt counts, in a refusal: the engine fits the stored history to the
# answer's room (oldest turns cut) but never cuts the new message or the header before it
SESSION_FLOOR = "the session turn's new message with its kept header"


def turn_tokens(sampling: Sampling, floor: int, whole: int, context: int, prompt_param: str) -> int:
    """A session turn's completion limit, which is also the room the engine cuts the history to leave:
    ``floor``, the turn's least prompt; ``whole``, its prompt with the history uncut. An omitted
    ``max_tokens`` takes the server's limit only as far as it leaves half the context to the history:
    where that limit is near or past the context, reserving all of it cut nearly every earlier turn
    from a conversation that may well have fit."""
    tokens = sampling.completion_tokens(floor, context, prompt_param, SESSION_FLOOR)
    if sampling.max_tokens is not None:
        return tokens
    return min(tokens, max(context - whole, context // 2))


def to_delta(out: RequestOutput) -> Delta:
    """The engine's output as a delta; a relay request's system prompt counts among its prompt
    tokens (the engine's ``prompt_tokens`` are the request's own) and, with a session's stored
    history and shared prefix blocks, among its cached ones, unless it was computed for this very
    request (the first to carry it)."""
    m = out.metrics
    relay = int(m.get("relay_system_tokens", 0))
    reuse = {"relay_system_tokens": relay, "prefix_cached_tokens": int(m.get("cached_tokens", 0)),
             **{k: m[k] for k in REUSE_KEYS if k.startswith("session") and k in m}}
    cached = (relay - int(m.get("relay_system_computed", 0)) + reuse["prefix_cached_tokens"]
              + int(m.get("session_tokens_reused", 0)))
    return Delta(out.delta_text, out.finished, out.finish_reason, out.prompt_tokens + relay, len(out.token_ids),
                 cached, reuse, int(m.get("preemptions", 0)), int(m.get("swapped", 0)))


class EngineBackend:
    name = "ragfuse"

    def __init__(self, pipeline: RagPipeline, model_id: str, sessions_dir: str | Path | None = None,
                 session_cpu_bytes: int = 4 << 30, session_disk_bytes: int = 32 << 30,
                 sessions_lock: FolderLock | None = None, sessions_on_disk: bool = True) -> None:
        """``sessions_dir``: where sessions' KV is kept (default: the store's ``sessions/``);
        ``sessions_lock``: that folder's hold, taken before the model loaded (``hold_sessions``).
        Without ``sessions_on_disk`` (a read-only store's replica) sessions live in memory only."""
        from ragfuse.embeddings import Embedder
        from ragfuse.ingest import Ingestor

        self.pipeline = pipeline
        self.model_id = model_id
        engine = pipeline.engine
        self.context_length = engine.max_model_len
        root = Path(sessions_dir) if sessions_dir is not None else pipeline.store.root / "sessions"
        self._engine_sessions = engine.sessions  # put back on close (an engine shared with other front ends)
        self.sessions = SessionStore(root if sessions_on_disk else None, engine.fingerprint, engine.dtype,
                                     session_cpu_bytes, session_disk_bytes, hold=sessions_lock or sessions_on_disk)
        engine.enable_sessions(self.sessions)
        self.loop = AsyncEngine(engine)
        self._uploading = asyncio.Lock()  # one upload at a time: each restores its files on failure
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the server's, set by the upload
        # the upload's own tokenizer and embedder: a fast tokenizer's settings are state that the
        # engine thread's retrieval and prompts would change under it
        ingestor = Ingestor(pipeline.store, engine, Embedder(pipeline.retriever.embedder.name), progress=False,
                            kv_batch_tokens=UPLOAD_KV_BATCH_TOKENS, on_engine=self._on_engine,
                            tokenizer=copy.deepcopy(engine.tokenizer))
        self.library = DocumentLibrary(pipeline.store, ingestor)

    async def generate(self, prompt: ChatPrompt | TextPrompt, sampling: Sampling,
                       request_id: str) -> AsyncIterator[Delta]:
        def start(engine: LLMEngine) -> str:
            # the prompt is rendered and counted before the engine takes it: a request past the context
            # is refused here, without a prefill
            if isinstance(prompt, TextPrompt):
                ids = engine.tokenize(prompt.text, start=True)
                params = engine_params(sampling, sampling.completion_tokens(len(ids), engine.max_model_len, "prompt"))
                return engine.add_request(ids, params, request_id)
            llm, rendering = LLM.from_engine(engine), prompt.rendering()
            chat = llm.render(prompt.messages, **rendering)  # rendered once: counted here, then queued as is
            if prompt.session_id is None:
                max_tokens = sampling.completion_tokens(len(chat.ids), engine.max_model_len, "messages")
            else:  # no cut of the session's history shortens the new message or the header kept before it
                max_tokens = turn_tokens(sampling, chat.turn_floor, len(chat.ids), engine.max_model_len, "messages")
            return llm.add_rendered_chat(chat, engine_params(sampling, max_tokens), prompt.session_id, prompt.relay,
                                         request_id)

        async with aclosing(self.loop.generate_with(start)) as outputs:
            async for out in outputs:
                yield to_delta(out)

    async def rag(self, question: str, options: RagOptions, sampling: Sampling,
                  request_id: str) -> AsyncIterator[Delta | RagAnswer]:
        started: list[Started] = []

        def start(engine: LLMEngine) -> str:
            # retrieval tells the prompt's length: a request past the context is refused before its prefill
            def fit(prep: Prepared) -> SamplingParams:
                prompt_tokens = sum(len(seg.token_ids) for seg in prep.segments)
                if options.session_id is None:
                    max_tokens = sampling.completion_tokens(prompt_tokens, engine.max_model_len, "question")
                else:  # the whole prompt is the turn's new message, which no cut of the history makes fit
                    refuse_full_prompt(prompt_tokens, engine.max_model_len, "question")
                    fed = len(engine.sessions.conversation(options.session_id)) + prompt_tokens
                    floor = turn_floor(fed, prompt_tokens, len(self.pipeline.builder.prefix))
                    max_tokens = turn_tokens(sampling, floor, fed, engine.max_model_len, "question")
                return engine_params(sampling, max_tokens)

            started.append(self.pipeline.start(question, options.mode, options.recompute_ratio, options.top_k,
                                               session_id=options.session_id, relay=options.relay, check=fit))
            return started[0].request_id

        last: RequestOutput | None = None
        async with aclosing(self.loop.generate_with(start)) as outputs:
            async for out in outputs:
                last = out
                yield to_delta(out)
        assert last is not None and started
        report = self.pipeline.result(started[0], last).as_dict()
        report.pop("token_ids")
        yield RagAnswer(report, started[0].prep.kv_tiers())

    async def add_documents(self, files: list[tuple[str, bytes]]) -> dict[str, Any]:
        async with self._uploading:
            self._event_loop = asyncio.get_running_loop()
            return await asyncio.to_thread(self.library.add, files)

    def _on_engine(self, fn: Callable[[], T]) -> T:
        """Run an upload's store access or KV batch on the engine thread (called from the worker)."""
        assert self._event_loop is not None
        return asyncio.run_coroutine_threadsafe(self.loop.call(lambda _: fn()), self._event_loop).result()

    async def list_documents(self) -> list[dict[str, Any]]:
        return await self.loop.call(lambda _: self.library.list())

    async def delete_document(self, doc_id: str) -> bool:
        return await self.loop.call(lambda _: self.library.delete(doc_id))

    async def list_sessions(self) -> list[dict[str, Any]]:
        def listing(engine: LLMEngine) -> list[Any]:
            engine.close_turns()  # finished turns waiting for their closing step are listed whole
            return self.sessions.sessions()

        listed = await self.loop.call(listing)
        return [{"object": "session", "id": s.session_id, "tokens": s.tokens, "stored_tokens": s.stored_rows,
                 "bytes": s.nbytes, "tier": s.tier, "created": s.created, "last_access": s.last_access}
                for s in listed]

    async def delete_session(self, session_id: str) -> bool:
        # a turn of it still streaming (or waiting for its closing step) is not saved when it ends: the
        # store drops its save, so the session does not come back
        return await self.loop.call(lambda _: self.sessions.delete(session_id))

    def relay_prompts(self) -> int:
        return len(self.pipeline.engine.systems)  # chats', the pipeline's and any registered by hand

    def queue_depth(self) -> int:
        return self.loop.queue_depth

    def running(self) -> int:
        return self.loop.num_running

    def cache_usage(self) -> CacheUsage:
        engine = self.pipeline.engine
        swap = engine.scheduler.swap
        return CacheUsage(engine.blocks.num_blocks - engine.blocks.num_free, engine.blocks.num_blocks,
                          swap.used_bytes if swap is not None else 0)

    def close(self) -> None:
        self.loop.shutdown()
        self.pipeline.engine.relay_prompts.release_idle()  # its blocks go back with the server
        self.sessions.close()  # every turn's KV reaches disk before the process ends
        self.pipeline.engine.sessions = self._engine_sessions
        self.pipeline.store.close()
