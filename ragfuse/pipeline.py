"""The RAG pipeline: retrieve, assemble the prompt from stored chunks, fuse their KV, answer.

Every stored piece of the prompt (the instruction prefix and each retrieved chunk) brings its KV
from the fastest tier that holds it; a missing or corrupt entry is recomputed (and stored) instead,
never served. The recompute ratio comes from the loading controller (measured delays) and never
goes below the accuracy gate's calibrated r* for this model, unless the caller sets one. Where the
stored KV lies in a tier slower than recomputing, the controller may load only the first few stored
pieces; the others are then computed in full, and counted as recomputed.

The instruction prefix is the same for every question, so in the ``fuse`` and ``reuse`` modes it is
served as a registered system prompt (relay attention, ``engine.relay_prompts``): its KV sits once
in the registry's blocks, the fused rest of the prompt follows it at positions after it, and no
request loads, rotates or holds a copy of it. ``prefix`` mode keeps it as its stored first segment
(that mode *is* prefix caching), ``full`` computes everything (the reference), and a session turn
keeps it inside the session's history, where it already is a reused prefix. Without relay (the
model has a sliding window, ``relay=False``) it is a stored segment reused as an exact prefix.

In a session, the first question is the whole prompt; each later one is a follow-up message after
the history (the template's next user header, the passages, the question), and a retrieved chunk
that the history the model will still see already holds is not repeated (``_as_follow_up``).

Chunks' KV is keyed and, on a miss, computed as the store's ingest did it (``chunk_kv.py``): by
default after that same instruction prefix, so a chunk's stored KV has seen what precedes it.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ragfuse.chunk_kv import ChunkKV
from ragfuse.controller_source import ControllerSource
from ragfuse.engine import LLMEngine, RequestOutput, SamplingParams
from ragfuse.engine.errors import RagfuseError, RequestError
from ragfuse.engine.fusion import FusionMode, FusionStats, Segment, SelectionPolicy
from ragfuse.engine.kvstore import (
    CorruptEntryError,
    EntrySource,
    KVShape,
    KVStoreError,
    LayerwiseSource,
    StoredKV,
    UnreadableEntryError,
    kv_key,
    open_source,
)
from ragfuse.engine.sessions import surely_fed
from ragfuse.engine.step_router import StepRouter
from ragfuse.passage import Passage
from ragfuse.passage_finder import PassageFinder
from ragfuse.prompt import RagPromptBuilder
from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever

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
    session: dict[str, Any] | None = None  # with a session id: its reuse stats (RequestOutput.metrics)
    session_tokens_reused: int = 0  # history tokens whose KV came from the session, apart from chunk reuse
    relay_system_tokens: int = 0  # instruction tokens served by relay (counted in prompt and reused tokens)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stats(self) -> dict[str, Any]:
        """Everything but the answer itself: sources, fusion and timing (a framework's response metadata)."""
        return {k: v for k, v in self.as_dict().items() if k not in ("answer", "token_ids")}


@dataclass
class Prepared:
    segments: list[Segment]
    sources: list[EntrySource | LayerwiseSource]
    hits: list[dict[str, Any]]  # the answer's sources: retrieved chunks, or given passages and whether stored
    ratio: float
    decision: dict[str, Any] | None
    notes: list[str]
    relay_tokens: int = 0  # set when the instruction prefix ran as a relay system prompt
    question: str = ""  # the RAG question (none for a prompt the caller laid out)

    def kv_tiers(self) -> list[str]:
        """Where each stored piece's KV came from, in prompt order; "relay" for an instruction
        prefix served as a registered system prompt (its stored copy was not loaded)."""
        tiers = [s.tier for s in self.sources]
        if self.relay_tokens and self.segments[0].kv is not None:
            tiers[0] = "relay"
        return tiers


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
        store: RagStore | None,
        retriever: Retriever | None = None,
        policy: SelectionPolicy | None = None,
        r_star: float | None = None,
        controller: ControllerSource | None = None,
        relay: bool = True,
    ) -> None:
        """``relay``: serve the instruction prefix as a relay system prompt where the mode allows
        it (see the module's docstring); a call may say otherwise. ``controller``: the store's
        delay profile's loading controller as the profile is at each answer; where it has none
        though one was meant to be (a profile that could not be read), why is said in the notes of
        every answer whose ratio it would have chosen."""
        if engine.tokenizer is None:
            raise RagfuseError("the RAG pipeline needs a model with a tokenizer")
        self.engine = engine
        self.store = store  # None: no stored KV, every prompt is prefilled (a plain chat model)
        self._retriever = retriever
        self._finder: PassageFinder | None = None
        self.policy = policy or SelectionPolicy.default()
        self.r_star = r_star if r_star is not None else self.policy.ratio
        self.controller = controller
        self.builder = RagPromptBuilder(engine.tokenizer)
        # chunks' KV keyed and (on a miss) computed as the store's ingest did: after the instruction or alone
        self.chunk_kv = (ChunkKV.for_context(engine, store.config.chunk_kv_context, self.builder)
                         if store is not None else None)
        self.relay = relay
        mc = engine.model_config  # what stored KV must hold to be this model's: other shapes are damage
        self.kv_shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype)
        # callers on several threads (a framework's batch) and open streams share the engine through it
        self.router = StepRouter.of(engine)

    @property
    def finder(self) -> PassageFinder:
        """Finds stored chunks in given text (made on first use; it indexes the docstore)."""
        assert self.store is not None
        if self._finder is None:
            self._finder = PassageFinder(self.store)
        return self._finder

    @property
    def retriever(self) -> Retriever:
        """Made on first use: answering from given passages needs no embedding model."""
        if self._retriever is None:
            if self.store is None:
                raise RagfuseError("retrieval needs a ragfuse store")
            self._retriever = Retriever(self.store)
        return self._retriever

    # ---- preparing a prompt ------------------------------------------------------------------

    def prepare(self, question: str, top_k: int, mode: str, ratio: float | None) -> tuple[Prepared, float]:
        """Retrieve and assemble the segments; returns them and the retrieval time."""
        self._check(mode, ratio)
        t = time.perf_counter()
        hits = self.retriever.search(question, top_k)
        retrieve_s = time.perf_counter() - t
        if not hits:
            raise RagfuseError("the store has no documents: run `ragfuse ingest` first")
        notes: list[str] = []
        use_kv = mode not in (FusionMode.FULL.value, FusionMode.PREFIX.value)
        segments: list[Segment] = []
        with _finished_on_error(segments):
            for hit in hits:
                toks = list(hit.token_ids)
                segments.append(Segment(toks, self._chunk_source(toks, notes) if use_kv else None, f"chunk {hit.id}"))
            return self._assemble(segments, [h.as_dict() for h in hits], question, mode, ratio, notes), retrieve_s

    def prepare_passages(
        self, question: str, passages: list[Passage], mode: str = "fuse", ratio: float | None = None
    ) -> Prepared:
        """The RAG prompt over passages the caller retrieved, in the caller's order (no retrieval)."""
        self._check(mode, ratio)
        if not question.strip():
            raise RequestError("the question is empty")
        if not passages:
            raise RequestError("no passages given")
        notes: list[str] = []
        segments: list[Segment] = []
        with _finished_on_error(segments):
            segments.extend(self.passage_segment(p, mode, notes) for p in passages)
            return self._assemble(segments, _described(passages, segments), question, mode, ratio, notes)

    def prepare_parts(self, parts: list[str | Passage], mode: str = "fuse", ratio: float | None = None) -> Prepared:
        """A prompt the caller laid out (a chat rendered with its template): text parts are prefilled,
        passages bring their stored KV. For framework chat models, whose prompt is theirs to shape."""
        self._check(mode, ratio)
        notes: list[str] = []
        segments: list[Segment] = []
        passages: list[Passage] = []
        passage_segments: list[Segment] = []
        with _finished_on_error(segments):
            for part in parts:
                if isinstance(part, Passage):
                    segments.append(self.passage_segment(part, mode, notes))
                    passages.append(part)
                    passage_segments.append(segments[-1])
                elif part:
                    segments.append(Segment(self.engine.tokenizer.encode(part, add_special_tokens=False), None,
                                            "text"))
            if not segments:
                raise RequestError("empty prompt")
            chosen, decision = self._plan_loading(mode, ratio, segments, notes)
        described = _described(passages, passage_segments)
        sources = [seg.kv for seg in segments if seg.kv is not None]
        return Prepared(segments, sources, described, chosen, decision, notes)  # type: ignore[arg-type]

    def passage_segment(self, passage: Passage, mode: str, notes: list[str]) -> Segment:
        """A passage's tokens, with its stored KV when there is any.

        A stored chunk named by id (with its text, if given, unchanged) brings its stored tokens, and
        its KV is computed and stored if missing, as for retrieved chunks. Other text is tokenized as
        ingest tokenizes a chunk; its KV is used when stored and otherwise it is simply prefilled:
        the caller's text is not the store's to keep."""
        use_kv = self.store is not None and mode not in (FusionMode.FULL.value, FusionMode.PREFIX.value)
        chunk = None
        if passage.id is not None and self.store is not None:
            chunk = self.store.docs.chunks([passage.id]).get(passage.id)
            if chunk is not None and passage.text and passage.text.strip() != chunk.text.strip():
                chunk = None  # the id names other text now (re-ingested): go by the text
        if chunk is None and not passage.text.strip():
            raise RequestError("a passage given as text is empty" if passage.id is None
                               else f"passage {passage.id} is neither in the store nor given as text")
        if chunk is None and self.store is not None:  # text that is exactly a stored chunk is that chunk
            found = self.finder.split(passage.text.strip())
            if len(found) == 1 and isinstance(found[0], Passage):
                chunk = self.store.docs.chunks([found[0].id]).get(found[0].id)  # type: ignore[list-item]
        if chunk is not None:
            toks = list(chunk.token_ids)
            return Segment(toks, self._chunk_source(toks, notes) if use_kv else None, f"chunk {chunk.id}")
        toks = self.builder.passage_tokens(passage.text)
        src = self._lookup(self.chunk_kv.key(toks), len(toks), notes) if use_kv else None  # type: ignore[union-attr]
        return Segment(toks, src, "stored passage" if src is not None else "passage")

    def _check(self, mode: str, ratio: float | None) -> None:
        if mode not in MODES:
            raise RequestError(_unknown_mode(mode))
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                                  or not 0.0 <= ratio <= 1.0):
            raise RequestError(f"recompute ratio must be a number in [0, 1], got {ratio!r}")

    def _assemble(
        self, passages: list[Segment], hits: list[dict[str, Any]], question: str, mode: str,
        ratio: float | None, notes: list[str],
    ) -> Prepared:
        """Instruction prefix (its KV stored once), the passages between separators, the question."""
        use_kv = self.store is not None and mode != FusionMode.FULL.value
        prefix_src = self._source(self._key(self.builder.prefix), self.builder.prefix, notes) if use_kv else None
        segments = [Segment(self.builder.prefix, prefix_src, "instruction")]
        for i, seg in enumerate(passages):
            if i:
                segments.append(Segment(self.builder.separator, None, "separator"))
            segments.append(seg)
        segments.append(Segment(self.builder.tail(question), None, "question"))
        chosen, decision = self._plan_loading(mode, ratio, segments, notes)
        sources = [s.kv for s in segments if s.kv is not None]
        why_none = self.controller.current()[1] if self.controller is not None else None
        if why_none and mode == FusionMode.FUSE.value and ratio is None:
            notes.append(why_none)
        return Prepared(segments, sources, hits, chosen, decision, notes, question=question)  # type: ignore[arg-type]

    def _key(self, token_ids: list[int]) -> str:
        return kv_key(self.engine.fingerprint, self.engine.dtype, token_ids)

    def _chunk_source(self, token_ids: list[int], notes: list[str], damaged: bool = False,
                      ) -> EntrySource | LayerwiseSource:
        """A chunk's stored KV, or (on a miss) its KV computed and stored as ingest would have."""
        assert self.chunk_kv is not None
        return self._source(self.chunk_kv.key(token_ids), token_ids, notes, self.chunk_kv.context, damaged)

    def _source(
        self, key: str, token_ids: list[int], notes: list[str], context: tuple[int, ...] = (),
        damaged: bool = False,
    ) -> EntrySource | LayerwiseSource:
        """The stored KV under ``key``, else the KV of ``token_ids`` after ``context``, computed and
        stored. ``damaged``: the entry was stored, and dropped while loading (already noted)."""
        assert self.store is not None
        before = len(notes)
        src = self._lookup(key, len(token_ids), notes)
        if src is not None:
            return src
        # after a damaged or unreadable entry (noted) the KV had been stored, only not usable
        what = "" if damaged or len(notes) > before else " was not stored:"
        (k, v), = self.engine.compute_kv([token_ids], context)
        entry = StoredKV.from_kv(key, k, v)
        if self.store.read_only:  # nothing can be stored: no fault, and a memory tier keeps it for the next question
            with suppress(KVStoreError):  # (a one-shot ask has none: its disk tier refuses)
                self.store.kv.put_top(entry)
            notes.append(f"KV of {len(token_ids)} tokens{what} computed, kept in memory only (the store is read-only)")
            return EntrySource(entry, "computed")
        try:
            self.store.kv.put(entry)
            notes.append(f"KV of {len(token_ids)} tokens{what} computed and stored now")
        except (KVStoreError, OSError) as exc:  # a full disk: answer anyway, say why nothing was kept
            log.warning("KV entry %s was computed but not stored: %s", key, exc)
            notes.append(f"KV of {len(token_ids)} tokens{what} computed, but storing it failed ({exc})")
        return EntrySource(entry, "computed")

    def _lookup(self, key: str, num_tokens: int, notes: list[str]) -> EntrySource | LayerwiseSource | None:
        """The stored KV under ``key``, if it is this model's KV of ``num_tokens`` tokens; else None.
        A damaged entry (it does not open, or holds another shape) is dropped with a note, so what
        the caller computes instead can be stored; a tier that fails (an I/O error, Redis gone) is a
        miss with a note. Either way the answer still comes."""
        assert self.store is not None
        damaged: list[str] = []
        try:
            src = open_source(self.store.kv, key, self.kv_shape, num_tokens, damaged)
            notes += [f"KV entry {key[:12]} was damaged ({why}): recomputed, not served" for why in damaged]
            return src
        except KVStoreError as exc:
            log.warning("KV entry %s could not be looked up: %s", key, exc)
            notes.append(f"KV entry {key[:12]} could not be read ({exc}): recomputed")
            return None

    def _plan_loading(self, mode: str, ratio: float | None, segments: list[Segment], notes: list[str],
               ) -> tuple[float, dict[str, Any] | None]:
        """What a fused answer over ``segments`` loads and recomputes: returns the recompute ratio (the
        caller's, else the loading controller's for where their stored KV lies, never under r*) and the
        controller's decision. Where the controller loads only the first few stored pieces, the others'
        sources are released here, before anything reads them (and noted): those pieces are computed."""
        sources = [s.kv for s in segments if s.kv is not None]
        if mode != FusionMode.FUSE.value:
            return 0.0, None
        if ratio is not None:
            return ratio, None
        controller = self.controller.current()[0] if self.controller is not None and sources else None
        if controller is None:
            return self.r_star, None
        slowest = sources[-1].tier if sources else "cpu"
        for src in sources:
            if src.tier in ("redis", "disk"):
                slowest = "redis" if "redis" in (slowest, src.tier) else "disk"
        tier = slowest if slowest in controller.profile.bandwidth else None
        if tier is None:
            return self.r_star, None
        sizes = [src.num_tokens for src in sources]
        decision = controller.decide(sum(sizes), tier, sources=sizes, exact_prefix=segments[0].kv is not None)
        if decision.loaded_sources is not None:
            left_out = [seg for seg in segments if seg.kv is not None][decision.loaded_sources:]
            for seg in left_out:
                seg.kv.finish()  # type: ignore[union-attr]
                seg.kv = None
            notes.append(f"the loading controller loaded the first {decision.loaded_sources} of {len(sources)} "
                         f"stored pieces from {tier}; {', '.join(seg.label for seg in left_out)} computed in full, "
                         "which is sooner than loading them")
        return max(self.r_star, decision.recompute_ratio), decision.as_dict()

    # ---- answering ---------------------------------------------------------------------------

    def stream(
        self, question: str, mode: str = "fuse", ratio: float | None = None, top_k: int = 5,
        params: SamplingParams | None = None, session_id: str | None = None, relay: bool | None = None,
    ) -> Iterator[RequestOutput | AskResult]:
        """Yield the answer's outputs as they come, then the ``AskResult``. With ``session_id``
        the turn follows the session's history (its KV reused, not recomputed) and the fused prompt
        and answer become part of that history for the next turn. ``relay``: this call's choice
        (default: the pipeline's)."""
        with self.router.lock:  # a start that finds the cache full steps the others until there is room
            started = self.engine.when_room(lambda: self.start(question, mode, ratio, top_k, params, session_id,
                                                               relay))
            self.router.track(started.request_id)
        yield from self._follow(started)

    def stream_passages(
        self, question: str, passages: list[Passage], mode: str = "fuse", ratio: float | None = None,
        params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput | AskResult]:
        """``stream`` over passages the caller retrieved (a framework's retriever) instead of ours."""
        return self._stream_prepared(lambda: self.prepare_passages(question, passages, mode, ratio), mode, params)

    def stream_parts(
        self, parts: list[str | Passage], mode: str = "fuse", ratio: float | None = None,
        params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput | AskResult]:
        """``stream`` over a prompt the caller laid out (see ``prepare_parts``)."""
        return self._stream_prepared(lambda: self.prepare_parts(parts, mode, ratio), mode, params)

    def _stream_prepared(
        self, prepare: Callable[[], Prepared], mode: str, params: SamplingParams | None
    ) -> Iterator[RequestOutput | AskResult]:
        # preparing may open stored KV or compute missing KV on the engine: under the engine's lock
        with self.router.lock:
            t0 = time.perf_counter()
            started = self.engine.when_room(lambda: self.start_prepared(prepare(), mode, params, t0, 0.0))
            self.router.track(started.request_id)
        yield from self._follow(started)

    def _follow(self, started: Started) -> Iterator[RequestOutput | AskResult]:
        """A started request's outputs, then its ``AskResult``. The engine's lock is not held while
        the caller has an output, so a stream read halfway does not block the next call."""
        last: RequestOutput | None = None
        for out in self.router.outputs(started.request_id):
            last = out
            yield out
        assert last is not None
        result = self.result(started, last)
        with self.router.lock:
            self.engine.close_turns()  # a session turn: its answer's last token, then the session saved
        yield result

    def ask(self, question: str, **kwargs: Any) -> AskResult:
        return final(self.stream(question, **kwargs))

    def _fuse(
        self, prep: Prepared, mode: str, params: SamplingParams, session_id: str | None = None,
        relay: bool | None = None,
    ) -> tuple[str, FusionStats]:
        """Run the fused prefill; an entry that fails its checksum is dropped, recomputed, retried."""
        system = self._relay_system(prep, mode, session_id, self.relay if relay is None else relay)
        for attempt in range(len(prep.sources) + 1):
            try:
                policy = self.policy.with_ratio(prep.ratio)
                if system is not None:
                    computed = self.engine.systems.get(system).fresh  # registered for this question
                    rid, stats = self.engine.add_fused_request(prep.segments[1:], params, mode, policy,
                                                               system=system)
                    prep.relay_tokens = len(prep.segments[0].token_ids)
                    stats = _with_system(stats, prep.relay_tokens, computed)
                elif session_id is None:
                    rid, stats = self.engine.add_fused_request(prep.segments, params, mode, policy)
                else:
                    rid, stats = self._session_turn(session_id, prep, mode, params, policy)
                break
            except (CorruptEntryError, UnreadableEntryError) as exc:
                bad = getattr(exc, "key", None)
                if bad is None or attempt == len(prep.sources):
                    self._finish_sources(prep)
                    raise
                self._recompute_entry(prep, bad, exc)
            except BaseException:  # e.g. the cache full (a server retries the request later): close the readers
                self._finish_sources(prep)
                raise
        self._finish_sources(prep)
        return rid, stats

    @staticmethod
    def _finish_sources(prep: Prepared) -> None:
        for src in prep.sources:
            src.finish()

    def _relay_system(self, prep: Prepared, mode: str, session_id: str | None, relay: bool) -> int | None:
        """The relay id of the instruction prefix, where it runs as a system prompt (module docstring)."""
        first = prep.segments[0]
        if (not relay or session_id is not None or mode not in (FusionMode.FUSE.value, FusionMode.REUSE.value)
                or first.label != "instruction" or len(prep.segments) < 2 or not self.engine.supports_relay):
            return None
        return self.engine.relay_prompts.acquire(first.token_ids)

    def _session_turn(
        self, session_id: str, prep: Prepared, mode: str, params: SamplingParams, policy: SelectionPolicy
    ) -> tuple[str, FusionStats]:
        """The RAG prompt as the session's next turn: the stored history first (reused), then the
        fused prompt, which is saved with the answer as history for the turn after."""
        if self.engine.sessions is None:
            raise RagfuseError("sessions are not enabled on this engine")
        # the history is the session's (its callers send only the question): a second turn beside a
        # running one would start from the same history, and one of the two be lost when both are saved
        if self.engine.turn_running(session_id):
            raise RequestError(f"session {session_id} has a turn in progress: ask its next question once that "
                               "answer has finished")
        # the previous turn, finished but not yet through its closing step, is saved first: its history
        # read without it would be matched against the saved turn, and the prompt fed twice
        self.engine.settle_session(session_id)
        history, stored = self.engine.sessions.history(session_id)
        prefix = self.builder.prefix
        if history and history[: len(prefix)] != prefix:  # a chat's, whose turn this prompt cannot close
            raise RequestError(f"session {session_id} holds a chat that did not open with the RAG instruction "
                               "(one of `generate --session` or the server's chat): a RAG question cannot follow "
                               "it; use another session id")
        if history and prep.segments[0].label == "instruction":
            self._as_follow_up(prep, mode, history, stored, params.max_tokens)
        prompt = [t for seg in prep.segments for t in seg.token_ids]
        turn = self.engine.begin_session_turn(session_id, history + prompt, params.max_tokens,
                                              new_tokens=len(prompt), keep_first=len(prefix))
        if mode == FusionMode.FULL.value and turn.reused:
            mode = FusionMode.PREFIX.value  # the history is a cached prefix; the RAG prompt fully computed
        rid = self.engine.start_session_turn(turn, params, tail=prep.segments, mode=mode, policy=policy)
        ran = self.engine.session_turn(rid)
        prep.notes.extend(ran.notes)
        assert ran.fusion is not None
        return rid, ran.fusion

    def _as_follow_up(
        self, prep: Prepared, mode: str, history: list[int], stored: list[tuple[int, int]], reserve: int
    ) -> None:
        """Make the whole RAG prompt ``prep`` a follow-up message after a session's ``history`` (which
        opens with the same instruction, kept on any cut): the template's next user header, the
        retrieved chunks that the history the model is sure to see does not hold already, the
        question. Repeating a held chunk would only spend context and recompute on it."""
        passages = prep.segments[1:-1:2]  # between the instruction and the question, separators between
        kept = passages
        while True:  # a shorter prompt cuts less history, which may hold more of the chunks: until none
            segments = self._follow_up(history, kept, prep.question)
            seen = surely_fed(history, stored, [t for seg in segments for t in seg.token_ids],
                              self.engine.max_model_len, reserve, len(self.builder.prefix))
            haystacks = [array("q", history[s:e]).tobytes() for s, e in seen]
            fewer = [seg for seg in kept if not any(_holds(h, seg.token_ids) for h in haystacks)]
            if len(fewer) == len(kept):
                break
            kept = fewer
        for seg in prep.segments:
            if seg.kv is not None and all(seg is not k for k in kept):
                seg.kv.finish()
        prep.notes += [f"{seg.label} is in this session's history already: not repeated"
                       for seg in passages if all(seg is not k for k in kept)]
        prep.segments = segments
        if prep.decision is not None:  # the controller's: decided again for what is loaded now
            prep.ratio, prep.decision = self._plan_loading(mode, None, segments, prep.notes)
        prep.sources = [seg.kv for seg in segments if seg.kv is not None]  # type: ignore[misc]

    def _follow_up(self, history: list[int], passages: list[Segment], question: str) -> list[Segment]:
        """A follow-up message after ``history``: the template's next user header, ``passages``
        between separators, the question."""
        segments = [Segment(self.builder.turn_head(history, self.engine.eos_token_ids), None, "follow-up")]
        for i, seg in enumerate(passages):
            if i:
                segments.append(Segment(self.builder.separator, None, "separator"))
            segments.append(seg)
        return [*segments, Segment(self.builder.tail(question, after_passages=bool(passages)), None, "question")]

    def _recompute_entry(self, prep: Prepared, key: str, exc: KVStoreError) -> None:
        """Swap the source of entry ``key`` for its recomputed KV: a corrupt entry is dropped from
        its tier, an unreadable one is left there (its tier may recover)."""
        for seg in prep.segments:
            src = seg.kv
            if isinstance(src, LayerwiseSource) and src.key == key:
                if isinstance(exc, CorruptEntryError):
                    src.drop()
                    log.warning("KV entry %s failed its checksum: dropped and recomputed", key)
                    prep.notes.append(f"KV entry {key[:12]} failed its checksum: recomputed, not served")
                else:
                    log.warning("KV entry %s could not be read, recomputed: %s", key, exc)
                    prep.notes.append(f"KV entry {key[:12]} could not be read ({exc}): recomputed")
                seg.kv = (self._source(key, seg.token_ids, prep.notes, damaged=True) if seg.label == "instruction"
                          else self._chunk_source(seg.token_ids, prep.notes, damaged=True))
        prep.sources = [s.kv for s in prep.segments if s.kv is not None]  # type: ignore[misc]

    def start(
        self, question: str, mode: str = "fuse", ratio: float | None = None, top_k: int = 5,
        params: SamplingParams | None = None, session_id: str | None = None, relay: bool | None = None,
        check: Callable[[Prepared], SamplingParams | None] | None = None,
    ) -> Started:
        """Retrieve, assemble and run the fused prefill (which samples the first token), without
        stepping the engine: for callers whose own loop steps it (the server's ``AsyncEngine``).
        ``session_id`` and ``relay``: as in ``stream``.

        ``check``: called with the assembled prompt before anything runs on it, as only retrieval
        tells its length: it returns the sampling to use (None: ``params``), or raises to refuse the
        question (the server's refusal of a prompt past the context), which releases the stored KV
        the prompt had opened and starts nothing."""
        t0 = time.perf_counter()
        prep, retrieve_s = self.prepare(question, top_k, mode, ratio)
        if check is not None:
            try:
                checked = check(prep)
            except BaseException:
                self._finish_sources(prep)
                raise
            params = checked if checked is not None else params
        return self.start_prepared(prep, mode, params, t0, retrieve_s, session_id, relay)

    def start_prepared(
        self, prep: Prepared, mode: str, params: SamplingParams | None, t0: float, retrieve_s: float,
        session_id: str | None = None, relay: bool | None = None,
    ) -> Started:
        """``start`` for a prompt already ``prepare``d: a caller can look at it (its length) first."""
        rid, stats = self._fuse(prep, mode, params or SamplingParams(max_tokens=64), session_id, relay)
        return Started(rid, prep, stats, mode, t0, retrieve_s, time.perf_counter() - t0 - retrieve_s)

    def result(self, started: Started, last: RequestOutput) -> AskResult:
        """The report of a ``start``ed request once its last output is in."""
        return self._result(started.prep, started.stats, last, started.mode, started.t0, started.ttft_s,
                            started.retrieve_s)

    def _result(
        self, prep: Prepared, stats: FusionStats, last: RequestOutput, mode: str, t0: float, ttft: float,
        retrieve_s: float,
    ) -> AskResult:
        ratio, recomputed = stats.recompute_ratio, stats.recomputed_tokens
        passage_tokens = sum(len(s.token_ids) for s in prep.segments if _is_stored_passage(s))
        if _computes_passages(mode, prep.ratio):
            # the fused pass counts only stored KV it loaded, and it loaded no chunk's: all were computed
            ratio, recomputed = 1.0, passage_tokens
        elif prep.decision is not None and prep.decision["loaded_sources"] is not None:
            # the chunks the controller left unloaded were computed in full: counted, as the share over all
            recomputed += sum(len(s.token_ids) for s in prep.segments if _is_stored_passage(s) and s.kv is None)
            ratio = recomputed / max(passage_tokens, 1)
        return AskResult(
            answer=last.text.strip(),
            sources=prep.hits,
            mode=mode,
            recompute_ratio=ratio,
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            retrieve_s=retrieve_s,
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens - _fresh_kv_tokens(prep, stats),
            recomputed_tokens=recomputed,
            load_s=stats.load_s,
            load_hidden=stats.load_hidden,
            recompute_s=stats.compute_s,
            tiers=stats.tiers,
            token_ids=last.token_ids,
            finish_reason=last.finish_reason,
            decision=prep.decision,
            notes=prep.notes,
            session={k: v for k, v in last.metrics.items() if k.startswith("session") or k == "prefilled_tokens"}
            or None,
            session_tokens_reused=int(last.metrics.get("session_tokens_reused", 0)),
            relay_system_tokens=int(last.metrics.get("relay_system_tokens", 0)),
        )


