"""How the connector cuts a prompt into stored spans, and the store key of each span.

Two kinds of span, both stored in ragfuse's entry format (per-layer ``[2, tokens, kv_heads,
head_dim]``, K before RoPE), so the loader treats them alike: rotate K to where the span sits in
this prompt, copy V.

- **chunk** spans are the RAG chunks a caller marks in ``kv_transfer_params`` (``ragfuse.chunks``:
  ``[[start, end], ...]``). Their key is the engine's own ``kv_key(fingerprint, dtype, tokens)``:
  the chunk's KV computed *alone* from position 0, which is what ``LLMEngine.compute_kv`` gives
  and ``ragfuse ingest --chunk-kv-context none`` stores (a store's default keys its chunks' KV
  computed after ragfuse's own instruction prefix, which a vLLM prompt need not have). One entry
  serves the chunk at any offset (full reuse: the chunk's KV does not see the text before it, as in
  CacheBlend without recompute).
- **context** spans are everything else (system prompt, session history, question). Their KV depends
  on every token before them, so their key hashes the whole prefix ``tokens[:end]`` under a
  separate namespace (``<fingerprint>/ctx``). When reused chunks come before a context span, its KV
  was computed over approximated chunk KV, so the chunk boundaries are part of the key too: an
  exact request never gets an approximated entry.

Context regions are cut at absolute multiples of ``span_tokens`` (and at chunk edges), so a session's
next turn, which extends the previous prompt, hits the same keys for its shared history.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragfuse.engine.kvstore import kv_key

CHUNK = "chunk"
CONTEXT = "context"


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a prompt and the store key of their KV."""

    start: int
    end: int
    kind: str
    key: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def context_key(fingerprint: str, dtype: torch.dtype, prefix: Sequence[int],
                reused_chunks: Sequence[tuple[int, int]] = ()) -> str:
    """Key of a context span ending at ``len(prefix)``: depends on every token before it and on which
    earlier spans were reused chunks (approximate KV), never on anything after it."""
    namespace = f"{fingerprint}/ctx"
    if reused_chunks:
        namespace += "/reuse:" + ",".join(f"{s}-{e}" for s, e in reused_chunks)
    return kv_key(namespace, dtype, prefix)


def _position(value: object) -> int:
    """A token position from JSON: an integer (not a bool, float or string, which ``int()`` would
    silently truncate or parse into a different span than the caller meant)."""
    if isinstance(value, bool):
        raise ValueError(f"chunk positions must be integers, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"chunk positions must be integers, got {value!r}") from None


def normalise_chunks(chunks: object, num_tokens: int) -> list[tuple[int, int]]:
    """Validate caller-supplied chunk spans (``[[start, end], ...]`` or None): integer pairs, inside
    the prompt, non-empty, non-overlapping; returned sorted. Raises ``ValueError`` naming the first
    bad span, since they arrive from clients and a wrong span would load KV at the wrong tokens."""
    if chunks is None:
        return []
    if not isinstance(chunks, (list, tuple)):
        raise ValueError(f"chunks must be a list of [start, end] pairs, got {type(chunks).__name__}")
    out: list[tuple[int, int]] = []
    for item in chunks:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"each chunk must be a [start, end] pair, got {item!r}")
        start, end = _position(item[0]), _position(item[1])
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"chunk span [{start}, {end}) is empty or outside a prompt of {num_tokens} tokens")
        out.append((start, end))
    out.sort()
    for (s0, e0), (s1, e1) in zip(out, out[1:]):
        if s1 < e0:
            raise ValueError(f"chunk spans [{s0}, {e0}) and [{s1}, {e1}) overlap")
    return out


def plan_spans(token_ids: Sequence[int], chunks: Sequence[tuple[int, int]], fingerprint: str,
               dtype: torch.dtype, span_tokens: int) -> list[Span]:
    """Cover ``token_ids`` with chunk spans (as given) and context spans (cut every ``span_tokens``
    absolute positions and at chunk edges), in order."""
    if span_tokens <= 0:
        raise ValueError("span_tokens must be positive")
    spans: list[Span] = []
    reused: list[tuple[int, int]] = []
    pos = 0
    edges = [*chunks, (len(token_ids), len(token_ids))]
    for c_start, c_end in edges:
        while pos < c_start:
            end = min(c_start, (pos // span_tokens + 1) * span_tokens)
            spans.append(Span(pos, end, CONTEXT, context_key(fingerprint, dtype, token_ids[:end], reused)))
            pos = end
        if c_end > c_start:
            spans.append(Span(c_start, c_end, CHUNK, kv_key(fingerprint, dtype, token_ids[c_start:c_end])))
            reused.append((c_start, c_end))
            pos = c_end
    return spans
