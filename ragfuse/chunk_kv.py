"""How a store's chunks get their KV: after the RAG prompt's instruction prefix, or alone.

CacheBlend precomputes each chunk as if it started a sequence: its first tokens take the
attention-sink role of a sequence start, and none of its tokens has seen the instruction that
precedes it in every RAG prompt. That instruction prefix is fixed (``prompt.py``), so ingest can
compute each chunk after it (and drop the prefix's own KV) at no cost to any query: the stored KV is
then what full prefill gives the chunk when it is the first passage, and closer to it elsewhere. On
the default model this cut full KV reuse's teacher-forced KL by a third and the shipped fusion's by
9-16%, with answers closer to full prefill's (results/fusion-quality/prefixed-kv.md).

The context tokens are part of the store key (``kv_key``), so an entry computed after one prefix is
never served where another one, or none, is asked for: a missing entry is computed and stored.
Ingest, the pipeline and the quality eval all take the chunk KV from here, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragfuse.engine.kvstore import kv_key
from ragfuse.prompt import RagPromptBuilder
from ragfuse.store_dir import check_chunk_kv_context


class ChunkKV:
    """Keys and computes chunk KV for one engine, after ``context`` tokens (empty: alone)."""

    def __init__(self, engine: Any, context: Sequence[int] = ()) -> None:
        self.engine = engine
        self.context = tuple(context)

    @classmethod
    def for_context(cls, engine: Any, kind: str, builder: RagPromptBuilder | None = None) -> ChunkKV:
        """``kind`` as a store records it: "instruction" (the prefix of ``builder``'s RAG prompt, by
        default the pipeline's) or "none"."""
        if check_chunk_kv_context(kind) == "none":
            return cls(engine)
        return cls(engine, (builder or RagPromptBuilder(engine.tokenizer)).prefix)

    def key(self, token_ids: Sequence[int]) -> str:
        return kv_key(self.engine.fingerprint, self.engine.dtype, token_ids, self.context)

    def compute(self, token_lists: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each chunk's (K before RoPE, V), computed after the context."""
        return self.engine.compute_kv(token_lists, context=self.context)