def _with_system(stats: FusionStats, system_tokens: int, computed: bool) -> FusionStats:
    """Fusion stats of a prompt behind a relay system prompt, counted over the whole prompt: the
    system tokens are part of it, and their KV is reused (from the registry), or ``computed`` for
    this question where it was the first to need them."""
    reused = 0 if computed else system_tokens
    return replace(stats, prompt_tokens=stats.prompt_tokens + system_tokens,
                   stored_tokens=stats.stored_tokens + reused, reused_tokens=stats.reused_tokens + reused,
                   computed_tokens=stats.computed_tokens + system_tokens - reused,
                   tiers=sorted({*stats.tiers, "relay"}))


def _fresh_kv_tokens(prep: Prepared, stats: FusionStats) -> int:
    """Tokens whose KV this very call computed (a chunk missing from the store, or found damaged:
    tier "computed") that the fused pass kept rather than recomputed. The pass counts them reused,
    but nothing stored was: a cold store would report every chunk a cache hit (LangChain's
    ``cache_read``). ``recomputed_positions`` are positions in the fused prompt: after a session's
    history, and without the relay system prompt before it."""
    segments = prep.segments[1:] if prep.relay_tokens else prep.segments
    at = 0 if prep.relay_tokens else stats.prompt_tokens - sum(len(s.token_ids) for s in segments)
    spans = []
    for seg in segments:
        if seg.kv is not None and seg.kv.tier == "computed":
            spans.append((at, at + len(seg.token_ids)))
        at += len(seg.token_ids)
    if not spans:
        return 0
    redone = stats.recomputed_positions.cpu() if stats.recomputed_positions is not None else None
    return sum(e - s - (int(((redone >= s) & (redone < e)).sum()) if redone is not None else 0) for s, e in spans)


