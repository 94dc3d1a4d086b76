"""The RAG pipeline: retrieve, assemble the prompt from stored chunks, fuse their KV, answer.

Every stored piece of the prompt (the instruction prefix and each retrieved chunk) brings its KV
from the fastest tier that holds it; a missing or corrupt entry is recomputed (and stored) instead,
never served. The recompute ratio comes from the loading controller (measured delays) and never
goes below the accuracy gate's calibrated r* for this model, unless the caller sets one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ragfuse.engine import LLMEngine, RequestOutput, SamplingParams
from ragfuse.engine.errors import RagfuseError, RequestError
from ragfuse.engine.fusion import FusionMode, FusionStats, Segment, SelectionPolicy
from ragfuse.engine.kvstore import CorruptEntryError, EntrySource, LayerwiseSource, StoredKV, kv_key, open_source
from ragfuse.prompt import RagPromptBuilder
from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever, SearchResult

log = logging.getLogger("ragfuse.pipeline")
MODES = tuple(m.value for m in FusionMode)


@dataclass
class AskResult:
    answer: str
    sources: list[dict[str, Any]]
    mode: str
    recompute_ratio: float
    ttft_s: float  # from the end of retrieval to the first answer token (KV lookup, load, prefill)
    total_s: float
    retrieve_s: float
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    load_s: float
    load_hidden: float
    recompute_s: float
    tiers: list[str]
    token_ids: list[int]
    finish_reason: str | None
    decision: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Prepared:
    segments: list[Segment]
    sources: list[EntrySource | LayerwiseSource]
    hits: list[SearchResult]
    ratio: float
    decision: dict[str, Any] | None
    notes: list[str]


@dataclass
class Started:
    """A RAG request whose fused prefill has run; its answer decodes with ``engine.step``, here or in
    a shared engine loop (the server's), and ``result`` reports it."""

    request_id: str
    prep: Prepared
    stats: FusionStats
    mode: str
    t0: float
    retrieve_s: float
    ttft_s: float


class RagPipeline:
    def __init__(
        self,
        engine: LLMEngine,
        store: RagStore,
        retriever: Retriever | None = None,
        policy: SelectionPolicy | None = None,
        r_star: float | None = None,
        controller: Any = None,
    ) -> None:
        if engine.tokenizer is None:
            raise RagfuseError("the RAG pipeline needs a model with a tokenizer")
        self.engine = engine
        self.store = store
        self.retriever = retriever or Retriever(store)
        self.policy = policy or SelectionPolicy.default()
        self.r_star = r_star if r_star is not None else self.policy.ratio
        self.controller = controller
        self.builder = RagPromptBuilder(engine.tokenizer)

    # ---- preparing a prompt ------------------------------------------------------------------

    def prepare(self, question: str, top_k: int, mode: str, ratio: float | None) -> tuple[Prepared, float]:
        """Retrieve and assemble the segments; returns them and the retrieval time."""
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r} ({', '.join(MODES)})")
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise RequestError(f"recompute ratio must be in [0, 1], got {ratio}")
        t = time.perf_counter()
        hits = self.retriever.search(question, top_k)
        retrieve_s = time.perf_counter() - t
        if not hits:
            raise RagfuseError("the store has no documents: run `ragfuse ingest` first")
        chunks = self.store.docs.chunks([h.id for h in hits])
        passages = [list(chunks[h.id].token_ids) for h in hits]
        keys = [h.kv_key or self._key(p) for h, p in zip(hits, passages, strict=True)]
        notes: list[str] = []
        sources: list[EntrySource | LayerwiseSource] = []
        segments: list[Segment] = []
        use_kv = mode != FusionMode.FULL.value
        prefix_src = self._source(self._key(self.builder.prefix), self.builder.prefix, notes) if use_kv else None
        segments.append(Segment(self.builder.prefix, prefix_src, "instruction"))
        for i, (hit, toks, key) in enumerate(zip(hits, passages, keys, strict=True)):
            if i:
                segments.append(Segment(self.builder.separator, None, "separator"))
            src = self._source(key, toks, notes) if use_kv and mode != FusionMode.PREFIX.value else None
            segments.append(Segment(toks, src, f"chunk {hit.id}"))
        segments.append(Segment(self.builder.tail(question), None, "question"))
        sources = [s.kv for s in segments if s.kv is not None]  # type: ignore[misc]
        chosen, decision = self._ratio(mode, ratio, sources)
        return Prepared(segments, sources, hits, chosen, decision, notes), retrieve_s

    def _key(self, token_ids: list[int]) -> str:
        return kv_key(self.engine.fingerprint, self.engine.dtype, token_ids)

    def _source(self, key: str, token_ids: list[int], notes: list[str]) -> EntrySource | LayerwiseSource:
        src = open_source(self.store.kv, key)
        if src is not None and src.num_tokens == len(token_ids):
            return src
        (k, v), = self.engine.compute_kv([token_ids])
        entry = StoredKV.from_kv(key, k, v)
        self.store.kv.put(entry)
        notes.append(f"KV of {len(token_ids)} tokens was not stored: computed and stored now")
        return EntrySource(entry, "computed")

    def _ratio(self, mode: str, ratio: float | None, sources: list) -> tuple[float, dict[str, Any] | None]:
        if mode != FusionMode.FUSE.value:
            return 0.0, None
        if ratio is not None:
            return ratio, None
        if self.controller is None or not sources:
            return self.r_star, None
        slowest = sources[-1].tier if sources else "cpu"
        for s in sources:
            if s.tier in ("redis", "disk"):
                slowest = "redis" if "redis" in (slowest, s.tier) else "disk"
        tier = slowest if slowest in self.controller.profile.bandwidth else None
        if tier is None:
            return self.r_star, None
        decision = self.controller.decide(sum(s.num_tokens for s in sources), tier)
        return max(self.r_star, decision.recompute_ratio), decision.as_dict()

    # ---- answering ---------------------------------------------------------------------------

    def stream(
        self, question: str, mode: str = "fuse", ratio: float | None = None, top_k: int = 5,
        params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput | AskResult]:
        """Yield the answer's outputs as they come, then the ``AskResult``."""
        t0 = time.perf_counter()
        prep, retrieve_s = self.prepare(question, top_k, mode, ratio)
        params = params or SamplingParams(max_tokens=64)
        rid, stats = self._fuse(prep, mode, params)
        ttft = time.perf_counter() - t0 - retrieve_s  # the first token was sampled by the fused prefill
        last: RequestOutput | None = None
        try:
            while last is None or not last.finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        last = out
                        yield out
        finally:
            if last is None or not last.finished:
                self.engine.abort(rid)
        yield self._result(prep, stats, last, mode, t0, ttft, retrieve_s)

    def ask(self, question: str, **kwargs: Any) -> AskResult:
        result = None
        for item in self.stream(question, **kwargs):
            result = item
        assert isinstance(result, AskResult)
        return result

    def _fuse(self, prep: Prepared, mode: str, params: SamplingParams) -> tuple[str, FusionStats]:
        """Run the fused prefill; an entry that fails its checksum is dropped, recomputed, retried."""
        for attempt in range(len(prep.sources) + 1):
            try:
                rid, stats = self.engine.add_fused_request(
                    prep.segments, params, mode, self.policy.with_ratio(prep.ratio)
                )
                break
            except CorruptEntryError as exc:
                bad = getattr(exc, "key", None)
                if bad is None or attempt == len(prep.sources):
                    raise
                self._replace_corrupt(prep, bad)
        for src in prep.sources:
            src.finish()
        return rid, stats

    def _replace_corrupt(self, prep: Prepared, key: str) -> None:
        for seg in prep.segments:
            src = seg.kv
            if isinstance(src, LayerwiseSource) and src.key == key:
                src.drop()
                log.warning("KV entry %s failed its checksum: dropped and recomputed", key)
                prep.notes.append(f"KV entry {key[:12]} failed its checksum: recomputed, not served")
                seg.kv = self._source(key, seg.token_ids, prep.notes)
        prep.sources = [s.kv for s in prep.segments if s.kv is not None]  # type: ignore[misc]

    def start(
        self, question: str, mode: str = "fuse", ratio: float | None = None, top_k: int = 5,
        params: SamplingParams | None = None,
    ) -> Started:
        """Retrieve, assemble and run the fused prefill (which samples the first token), without
        stepping the engine: for callers whose own loop steps it (the server's ``AsyncEngine``)."""
        t0 = time.perf_counter()
        prep, retrieve_s = self.prepare(question, top_k, mode, ratio)
        rid, stats = self._fuse(prep, mode, params or SamplingParams(max_tokens=64))
        return Started(rid, prep, stats, mode, t0, retrieve_s, time.perf_counter() - t0 - retrieve_s)

    def result(self, started: Started, last: RequestOutput) -> AskResult:
        """The report of a ``start``ed request once its last output is in."""
        return self._result(started.prep, started.stats, last, started.mode, started.t0, started.ttft_s,
                            started.retrieve_s)

    def _result(
        self, prep: Prepared, stats: FusionStats, last: RequestOutput, mode: str, t0: float, ttft: float,
        retrieve_s: float,
    ) -> AskResult:
        return AskResult(
            answer=last.text.strip(),
            sources=[h.as_dict() for h in prep.hits],
            mode=mode,
            recompute_ratio=stats.recompute_ratio,
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            retrieve_s=retrieve_s,
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens,
            recomputed_tokens=stats.recomputed_tokens,
            load_s=stats.load_s,
            load_hidden=stats.load_hidden,
            recompute_s=stats.compute_s,
            tiers=stats.tiers,
            token_ids=last.token_ids,
            finish_reason=last.finish_reason,
            decision=prep.decision,
            notes=prep.notes,
        )
