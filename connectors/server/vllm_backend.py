"""vLLM (with ragfuse's KV connector) as the server's backend: ``ragfuse serve --backend vllm``.

vLLM's ``AsyncLLM`` batches every request continuously in its own engine process; closing a
request's iterator aborts it there. RAG retrieves from the ragfuse store as the default backend
does, then hands vLLM the prompt with each retrieved chunk marked, so the connector loads the KV
that ``ragfuse ingest`` stored for it (same keys: the connector's store is the store's ``kv/``
directory) at whatever position the chunk lands. The connector runs those chunks in its
full-reuse mode (no selective recompute; see ``connectors/vllm/README.md``), which the answer's
``fusion.mode`` says. Store work (retrieval, ingest) runs on one worker thread.

Sessions and relay are ragfuse engine features: a ``session_id`` is refused here (one clear 400,
rather than a session silently recomputed every turn), and a chat's system prompt is left to
vLLM's own prefix caching.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ragfuse.connectors.vllm.backend import (
    ChunkRecompute,
    Prompt,
    PromptBuilder,
    close_each,
    engine_kwargs,
    import_vllm,
    reused_run,
)
from ragfuse.connectors.vllm.settings import ConnectorSettings
from ragfuse.engine.checkpoint import resolve
from ragfuse.engine.errors import EngineStopped, RequestError

from .backend import ChatPrompt, Delta, RagAnswer, RagOptions, Sampling, TextPrompt
from .engine_backend import ensure_store
from .library import DocumentLibrary

T = TypeVar("T")
log = logging.getLogger(__name__)
CONNECTOR_TIER = "vllm-connector"  # the tier name metrics report for chunk KV the connector loaded


@dataclass(frozen=True)
class _Tokenizing:
    """What ``Ingestor`` needs of an engine when vLLM (not ragfuse's engine) computes the chunks' KV:
    the tokenizer to chunk with, and the identity that chunk keys are made of."""

    tokenizer: Any
    fingerprint: str
    dtype: torch.dtype


class VLLMServeBackend(PromptBuilder):
    name = "vllm"

    def __init__(self, llm: Any, settings: ConnectorSettings, store: Any, model_id: str) -> None:
        from ragfuse.ingest import Ingestor
        from ragfuse.retrieval import Retriever

        self.llm, self.settings, self.store, self.model_id = llm, settings, store, model_id
        self.context_length: int = llm.model_config.max_model_len
        self.tokenizer = llm.get_tokenizer()
        self.retriever = Retriever(store)
        tokenizing = _Tokenizing(self.tokenizer, settings.fingerprint, settings.kv_dtype)
        # chunk KV is computed by vLLM after the ingest (``_store_chunks``), not by ragfuse's engine
        ingestor = Ingestor(store, tokenizing, self.retriever.embedder, precompute_kv=False, progress=False)
        self.library = DocumentLibrary(store, ingestor)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ragfuse-store")
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._stopped = False
        self._abort: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference to a task

    @classmethod
    def open(cls, store: str | None, model: str, max_model_len: int = 2048) -> VLLMServeBackend:
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from ragfuse.rag_store import RagStore

        root = ensure_store(store, model)
        checkpoint = resolve(model)
        settings = ConnectorSettings.for_model(checkpoint.path, root / "kv")
        # the store first: one that cannot be opened fails in a moment, before vLLM's slow start
        rag_store = RagStore.open_existing(root)
        llm = None
        try:
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(checkpoint.path, settings, max_model_len)))
            return cls(llm, settings, rag_store, model)
        except BaseException as exc:  # neither the engine (its process, its KV cache) nor the store's files outlive it
            try:
                close_each(*([llm.shutdown] if llm is not None else []), rag_store.close)
            except Exception as during:
                exc.add_note(f"closing what was opened failed too: {during!r}")
            raise

    # ---------------------------------------------------------------- generation

    async def generate(self, prompt: ChatPrompt | TextPrompt, sampling: Sampling,
                       request_id: str) -> AsyncIterator[Delta]:
        _no_sessions(prompt.session_id if isinstance(prompt, ChatPrompt) else None)
        if isinstance(prompt, ChatPrompt):
            ids = self.chat_prompt(prompt.messages, **prompt.rendering()).token_ids
        else:
            ids = self.encode(prompt.text) if isinstance(prompt.text, str) else list(prompt.text)
        async for delta, _ in self._stream(Prompt(ids), sampling, None, request_id,
                                           "messages" if isinstance(prompt, ChatPrompt) else "prompt"):
            yield delta

    async def _stream(self, prompt: Prompt, sampling: Sampling, transfer: dict[str, Any] | None,
                      request_id: str, prompt_param: str) -> AsyncIterator[tuple[Delta, Any]]:
        """Deltas of one vLLM request (and its raw output, for the connector's report); ``prompt_param``:
        the request field the prompt came from, which a refusal of its length names."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        if self._stopped:
            raise EngineStopped("the server is shutting down: this request was not started")
        if not prompt.token_ids:
            raise RequestError("empty prompt")
        # settled here, before vLLM takes the request: a request past the context costs no prefill, and a
        # left-out max_tokens runs to what the context leaves, as on ragfuse's engine
        max_tokens = sampling.completion_tokens(len(prompt.token_ids), self.context_length, prompt_param)
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                seed=sampling.seed, stop=list(sampling.stop) or None, output_kind=RequestOutputKind.DELTA,
                extra_args={"kv_transfer_params": {"ragfuse": transfer}} if transfer else None)
        except (ValueError, VLLMClientError) as exc:
            raise RequestError(str(exc)) from None
        generated = 0
        outputs = self.llm.generate({"prompt_token_ids": prompt.token_ids}, params, request_id)
        self._waiting.add(request_id)
        try:
            async with aclosing(outputs):  # closed here, not whenever it is collected: vLLM aborts it then
                async for out in outputs:
                    # ``stop`` aborted the request (its last output, "abort") or it was still being added
                    # then (closing the iterator aborts it): either way it ends here, as a stopped request
                    if self._stopped:
                        raise EngineStopped("the server was shut down while this request ran")
                    self._waiting.discard(request_id)
                    self._running.add(request_id)
                    comp = out.outputs[0]
                    generated += len(comp.token_ids)
                    yield Delta(comp.text, out.finished, comp.finish_reason if out.finished else None,
                                len(out.prompt_token_ids or prompt.token_ids), generated), out
        except (ValueError, VLLMClientError) as exc:  # vLLM's input validation (prompt too long, bad ids)
            raise RequestError(str(exc)) from None
        finally:
            self._waiting.discard(request_id)
            self._running.discard(request_id)

    # ---------------------------------------------------------------- RAG

    async def rag(self, question: str, options: RagOptions, sampling: Sampling,
                  request_id: str) -> AsyncIterator[Delta | RagAnswer]:
        _no_sessions(options.session_id)
        t0 = time.perf_counter()
        hits = await self._on_worker(lambda: self.retriever.search(question, options.top_k))
        if not hits:
            raise RequestError("the store has no documents: upload some (POST /v1/documents) first")
        chunks = await self._on_worker(lambda: self.store.docs.chunks([h.id for h in hits]))
        prompt = self.chunked_prompt(question, [chunks[h.id].token_ids for h in hits])
        retrieve_s = time.perf_counter() - t0
        reuse = options.mode != "full"  # "full": exact prefill; the connector may still load a stored prefix
        transfer = {"chunks": [list(c) for c in prompt.chunks]} if reuse else None
        first: float | None = None
        last: Delta | None = None
        report: dict[str, Any] = {}
        text = []
        async for delta, out in self._stream(prompt, sampling, transfer, request_id, "question"):
            first = first or time.perf_counter()
            last = delta
            text.append(delta.text)
            if out.finished:
                report = (out.kv_transfer_params or {}).get("ragfuse") or {}
            yield delta
        assert last is not None and first is not None
        loaded = reused_run(report)
        recompute = ChunkRecompute.of(prompt.chunks, loaded)
        hit_chunks = int(report.get("chunk_hits_loaded", 0))
        notes = [] if reuse else ["mode full: chunks prefilled in place (the connector may load a stored prefix)"]
        if options.recompute_ratio is not None:
            notes.append("the vLLM backend does not recompute reused chunks: recompute_ratio ignored")
        yield RagAnswer({
            "answer": "".join(text).strip(), "finish_reason": last.finish_reason,
            "sources": [h.as_dict() for h in hits], "retrieve_s": retrieve_s, "ttft_s": first - t0 - retrieve_s,
            "total_s": time.perf_counter() - t0, "load_s": None, "load_hidden": None, "recompute_s": None,
            "mode": report.get("mode", "exact") if reuse else "full", "recompute_ratio": recompute.recompute_ratio,
            "prompt_tokens": len(prompt.token_ids), "reused_tokens": loaded,
            "recomputed_tokens": recompute.recomputed_tokens, "tiers": [CONNECTOR_TIER] if loaded else [],
            "decision": None, "relay_system_tokens": 0, "notes": notes,
        }, [CONNECTOR_TIER] * hit_chunks + ["computed"] * (len(prompt.chunks) - hit_chunks))

    # ---------------------------------------------------------------- documents

    async def add_documents(self, files: list[tuple[str, bytes]]) -> dict[str, Any]:
        result = await self._on_worker(lambda: self.library.add(files))
        ids = [d["id"] for d in result["data"]]
        chunks = await self._on_worker(lambda: self.library.chunk_tokens(ids))
        await asyncio.gather(*(self._store_chunk(c) for c in chunks))
        result["ingest"]["kv_computed"] = len(chunks)
        return result

    async def _store_chunk(self, token_ids: list[int]) -> None:
        """Have vLLM compute one chunk's KV alone and the connector store it under the chunk key."""
        sampling = Sampling(max_tokens=1, limit=1, temperature=0.0)
        async for _ in self._stream(Prompt(token_ids), sampling, {"store_as_chunk": True},
                                    f"store-{uuid.uuid4().hex}", "documents"):
            pass

    async def list_documents(self) -> list[dict[str, Any]]:
        return await self._on_worker(self.library.list)

    async def delete_document(self, doc_id: str) -> bool:
        return await self._on_worker(lambda: self.library.delete(doc_id))

    async def list_sessions(self) -> list[dict[str, Any]]:
        return []

    async def delete_session(self, session_id: str) -> bool:
        return False

    def relay_prompts(self) -> int:
        return 0

    async def _on_worker(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self._running)

    def cache_usage(self) -> None:
        return None  # vLLM's own metrics (vllm:kv_cache_usage_perc) report its cache

    def stop(self) -> None:
        """End every request at once (the server's SIGINT/SIGTERM): each one in flight, queued or
        running, raises ``EngineStopped`` (a stream's error event, a whole answer's 503) instead of
        generating on until the server's grace period cuts its connection; later ones are refused.
        Called on the event loop, so it only schedules vLLM's abort: it does not wait for it."""
        if self._stopped:
            return
        self._stopped = True
        if ids := self._waiting | self._running:
            self._abort = asyncio.get_running_loop().create_task(self.llm.abort(sorted(ids)))
            self._abort.add_done_callback(_report_failed_abort)

    def close(self) -> None:
        """Stop vLLM, then the store worker (its queued work done), then close the store: each step
        runs even when one before it fails (the store's files and the worker thread are released
        whatever vLLM's shutdown does), and the first failure is raised."""
        close_each(self.llm.shutdown, lambda: self._worker.shutdown(wait=True), self.store.close)


def _report_failed_abort(task: asyncio.Task[None]) -> None:
    """One log line (not an unretrieved task's traceback) when vLLM's abort fails: the stopped requests
    still end, each at its next output."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("aborting vLLM's requests on shutdown failed: %r", exc)


def _no_sessions(session_id: str | None) -> None:
    if session_id is not None:
        raise RequestError("sessions keep their KV in ragfuse's engine: serve with --backend ragfuse to use session_id")