def _computes_passages(mode: str, ratio: float) -> bool:
    """Whether the prefill computes every stored chunk rather than use its stored KV: ``full`` and
    ``prefix`` by definition, and ``fuse`` at ratio 1, which loads none of it (it would recompute it
    all). ``recompute_ratio`` and ``recomputed_tokens`` then say so alike: all of the chunks' tokens."""
    return mode in (FusionMode.FULL.value, FusionMode.PREFIX.value) or (mode == FusionMode.FUSE.value and ratio >= 1.0)


def _is_stored_passage(segment: Segment) -> bool:
    """A retrieved or named chunk of the store, or a given passage found stored: what the recompute
    figures count (the instruction prefix, given text not stored and the question are not)."""
    return segment.label.startswith("chunk ") or segment.label == "stored passage"


def known_mode(mode: str) -> str:
    """``mode`` if it is one of ``MODES``: a framework object's field checks it when made (pydantic
    reports the ValueError as the field's validation error)."""
    if mode not in MODES:
        raise ValueError(_unknown_mode(mode))
    return mode


def _unknown_mode(mode: str) -> str:
    return f"unknown mode {mode!r} ({', '.join(MODES)})"


def _holds(haystack: bytes, tokens: list[int]) -> bool:
    """Whether ``tokens`` occur as a run in ``haystack`` (token ids as 8-byte integers): a byte
    search, with matches not on a token boundary skipped."""
    needle = array("q", tokens).tobytes()
    at = haystack.find(needle)
    while at > 0 and at % 8:
        at = haystack.find(needle, at + 1)
    return at >= 0


def final(items: Iterator[RequestOutput | AskResult]) -> AskResult:
    """Run a ``stream`` to its end and return its ``AskResult``."""
    result = None
    for item in items:
        result = item
    assert isinstance(result, AskResult)
    return result


@contextmanager
def _finished_on_error(segments: list[Segment]) -> Iterator[None]:
    """Close the stored KV already opened for a prompt whose assembly then fails (a later passage
    refused): a disk entry's open reader otherwise held its file for as long as the error lived (a
    caller or framework keeping it), one more open file per refused call, closed only by the collector."""
    try:
        yield
    except BaseException:
        for seg in segments:
            if seg.kv is not None:
                seg.kv.finish()
        raise


def _described(passages: list[Passage], segments: list[Segment]) -> list[dict[str, Any]]:
    """Given passages as the answer's sources, each saying whether its KV came from the store."""
    return [{**p.as_dict(), "stored": seg.kv is not None} for p, seg in zip(passages, segments, strict=True)]
