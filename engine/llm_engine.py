"""``LLMEngine``: requests in, tokens out, one ``step`` at a time.

The engine owns the tokenizer, scheduler, block manager and model runner. ``step`` runs one
scheduled batch and reports what changed; callers (the ``LLM`` facade, the async loop of the
server) drive it. It is single-threaded by design: the async engine runs it on one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from . import checkpoint as ckpt
from .block_manager import BlockManager
from .chat_template import render_chat
from .config import EngineConfig, ModelConfig
from .detokenizer import IncrementalDetokenizer
from .errors import CacheFullError, ModelError, RequestError
from .fusion import FusionMode, FusionStats, Segment, SelectionPolicy
from .kv_cache import KVCache
from .model_runner import DecodeInFlight, ModelRunner
from .models import KVHook
from .prefix_tree import PrefixTree
from .relay_prompts import RelayPrompts
from .sampling import SamplingParams, sample
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, Status
from .sessions import SessionCorruptError, SessionStore, SessionTurn, begin_turn, take_snapshot
from .sessions.history import extend
from .sessions.prefix import STAGE_AHEAD, HistoryWriter
from .swap import SwapSpace
from .system_prompts import SystemPrompts

log = logging.getLogger("ragfuse.engine")
MAX_SYSTEM_PROMPTS = 16  # registered at once (applications hosted side by side)
T = TypeVar("T")


@dataclass
class RequestOutput:
    """Where a request stands after a step: the text and tokens so far and what is new."""

    request_id: str
    prompt_tokens: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    ttft_s: float | None
    total_s: float
    metrics: dict[str, Any] = field(default_factory=dict)


class RoomMark(NamedTuple):
    """The cache as a start that found no room saw it (``LLMEngine.room_mark``)."""

    free: int  # free blocks
    behind_preempted: bool  # preempted requests were waiting: starts let them resume first


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, random_weights: ModelConfig | None = None) -> None:
        """Load ``config.model``; or, with ``random_weights``, build that architecture with random
        weights and no tokenizer (for speed benchmarks of real shapes)."""
        self.config = config or EngineConfig()
        self.device = self.config.resolve_device()
        self.dtype = self.config.resolve_dtype(self.device)
        if random_weights is not None:
            self.checkpoint = None
            self.model_config = random_weights
            self.tokenizer = None
            self.model_name = f"random-{random_weights.family}"
        else:
            self.checkpoint = ckpt.resolve(self.config.model)
            self.model_config = ModelConfig.from_dir(self.checkpoint.path)
            self.tokenizer = _load_tokenizer(self.checkpoint.path)
            self.model_name = self.checkpoint.name
        mc = self.model_config
        self.max_model_len = min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self._check_host_memory()
        self.runner = ModelRunner(
            mc, self.checkpoint, self.device, self.dtype, self.max_model_len, self.config.attention_backend
        )
        # EngineConfig.seed: the same engine seed and the same requests in the same order draw the same
        # tokens for requests that give no seed (a request's own seed never depends on it)
        self.runner.rng = torch.Generator(device=self.device).manual_seed(self.config.seed)
        num_blocks = KVCache.blocks_for_budget(mc, self.config.block_size, self.dtype, self._kv_budget())
        self.runner.allocate_cache(num_blocks, self.config.block_size)
        self.blocks = BlockManager(num_blocks, self.config.block_size)
        self.systems = SystemPrompts(MAX_SYSTEM_PROMPTS, self.max_model_len, self.config.block_size, self.device)
        self.runner.systems = self.systems
        self.relay_prompts = RelayPrompts(self, MAX_SYSTEM_PROMPTS)  # registered on demand, LRU-bounded
        self.tree = PrefixTree(self.blocks) if self.config.prefix_tree else None
        assert self.runner.kv_cache is not None
        swap_bytes = self.config.swap_space_bytes
        if swap_bytes is None:
            swap_bytes = 4 << 30 if self.device.type == "cuda" else self.runner.kv_cache.storage.nbytes
        self.scheduler = Scheduler(
            self.blocks, self.config.max_num_seqs, max(self.config.max_num_batched_tokens, 1), self.tree,
            reclaim=self.relay_prompts.reclaim,
            swap=SwapSpace(self.runner.kv_cache, swap_bytes) if swap_bytes else None,
        )
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[Sequence] = []  # fused requests whose first token is not reported yet
        self._held: list[RequestOutput] = []  # outputs of steps run while a start waited for room (when_room)
        self._inflight: DecodeInFlight | None = None  # a decode step launched, its tokens not read (step)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.sessions: SessionStore | None = None
        self._session_turns: dict[str, SessionTurn] = {}
        # finished session turns whose last token's KV the next decode step computes before the
        # session is saved, so the next turn feeds only its new tokens (see _emit)
        self._closing: dict[str, tuple[Sequence, SessionTurn]] = {}
        self._snapshot_stream: torch.cuda.Stream | None = None
        self._load_stream: torch.cuda.Stream | None = None
        self._write_stream: torch.cuda.Stream | None = None  # a turn's history written into its pages
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.checkpoint is not None:
            self.eos_token_ids |= _generation_eos_ids(self.checkpoint.path)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    def _check_host_memory(self) -> None:
        """On the CPU, refuse a model whose weights and KV cache exceed the machine's memory:
        allocating them would get the process killed by the kernel's OOM killer, without a word (a 7B
        model in float32 is 28 GiB). Measured against the total, not what is free now: a process's own
        freed memory, which it reuses, does not count as free, so a busy process would be refused
        models it can hold. CUDA reports its own out-of-memory error."""
        if self.device.type != "cpu":
            return
        total = _host_memory()
        elem = torch.empty((), dtype=self.dtype).element_size()
        need = self.model_config.num_params() * elem + self._kv_budget()
        if total is not None and need > total:
            raise ModelError(f"{self.model_name} in {str(self.dtype).removeprefix('torch.')} needs about "
                             f"{need / 2**30:.1f} GiB of memory for its weights and KV cache; this machine has "
                             f"{total / 2**30:.1f} GiB (use a GPU, a smaller model or --dtype bfloat16)")

    def _kv_budget(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.device.type == "cuda":  # weights are loaded by now; leave room for activations
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_utilization * 0.8)
        return 1 << 30

    @property
    def fingerprint(self) -> str:
        """Identity of the weights, for keys of stored KV."""
        return self.checkpoint.fingerprint if self.checkpoint is not None else f"random-{id(self)}"

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], start: bool = False) -> list[int]:
        """Token ids of ``prompt`` (checked ids pass through). ``start``: the text begins a sequence and
        gets the tokenizer's special tokens (a Llama tokenizer's BOS), as transformers and vLLM encode a
        prompt: the model was trained with it and answers otherwise without; a continuation gets none."""
        if isinstance(prompt, list):
            ids = prompt
        else:
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=start)
        if not ids:
            raise RequestError("empty prompt")
        # C-speed checks (a per-token generator costs ~2 ms per 28K-token history on every turn)
        if not set(map(type, ids)) <= {int, bool} or min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise RequestError("prompt holds token ids outside the model's vocabulary")
        return ids

    def chat_token_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> list[int]:
        """Token ids of a chat, rendered with the checkpoint's own chat template (``render_chat``;
        ``continue_final_message``: the last message left open, for the model to continue)."""
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer")
        if not messages:
            raise RequestError("empty chat")
        ids = render_chat(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        system: int | None = None,
        relay: bool = True,
    ) -> str:
        """Queue a request. With ``system`` (an id from ``register_system``) ``prompt`` continues
        that system prompt: by relay attention (``relay``, where the model allows it) or, without
        relay, as one sequence whose pages start with the system prompt's blocks, shared (their
        full blocks; a partial last block is recomputed into the request's own page)."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt, start=system is None)
        offset, shared, head, reserved, computed = 0, [], [], 0, False
        if system is not None:
            sp = self.systems.get(system)
            if relay and self.supports_relay:
                offset, reserved, computed = sp.num_tokens, len(sp.block_table), sp.fresh
            else:
                full = sp.num_tokens // self.blocks.block_size
                shared = self.blocks.share(sp.block_table[:full])
                head = sp.token_ids
                system = None
        try:
            params, rid = self._admit(offset + len(head) + len(ids), params, request_id)
        except RequestError:
            self.blocks.release(shared)
            raise
        seq = Sequence(rid, head + ids, params, block_table=shared, system=system, position_offset=offset,
                       num_computed_tokens=len(shared) * self.blocks.block_size, system_computed=computed)
        try:
            self.scheduler.add(seq, reserved)
        except RequestError:
            self.blocks.release(seq.block_table)
            raise
        self._track(seq)
        return rid

    def _track(self, seq: Sequence) -> None:
        """Follow an added request: its outputs, its detokenizer; a system prompt registered for it is
        from now on a cached one for the requests after it."""
        self._seqs[seq.request_id] = seq
        if self.tokenizer is not None:
            self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        if seq.system_computed:
            self.systems.get(seq.system).fresh = False

    def _admit(
        self, prompt_tokens: int, params: SamplingParams, request_id: str | None
    ) -> tuple[SamplingParams, str]:
        """Check a new request against the context and the live ids: ``max_tokens`` is cut to what
        the context leaves; a prompt that fills it, or an id in use, is refused."""
        if prompt_tokens >= self.max_model_len:
            raise RequestError(f"prompt of {prompt_tokens} tokens exceeds the context of {self.max_model_len}")
        if prompt_tokens + params.max_tokens > self.max_model_len:
            params = SamplingParams(**{**params.__dict__, "max_tokens": self.max_model_len - prompt_tokens})
        if not request_id:  # numbered past the ids callers chose themselves
            request_id = next(rid for rid in (f"req-{n}" for n in self._ids) if rid not in self._seqs)
        elif request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        return params, request_id

    # ---- system prompts (relay attention) ------------------------------------------------------

    @property
    def supports_relay(self) -> bool:
        """Relay splits attention at the system prompt's end; a sliding window would cut across it."""
        return self.model_config.sliding_window is None

    def register_system(self, prompt: str | list[int]) -> int:
        """Compute a system prompt's KV once into blocks of its own and return its id; registering
        the same tokens again returns the same id. Requests pass the id to ``add_request``."""
        ids = self.tokenize(prompt, start=True)
        known = self.systems.find(ids)
        if known is not None:
            self.relay_prompts.hand_over(known)  # the application's now: the on-demand registry must not release it
            return known
        if len(ids) >= self.max_model_len:
            raise RequestError(f"system prompt of {len(ids)} tokens leaves no room in the context of "
                               f"{self.max_model_len}")
        slot = self.systems.free_slot()
        table: list[int] = []
        self.blocks.grow(table, len(ids))
        try:
            self.runner.forward_fresh([ids], [table])
            self.systems.add(slot, ids, table)
        except BaseException:
            self.blocks.release(table)
            raise
        self.runner.capture_relay_graphs()
        return slot

    def release_system(self, system_id: int) -> None:
        """Free a system prompt's blocks; refused while an unfinished request follows it."""
        sp = self.systems.get(system_id)
        if self.system_busy(system_id):
            raise RequestError(f"system prompt {system_id} still has unfinished requests")
        self.systems.remove(sp.slot)
        self.blocks.release(sp.block_table)
        if self.tree is not None:
            self.tree.drop_system(sp.slot)

    def system_busy(self, system_id: int) -> bool:
        """Whether an unfinished request follows this system prompt."""
        return any(s.system == system_id for s in self._seqs.values() if not s.finished)

    def abort(self, request_id: str) -> None:
        self._session_turns.pop(request_id, None)  # an unfinished turn is not saved
        if request_id in self._closing:  # a finished one is, without its last token
            self._close_turn(request_id)
        seq = self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._held)

    def when_room(self, start: Callable[[], T]) -> T:
        """``start()`` (which adds a request), waiting for room in the KV cache as a scheduled request
        does. A start that takes its blocks at once (a fused prefill, a session turn reusing stored
        KV: ``_add_prefilled``) raises ``CacheFullError`` when the cache is full; here it is retried
        after each step while running requests will free blocks, so several turns submitted together
        all run instead of the later ones failing. It fails only when nothing is left to free any.
        It is tried again only once a step has freed blocks: a start may retrieve, look a session up
        and open stored KV, which would be wasted at every step while the cache stays full.
        For callers that step the engine themselves (``LLM``): the outputs of the steps run meanwhile
        come with the next ``step``. The async front end defers such starts instead of blocking."""
        while True:
            try:
                return start()
            except CacheFullError:
                if not self.scheduler.has_work:
                    raise
                full = self.room_mark()
                while self.scheduler.has_work and not self.room_since(full):
                    self._held = self.step()  # a step hands the held outputs on first: none is lost

    def room_mark(self) -> RoomMark:
        """What a start that found no room saw (for ``room_since``)."""
        return RoomMark(self.blocks.num_free, self.scheduler.preempted_waiting)

    def room_since(self, mark: RoomMark) -> bool:
        """Whether a start refused at ``mark`` may find room now: blocks were freed since, or the
        preempted requests it had to let go first have all resumed (``_add_prefilled``), which takes
        blocks, so waiting for more free blocks than at the refusal held it back for no reason."""
        return self.blocks.num_free > mark.free or (mark.behind_preempted and not self.scheduler.preempted_waiting)

    def compute_kv(
        self, token_lists: list[list[int]], context: Iterable[int] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each token list's K (before RoPE, so it can be rotated to any offset later) and V,
        [layers, tokens, kv_heads, head_dim], computed as if the list started a sequence, or
        followed the ``context`` tokens (whose own KV is dropped): a chunk computed after the text
        that precedes it in every prompt is closer to what full prefill gives it there.

        Lists are batched up to ``max_num_batched_tokens`` tokens per forward pass.
        """
        context = list(context)
        results: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self._fresh_groups([context + list(toks) for toks in token_lists]):
            with self.borrowed_blocks(group) as tables:
                results.extend(self.runner.capture_kv(group, tables, skip=len(context)))
        return results

    @torch.inference_mode()
    def score(self, token_ids: list[int], last_n: int | None = None) -> torch.Tensor:
        """Logits (float32, [n, vocab]) the model gives after each of the last ``last_n`` tokens
        (all by default) of ``token_ids`` run as one fresh sequence: teacher forcing, for evals."""
        (ids,) = self._fresh_groups([token_ids])[0]
        with self.borrowed_blocks([ids]) as tables:
            hidden = self.runner.forward_fresh([ids], tables)
        n = len(ids) if last_n is None else last_n
        return self.runner.model.compute_logits(hidden[-n:])

    @torch.inference_mode()
    def score_fused(
        self,
        segments: list[Segment],
        continuation: list[int],
        mode: FusionMode | str,
        policy: SelectionPolicy | None = None,
    ) -> tuple[torch.Tensor, FusionStats]:
        """Logits after the fused prompt and after each ``continuation`` token, teacher-forced on
        top of the fused cache: [1 + len(continuation), vocab]. For quality evals of fusion modes."""
        prompt = [t for seg in segments for t in seg.token_ids]
        if continuation:
            self.tokenize(continuation)
        (ids,) = self._fresh_groups([prompt + continuation])[0]
        with self.borrowed_blocks([ids]) as (table,):
            first, stats = self.runner.fused_prefill(table, segments, mode, policy or SelectionPolicy())
            if not continuation:
                return first[None], stats
            rest = self.runner.forward_continuation(continuation, len(prompt), table)
        return torch.cat([first[None], self.runner.model.compute_logits(rest)]), stats

    def _fresh_groups(self, token_lists: list[list[int]]) -> list[list[list[int]]]:
        """Validate the lists and pack them into forward passes of bounded size."""
        for toks in token_lists:
            self.tokenize(toks)
            if len(toks) > self.max_model_len:
                raise RequestError(f"sequence of {len(toks)} tokens exceeds the context of {self.max_model_len}")
        budget = max(self.config.max_num_batched_tokens, max(map(len, token_lists), default=0))
        groups: list[list[list[int]]] = []
        size = budget + 1
        for toks in token_lists:
            if size + len(toks) > budget:
                groups.append([])
                size = 0
            groups[-1].append(toks)
            size += len(toks)
        return groups

    @contextmanager
    def borrowed_blocks(self, token_lists: list[list[int]]) -> Iterator[list[list[int]]]:
        """Cache blocks for a side computation, returned however it ends."""
        tables: list[list[int]] = [[] for _ in token_lists]
        try:
            for table, toks in zip(tables, token_lists):
                self.blocks.grow(table, len(toks))
            yield tables
        finally:
            for table in tables:
                self.blocks.release(table)

    def add_fused_request(
        self,
        segments: list[Segment],
        params: SamplingParams | None = None,
        mode: FusionMode | str = FusionMode.FUSE,
        policy: SelectionPolicy | None = None,
        request_id: str | None = None,
        system: int | None = None,
    ) -> tuple[str, FusionStats]:
        """Prefill a prompt made of ``segments`` with cache fusion, then decode it like any request.

        The fused prefill runs now (its KV lands in the request's cache pages and its first token is
        sampled); the first output comes with the next ``step``. With ``system`` (an id from
        ``register_system``) the prompt continues that system prompt through relay attention, in
        the fused prefill and in decode.
        """
        params = params or SamplingParams()
        ids = self.tokenize([t for seg in segments for t in seg.token_ids])
        offset = 0
        if system is not None:
            if not self.supports_relay:
                raise RequestError("relay attention needs a model without a sliding window")
            offset = self.systems.get(system).num_tokens
        params, rid = self._admit(offset + len(ids), params, request_id)
        policy = policy or SelectionPolicy()
        return self._add_prefilled(
            ids, params, rid, lambda table: self.runner.fused_prefill(table, segments, mode, policy, system),
            system,
        )

    def _add_prefilled(
        self, ids: list[int], params: SamplingParams, rid: str,
        prefill: Callable[[list[int]], tuple[torch.Tensor, FusionStats]], system: int | None = None,
    ) -> tuple[str, FusionStats]:
        """Register a request whose whole prompt ``prefill`` puts in its cache pages now (returning
        the last token's logits): its first token is sampled here and reported by the next step.
        ``system``: the registered system prompt the prompt follows (relay). While requests preempted
        for want of blocks wait, it does not start (``CacheFullError``, as when the cache is full):
        taking the blocks they wait for kept them waiting while later starts came and went, each
        preempted in turn, and a swapped one held its host copy all that time."""
        sp = self.systems.get(system) if system is not None else None
        self.scheduler.check_fits(len(ids), len(sp.block_table) if sp is not None else 0)
        if self.scheduler.preempted_waiting:
            raise CacheFullError("requests preempted for want of KV cache blocks resume first")
        # fused or session KV is not the exact KV of these tokens, so its blocks never join the prefix tree
        seq = Sequence(rid, ids, params, cacheable=False, tree_open=False, system=system,
                       position_offset=sp.num_tokens if sp is not None else 0,
                       system_computed=sp is not None and sp.fresh)
        self.relay_prompts.reclaim(self.blocks.blocks_needed([], len(ids)), keep=system)
        self.blocks.grow(seq.block_table, len(ids))  # CacheFullError if there is still no room
        try:
            logits, stats = prefill(seq.block_table)
        except BaseException:
            self.blocks.release(seq.block_table)
            raise
        seq.num_computed_tokens = len(ids)
        seq.output_token_ids.append(sample(logits[None], [params], [seq.generator], default=self.runner.rng)[0])
        seq.first_token_time = time.perf_counter()
        seq.status = Status.RUNNING
        self.scheduler.running.append(seq)
        self._track(seq)
        self._pending.append(seq)
        return rid, stats

    # ---- sessions -------------------------------------------------------------------------

    def enable_sessions(self, store: SessionStore) -> None:
        """Keep each session's KV across turns in ``store`` (see ``engine.sessions``)."""
        self.sessions = store
        if self.device.type == "cuda":  # saving and loading copy beside the compute stream
            self._snapshot_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)
            self._write_stream = torch.cuda.Stream(self.device)

    def begin_session_turn(
        self, session_id: str, conversation: list[int], reserve: int, new_tokens: int | None = None,
        keep_first: int = 4,
    ) -> SessionTurn:
        """Plan a turn of ``session_id`` whose logical tokens are ``conversation`` (the whole
        conversation; its last ``new_tokens`` are this turn's and are never cut on overflow)."""
        if self.sessions is None:
            raise RequestError("sessions are not enabled on this engine (enable_sessions)")
        self.tokenize(conversation)
        self.settle_session(session_id)
        return begin_turn(self.sessions, session_id, conversation, self.max_model_len, reserve,
                          len(conversation) if new_tokens is None else new_tokens, keep_first)

    def preload_session_turn(self, turn: SessionTurn, layers: int | None = None) -> None:
        """Fill the read buffer: start copying the first ``layers`` of the turn's history (None: all)
        to the GPU now, while an earlier job runs or the turn waits in the queue, so its start only
        streams the rest (``read_buffer_layers`` sizes ``layers`` for a copy fully hidden by then).
        A no-op off CUDA and for sessions on disk."""
        if turn.source is not None and self._load_stream is not None:
            turn.source.stage(self.device, self._load_stream, layers)

    def add_session_request(
        self, session_id: str, conversation: list[int], params: SamplingParams | None = None,
        new_tokens: int | None = None, keep_first: int = 4, request_id: str | None = None,
    ) -> str:
        """A request that reuses the session's stored KV (only the new tokens are prefilled, while
        the history loads layer by layer) and saves the session's KV when it finishes."""
        params = params or SamplingParams()
        turn = self.begin_session_turn(session_id, conversation, params.max_tokens, new_tokens, keep_first)
        return self.start_session_turn(turn, params, request_id=request_id)

    def start_session_turn(
        self, turn: SessionTurn, params: SamplingParams, tail: list[Segment] | None = None,
        mode: FusionMode | str = FusionMode.REUSE, policy: SelectionPolicy | None = None,
        request_id: str | None = None,
    ) -> str:
        """Run a planned turn (``tail``: the prompt's own segments, e.g. a RAG prompt with stored
        chunks, after the history). A session whose KV fails its checksum is dropped and the turn
        recomputed (with a note)."""
        segments = turn.segments(tail)
        # the history left after the read buffer: the layer-wise path queues its copies as its forward
        # goes, STAGE_AHEAD layers past the read buffer's (the copy engine starts on them at once)
        preloaded = turn.source.staged_layers if turn.source is not None else 0
        self.preload_session_turn(turn, preloaded + STAGE_AHEAD if tail is None else None)
        try:
            if tail is None and turn.source is not None and turn.source.staged:
                rid, turn.fusion = self._add_after_history(turn, params, request_id, preloaded)
            elif tail is not None or any(s.kv is not None for s in segments):
                rid, turn.fusion = self.add_fused_request(segments, params, mode, policy, request_id)
            else:
                rid = self.add_request([t for s in segments for t in s.token_ids], params, request_id)
        except SessionCorruptError as exc:
            turn.close()
            assert self.sessions is not None
            self.sessions.drop(turn.session_id, exc.why)
            retry = begin_turn(self.sessions, turn.session_id, turn.plan.conversation, self.max_model_len,
                               params.max_tokens, turn.new_tokens, turn.keep_first, use_stored=False)
            retry.notes = [*turn.notes, f"{exc}: history recomputed"]
            return self.start_session_turn(retry, params, tail, mode, policy, request_id)
        finally:
            turn.close()
        self._session_turns[rid] = turn
        return rid

    def turn_running(self, session_id: str) -> bool:
        """Whether a turn of ``session_id`` is running (admitted, its answer not finished)."""
        return any(t.session_id == session_id for t in self._session_turns.values())

    def session_turn(self, request_id: str) -> SessionTurn:
        """The turn that ``start_session_turn`` started as ``request_id``, with its notes and fusion
        stats: not the one it was given where the stored history failed its checksum (the retry
        over the recomputed history)."""
        return self._session_turns[request_id]

    def _add_after_history(
        self, turn: SessionTurn, params: SamplingParams, request_id: str | None, preloaded: int
    ) -> tuple[str, FusionStats]:
        """A turn whose staged history is a cached prefix (``HistoryWriter``): written into the cache
        layer by layer between the layers' graph replays, beside them (from the read buffer where it
        was copied ahead, else as its copy lands); only the new tokens run through the model. The
        copies of the layers after the ``preloaded`` ones are queued ``STAGE_AHEAD`` ahead as the
        forward's host loop goes (the copy engine then never waits for that loop)."""
        ids = turn.plan.token_ids  # checked when the turn was planned (begin_session_turn)
        params, rid = self._admit(len(ids), params, request_id)
        assert turn.source is not None and self.runner.kv_cache is not None
        n_hist = turn.reused

        def prefill(table: list[int]) -> tuple[torch.Tensor, FusionStats]:
            t = time.perf_counter()
            assert self._write_stream is not None
            writer = HistoryWriter(turn.source, self.runner.kv_cache, table, self.runner.model.model.rotary,
                                   self._write_stream, lambda n: self.preload_session_turn(turn, n + preloaded))
            with torch.inference_mode():
                hidden = self.runner.forward_continuation(ids[n_hist:], n_hist, table, writer, keep=False)
                logits = self.runner.model.compute_logits(hidden[-1:])[0]
            torch.cuda.synchronize(self.device)
            total = time.perf_counter() - t
            load_s, stall_s = writer.timings()
            return logits, FusionStats(
                mode=FusionMode.REUSE.value, recompute_ratio=0.0, prompt_tokens=len(ids), stored_tokens=n_hist,
                reused_tokens=n_hist, recomputed_tokens=0, computed_tokens=len(ids) - n_hist, load_s=load_s,
                load_wait_s=stall_s, compute_s=total - stall_s, total_s=total, tiers=[turn.source.tier],
            )

        return self._add_prefilled(ids, params, rid, prefill)

    def _save_session(self, seq: Sequence, turn: SessionTurn) -> None:
        """Snapshot the finished turn's KV (history plus answer) and hand it to the session store."""
        assert self.sessions is not None and self.runner.kv_cache is not None
        n = seq.num_computed_tokens
        conversation = turn.plan.conversation + seq.output_token_ids
        ranges = extend(turn.plan.ranges, len(turn.plan.conversation) + n - len(seq.prompt_token_ids))
        swap = self.scheduler.swap
        if swap is not None and self.scheduler.swapped(seq):  # preempted: its KV is in host memory
            k, v = swap.gather(seq.request_id, seq.block_table, n)
        else:
            self.scheduler.settle(seq)  # swapped back in, the copy maybe still on its way
            k, v = self.runner.kv_cache.gather(seq.block_table, n)
        snap = take_snapshot(k, v, self.runner.model.model.rotary, self._snapshot_stream)
        queue = [t.session_id for rid, t in self._session_turns.items() if rid != seq.request_id]
        self.sessions.save(turn.session_id, conversation, ranges, snap, queue)

    def _close_turn(self, request_id: str) -> None:
        """Save a finished turn's session with whatever KV it holds (after its closing step, every
        token; before it, all but the last; swapped out, from its host copy) and free it. A turn
        preempted for recompute while closing holds at most a shared prefix, less than the history
        its session already has: the session keeps the previous turn's KV."""
        seq, turn = self._closing.pop(request_id)
        if seq.num_computed_tokens >= len(seq.prompt_token_ids):
            self._save_session(seq, turn)
        self.scheduler.finish(seq, seq.finish_reason or "stop")

    def settle_session(self, session_id: str) -> None:
        """Save the session's finished turn now if it still waits for its closing step (its next
        turn is starting, or the session is listed or deleted): the store never misses a turn."""
        for rid, (_seq, turn) in list(self._closing.items()):
            if turn.session_id == session_id:
                self._close_turn(rid)

    def close_turns(self) -> None:
        """Run the closing step of finished session turns now, when nothing else would share it
        (a caller that stops stepping once its requests finish, like ``LLM.chat``); with other
        requests running it rides their next decode step instead."""
        while self._closing and not self.scheduler.waiting and all(
            s.request_id in self._closing for s in self.scheduler.running
        ):
            self.step()

    # ---- stepping -------------------------------------------------------------------------

    def step(self, hook: KVHook | None = None) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that got a new token.

        Greedy decode batches on CUDA graphs overlap (``EngineConfig.overlap_decode``): a step is
        launched, then the step after it (same sequences, its input tokens taken on the device), and
        only then are the first one's tokens read and reported, so the host's work for each step
        runs while the GPU computes the next. A sequence that stops at a step had its row in the
        step after it computed in vain; that row is dropped."""
        outputs, self._held = self._held, []
        outputs += [self._emit(seq, [seq.output_token_ids[-1]], self._finish_reason(seq, seq.output_token_ids[-1]))
                    for seq in self._pending if not seq.finished]
        self._pending.clear()
        if self._inflight is not None:
            if any(not s.finished for s in self._inflight.seqs):
                return outputs + self._land(hook)
            self._inflight.tokens()  # only stopped sequences' rows: wait for its copy, drop it
            self._inflight = None
        batch = self.scheduler.schedule()
        for rid, (seq, _) in list(self._closing.items()):
            # preempted before its closing step: saved now from its host copy (all but the last
            # token), rather than swapped back in, taking blocks, to compute one token's KV
            if self.scheduler.swapped(seq):
                self._close_turn(rid)
        outputs += [self._emit_starved(seq) for seq in self.scheduler.take_starved()]
        if batch is None:
            return outputs
        plan = None
        if self.tree is not None and not batch.is_prefill:
            mc = self.model_config
            plan = self.tree.decode_plan(batch.seqs, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.device)
        systems = self._overlap_systems(batch) if plan is None and hook is None else None
        if systems is not None:
            self._inflight = self.runner.launch_decode(batch.seqs, systems)
            return outputs + self._land(hook)
        return outputs + self._take(batch.seqs, self.runner.run(batch, hook, plan))

    def _overlap_systems(self, batch: ScheduledBatch) -> list[int] | None:
        """The batch's system prompts if it can be launched without waiting for its tokens: a decode
        batch the graphs take from host values, of greedy requests that are not session turns (a
        turn's end saves its KV, which must not wait on a step in flight)."""
        if not self.config.overlap_decode or any(
            not s.params.greedy or s.request_id in self._session_turns or s.request_id in self._closing
            for s in batch.seqs
        ):
            return None
        return self.runner.host_decode_systems(batch)

    def _land(self, hook: KVHook | None) -> list[RequestOutput]:
        """Report the step in flight, having launched the next one first where the scheduler would
        make that step a decode of the same sequences: they are all that runs, none is about to reach
        ``max_tokens`` while requests wait for a place (those would be admitted next), and each gets
        a block for its next token. A stop token cannot be foreseen: there, the step after it runs
        before a waiting request is admitted (one step later than without overlap)."""
        done = self._inflight
        assert done is not None
        sched = self.scheduler
        self._inflight = None
        live = [i for i, s in enumerate(done.seqs) if not s.finished]
        rows = [i for i in live if len(done.seqs[i].output_token_ids) + 1 < done.seqs[i].params.max_tokens]
        admits = sched.waiting and (len(sched.running) < sched.max_num_seqs or len(rows) < len(live))
        if (hook is None and rows and not admits and len(sched.running) == len(live)
                and all(a is done.seqs[i] for a, i in zip(sched.running, live))):
            seqs = [done.seqs[i] for i in rows]
            if sched.grow_ahead(seqs):
                self._inflight = self.runner.launch_decode(seqs, [done.systems[i] for i in rows], after=done)
        return self._take(done.seqs, done.tokens())

    def _take(self, seqs: list[Sequence], tokens: list[int | None]) -> list[RequestOutput]:
        """Append each sequence's new token and report it (None: no token, a prompt still being
        prefilled); sequences that stopped meanwhile (a row computed ahead, or aborted) are skipped."""
        outputs = []
        now = time.perf_counter()
        for seq, tok in zip(seqs, tokens):
            if seq.finished:
                continue
            if seq.request_id in self._closing:
                if not seq.num_uncomputed:  # its last token's KV is in: save, free, sample nothing
                    self._close_turn(seq.request_id)
                continue
            if tok is None:
                continue
            seq.output_token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, tok)
            outputs.append(self._emit(seq, [tok], reason))
        return outputs

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def _emit_starved(self, seq: Sequence) -> RequestOutput:
        """Report a request the scheduler finished because the cache can never hold it (``length``,
        with the tokens it has). A session turn among them is not saved, as if aborted: its KV is
        gone with its blocks, and the session keeps its previous turn."""
        self._session_turns.pop(seq.request_id, None)
        return self._emit(seq, [], seq.finish_reason)

    def _emit(self, seq: Sequence, new: list[int], reason: str | None) -> RequestOutput:
        detok = self._detok.get(seq.request_id)
        shown = seq.output_token_ids
        if reason == "stop" and shown and shown[-1] in self.eos_token_ids | set(seq.params.stop_token_ids):
            shown = shown[:-1]
        delta = ""
        if detok is not None:
            delta = detok.update(shown, final=reason is not None)
            if detok.stopped and reason is None:
                reason = "stop"
        turn = self._session_turns.get(seq.request_id)
        if reason is not None:
            seq.finish_time = time.perf_counter()
            if turn is not None:
                del self._session_turns[seq.request_id]
            if turn is not None and seq.num_uncomputed == 1 and seq.status is Status.RUNNING:
                # the answer's last token has no KV yet: the next decode step (batched with the
                # running ones) computes it, then the session is saved whole and its next turn
                # prefills only its new tokens
                seq.finish_reason = reason
                self._closing[seq.request_id] = (seq, turn)
            else:
                if turn is not None:
                    self._save_session(seq, turn)
                self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        end = seq.finish_time or time.perf_counter()
        return RequestOutput(
            request_id=seq.request_id,
            prompt_tokens=len(seq.prompt_token_ids),
            text=detok.text if detok is not None else "",
            token_ids=list(seq.output_token_ids),
            delta_text=delta,
            delta_token_ids=new,
            finished=reason is not None,
            finish_reason=reason,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            total_s=end - seq.arrival_time,
            metrics={"preemptions": seq.num_preemptions, "swapped": seq.num_swaps,
                     "cached_tokens": seq.num_cached_tokens,
                     "relay_system_tokens": seq.position_offset if seq.system is not None else 0,
                     "relay_system_computed": seq.position_offset if seq.system_computed else 0,
                     **(turn.stats(len(seq.prompt_token_ids)) if turn is not None else {})},
        )


def _host_memory() -> int | None:
    """The machine's memory in bytes (``MemTotal``); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _generation_eos_ids(path: Any) -> set[int]:
    """The end-of-sequence ids of the checkpoint's ``generation_config.json`` (none if it has none).

    Chat models often list more ends there than ``config.json`` does: Llama 3 Instruct's config.json
    names only ``<|end_of_text|>`` while a turn ends with ``<|eot_id|>``, which only
    generation_config.json lists. transformers' ``generate`` stops at every id of that list; without
    it an answer runs past its end of turn until ``max_tokens``."""
    import json
    from pathlib import Path

    file = Path(path) / "generation_config.json"
    try:
        eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # missing, unreadable or not a JSON object: nothing to add
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    return {t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0}


def _load_tokenizer(path: Any) -> Any:
    """The checkpoint's tokenizer, or None for a weights-only directory (token-id prompts only)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        log.warning("%s has no tokenizer: prompts must be token ids", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))
