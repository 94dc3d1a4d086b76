"""With vLLM's own prefix cache on, the chunk tokens it served were reported as recomputed: the RAG
figures (``Generation.recompute``, the server's ``reused_tokens``) counted only what the connector
loaded. The connector's report now says how many tokens vLLM's cache served (``prefix_cached_tokens``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see test_connector.py

from ragfuse.connectors.vllm.backend import VLLMBackend  # noqa: E402
from tests.vllm.test_connector import PASSAGES, RAG_QUESTION  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_chunk_tokens_served_by_vllms_prefix_cache_count_as_reused(tmp_path: Path) -> None:
    backend = VLLMBackend(store_dir=tmp_path / "kv", memory_mb=0, enable_prefix_caching=True)
    try:
        prompt = backend.rag_prompt(RAG_QUESTION, PASSAGES, system="Answer from the passages. (prefix-cache test)")
        first = backend.generate(prompt, max_tokens=1)
        again = backend.generate(prompt, max_tokens=1)  # the whole prompt is now in vLLM's own cache
    finally:
        backend.close()
    assert first.recompute is not None and again.recompute is not None
    assert first.connector["prefix_cached_tokens"] == 0
    cached = again.connector["prefix_cached_tokens"]
    assert cached > prompt.chunks[0][0], (cached, prompt.chunks)
    assert again.connector["loaded_tokens"] == 0  # nothing left for the connector to load
    chunk_tokens = sum(end - start for start, end in prompt.chunks)
    # only the chunk tokens past vLLM's last cached block are recomputed
    assert again.recompute.recomputed_tokens < chunk_tokens // 4, (again.recompute, cached, prompt.chunks)
    assert again.recompute.recomputed_tokens < first.recompute.recomputed_tokens
