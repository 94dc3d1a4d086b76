"""ragfuse's tiered KV store as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded without a patch:

    kv_transfer_config={"kv_connector": "RagfuseKVConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "ragfuse.connectors.vllm.connector",
                        "kv_connector_extra_config": {"store_dir": "...", ...}}

Scheduler side: every prompt is cut into spans (``plan.py``); the longest run of stored spans from
the start is reported as matched tokens, including stored RAG chunks that are *not* a prefix of any
earlier prompt (the caller marks them in ``kv_transfer_params``). Every stored chunk is counted as a
hit even when it cannot be loaded because something before it is missing, and the counts come back
in the request's output ``kv_transfer_params["ragfuse"]``.

Worker side: loads run on a thread layer by layer (disk reads are verified per layer) while vLLM
computes earlier layers; ``wait_for_layer_load`` blocks only for the layer about to run. Stored K is
before RoPE, so the loader rotates it to wherever the span sits in this prompt: that is what lets a
chunk be reused at any position. Saves copy the request's new KV out of the paged cache as each
layer finishes, and a background thread un-rotates K and writes the entries.

Mode for non-prefix chunks: **full reuse**. CacheBlend's selective recompute needs the model's
per-layer hidden states so it can recompute the tokens whose KV deviates most; a connector only sees
the paged KV cache around each attention call, never the hidden states, so it cannot choose or
recompute tokens. The chunk's stored KV (computed alone) is used as is; the tokens after the last
loaded span (the question) are computed by vLLM over it. Context spans (system prompt, session
history) are loaded exactly: with ``kv_dtype=float32`` a saved-then-loaded span is bit-identical in
vLLM's cache (bf16 or float32), so session reuse does not change greedy output.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from ragfuse.engine.config import rope_config
from ragfuse.engine.errors import ModelError, RagfuseError
from ragfuse.engine.kvstore import CorruptEntryError, StoredKV, open_source
from ragfuse.kernels.rope import apply_rope_ref, cos_sin_table, inv_frequencies

from .paged import PagedLayout, slots_for
from .plan import CHUNK, CONTEXT, Span, normalise_chunks, plan_spans
from .settings import ConnectorSettings, PendingSaves, SpanState, release_store, shared_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

MODE = "full-reuse"  # non-prefix chunks: stored KV re-positioned, no selective recompute (see module doc)
PARAMS_KEY = "ragfuse"


class StaleConnectorError(RagfuseError, RuntimeError):
    """An engine's worker was handed the ragfuse connector of another engine of this process, one
    never shut down (see ``RagfuseKVConnector.register_kv_caches``)."""


@dataclass
class LoadItem:
    key: str
    kind: str
    span_start: int
    load_start: int
    load_end: int


@dataclass
class LoadOp:
    req_id: str
    block_ids: list[int]
    items: list[LoadItem]


@dataclass
class SaveOp:
    req_id: str
    block_ids: list[int]
    spans: list[Span]


@dataclass
class RagfuseConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class _RequestState:
    """What the scheduler side knows about one request between lookup and finish."""

    spans: list[Span]
    num_prompt: int
    store_as_chunk: bool
    chunk_spans: int
    chunk_hits: int = 0
    matched: int = 0
    chunk_hits_loaded: int = 0
    load_from: int = 0
    load_to: int = 0
    loaded: int = 0
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)
    saved_spans: int = 0
    save_done: bool = False
    error: str | None = None  # why the request's ragfuse parameters were ignored, for its report


def _request_chunks(transfer_params: object, num_tokens: int) -> tuple[bool, list[tuple[int, int]]]:
    """``(store_as_chunk, chunk spans)`` from a request's ``kv_transfer_params``, which clients send
    as JSON: anything malformed raises ``ValueError`` with the reason."""
    if transfer_params is None:
        return False, []
    if not isinstance(transfer_params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(transfer_params).__name__}")
    params = transfer_params.get(PARAMS_KEY)
    if params is None:
        return False, []
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object, got {type(params).__name__}")
    store_as_chunk = params.get("store_as_chunk", False)
    if not isinstance(store_as_chunk, bool):
        raise ValueError(f"store_as_chunk must be true or false, got {store_as_chunk!r}")
    if store_as_chunk:
        return True, [(0, num_tokens)] if num_tokens else []
    return False, normalise_chunks(params.get("chunks"), num_tokens)


class RagfuseKVConnector(KVConnectorBase_V1):
    """vLLM v1 connector over ragfuse's ``TieredKVStore`` (see module doc for the design)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            # each rank holds a slice of heads/layers; entries would need per-shard keys (not yet)
            raise ValueError("ragfuse connector: tensor/pipeline parallelism is not supported yet (TP=PP=1 only)")
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        self.pending = PendingSaves(self.settings.store_dir)
        self.block_size = vllm_config.cache_config.block_size
        self._states: dict[str, _RequestState] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layout: PagedLayout | None = None
        self._layer_ready: dict[str, threading.Event] = {}
        self._loader: threading.Thread | None = None
        self._failed_blocks: set[int] = set()
        self._failed_from: dict[str, int] = {}  # request -> first token not loaded (reported failed)
        self._save_buffers: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragfuse-save")
        if role == KVConnectorRole.WORKER:
            self._init_rope(vllm_config)
        # taken last: a refused configuration above must not leave a user on the shared store
        self.store = shared_store(self.settings)
        self._store_released = False
        logger.info(
            "ragfuse connector (%s side): store %s, kv_dtype %s, spans of %d tokens; non-prefix chunks "
            "run in %s mode (re-positioned stored KV, no selective recompute); prefix/session spans are exact",
            role.name.lower(), self.settings.store_dir, self.settings.kv_dtype_name, self.settings.span_tokens, MODE,
        )

    # ------------------------------------------------------------------ scheduler side

    def _available(self, key: str) -> bool:
        return self.store.locate(key) is not None

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])
            error = None
            try:
                store_as_chunk, chunks = _request_chunks(request.kv_transfer_params, len(tokens))
            except ValueError as exc:
                # raised here it would stop vLLM's engine for every request; the prompt is served exactly
                # instead (no chunk reuse) and the report says why
                error = f"ragfuse parameters ignored: {exc}"
                logger.warning("ragfuse connector: request %s: %s", request.request_id, error)
                store_as_chunk, chunks = False, []
            spans = plan_spans(tokens, chunks, self.settings.fingerprint, self.settings.kv_dtype,
                               self.settings.span_tokens)
            state = _RequestState(spans=spans, num_prompt=len(tokens), store_as_chunk=store_as_chunk,
                                  chunk_spans=0 if store_as_chunk else len(chunks), error=error)
            self._states[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens``: the run of stored spans from position 0.

        The last prompt token is always left to vLLM (it must produce logits). Stored chunks after
        the first gap are still counted as hits (``chunk_hits``) so hit rates are honest.
        """
        state = self._state(request)
        matched, contiguous = 0, True
        state.chunk_hits = 0
        for span in state.spans:
            found = self.pending.lookup(span.key, self._available)
            if found is SpanState.SAVING and (contiguous or span.kind == CHUNK):
                return None, False  # its save is in flight: ask again next step rather than miss it
            available = found is SpanState.STORED
            if span.kind == CHUNK and not state.store_as_chunk:
                state.chunk_hits += available
            if available and contiguous:
                matched = span.end
            else:
                contiguous = False
        # Whole blocks only, like vLLM's own prefix cache: the rest of the prompt then runs through
        # the same attention path as after a local prefix hit (a lone last token takes the decode
        # path, whose bf16 rounding differs and can flip a greedy near-tie).
        state.matched = (min(matched, state.num_prompt - 1) // self.block_size) * self.block_size
        state.load_from = num_computed_tokens  # vLLM's own prefix-cache hit, if enabled: load after it
        state.loaded = max(0, state.matched - num_computed_tokens)
        self._count_loaded_chunks(state)
        return state.loaded, False

    def _count_loaded_chunks(self, state: _RequestState) -> None:
        """Chunk hits whose KV is reused, at least from their start (loaded, or before the load in
        vLLM's own prefix cache; every span before the reused end is stored). A chunk past the block
        rounding or past a failed load is recomputed in context: a hit, but not loaded."""
        reused_to = state.load_from + state.loaded
        state.chunk_hits_loaded = 0 if state.store_as_chunk else sum(
            1 for s in state.spans if s.kind == CHUNK and s.start < reused_to)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.loaded = num_external_tokens  # what vLLM granted (it may allocate less than was matched)
        self._count_loaded_chunks(state)
        if num_external_tokens > 0:
            state.load_to = state.load_from + num_external_tokens
            state.load_pending = True
            state.block_ids = list(blocks.get_block_ids()[0])

    def _load_op(self, req_id: str, state: _RequestState) -> LoadOp:
        items = [
            LoadItem(s.key, s.kind, s.start, max(s.start, state.load_from), min(s.end, state.load_to))
            for s in state.spans
            if s.start < state.load_to and s.end > state.load_from
        ]
        state.load_pending = False
        return LoadOp(req_id, list(state.block_ids), items)

    def _save_op(self, req_id: str, state: _RequestState) -> SaveOp | None:
        """Spans of the finished prefill to write back: missing context spans (and, for a chunk
        precompute request, the chunk itself). Chunks seen in context are never saved under the
        chunk key: their in-context KV is not the chunk's standalone KV."""
        state.save_done = True
        missing = [s for s in state.spans
                   if (s.kind != CHUNK or state.store_as_chunk) and not self._available(s.key)]
        # marked here, before any later lookup can miss them; the worker clears them. A span whose mark
        # cannot be written (disk full, read-only store) is not saved: a future miss, not a dead engine.
        spans = [s for s in missing if self.pending.mark(s.key)]
        if len(spans) < len(missing):
            logger.warning("ragfuse connector: cannot mark %d span(s) of request %s in %s (disk full or "
                           "read-only?); not saving them", len(missing) - len(spans), req_id, self.pending.dir)
        state.saved_spans = len(spans)
        return SaveOp(req_id, list(state.block_ids), spans) if spans else None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagfuseConnectorMetadata()
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load_pending:
                meta.loads.append(self._load_op(new.req_id, state))
            progress.append((new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_blocks is not None:
                state.block_ids = list(new_blocks[0])  # a resumed request gets its whole block table
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            if state.load_pending:
                meta.loads.append(self._load_op(req_id, state))
            progress.append((req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]))
        for req_id, computed in progress:
            state = self._states[req_id]
            if not state.save_done and computed >= state.num_prompt:
                op = self._save_op(req_id, state)
                if op is not None:
                    meta.saves.append(op)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks the workers could not load (a corrupt or vanished entry): vLLM recomputes them, so
        the report counts only the tokens before the first failed block as loaded. (The worker dropped
        the save of the failed step, whose KV was computed over blocks never loaded; the next request
        with this prefix saves those spans.)"""
        super().update_connector_output(connector_output)
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._states.values():
            if state.loaded <= 0:
                continue
            first = next((i for i, b in enumerate(state.block_ids) if b in invalid), None)
            if first is None or first * self.block_size >= state.load_from + state.loaded:
                continue
            state.loaded = max(0, first * self.block_size - state.load_from)
            self._count_loaded_chunks(state)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once (saves copy their data out during the step); the request's hit
        counts go back to the caller in the output's ``kv_transfer_params``."""
        state = self._states.pop(request.request_id, None)
        if state is None:
            return False, None
        report: dict[str, Any] = {
            "mode": MODE, "prompt_tokens": state.num_prompt, "loaded_tokens": state.loaded,
            "prefix_cached_tokens": state.load_from,
            "chunk_spans": state.chunk_spans, "chunk_hits": state.chunk_hits,
            "chunk_hits_loaded": state.chunk_hits_loaded, "saved_spans": state.saved_spans,
        }
        if state.error is not None:
            report["error"] = state.error
        return False, {PARAMS_KEY: report}

    # ------------------------------------------------------------------ worker side

    def _init_rope(self, vllm_config: VllmConfig) -> None:
        """The model's RoPE read by the engine's own reader (one reading of rope_scaling /
        rope_parameters for both), so stored K is moved with the frequencies vLLM rotated it with."""
        cfg = vllm_config.model_config.hf_config
        try:
            rope = rope_config(cfg.to_dict())
        except ModelError as e:
            raise ValueError(f"ragfuse connector: {e}; stored K cannot be moved") from e
        if float(getattr(cfg, "partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("ragfuse connector: partial rotary embeddings are not supported")
        head_dim = vllm_config.model_config.get_head_size()
        # vLLM's dynamic NTK uses one enlarged base at every length, not the engine's plain RoPE below
        # max_position_embeddings: the scaling type as read, which inv_frequencies refuses for dynamic
        inv = inv_frequencies(
            head_dim, rope.theta, rope.scaling_type, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_position, beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate,
        )
        self._cos, self._sin = cos_sin_table(inv, vllm_config.model_config.max_model_len + 1)
        self._num_kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
        self._head_dim = head_dim

    def _refuse_other_engine(self) -> None:
        """vLLM keeps the worker-side connector in one process-wide variable and creates it only when
        that is empty (``ensure_kv_transfer_initialized``): an engine in this process left running
        (never shut down) hands its connector to every later engine's worker, which would then load
        and save through the old engine's store and settings (another ``store_dir``, RoPE tables for
        another model) without a word. This worker registers its caches under its own engine's config
        (vLLM sets it as the current one around the call); another engine's id means exactly that."""
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        transfer = current.kv_transfer_config if current is not None else None
        if transfer is None or transfer.engine_id == self._kv_transfer_config.engine_id:
            return
        wanted = (transfer.kv_connector_extra_config or {}).get("store_dir", "?")
        raise StaleConnectorError(
            f"ragfuse connector: another vLLM engine in this process (store {self.settings.store_dir}) was never "
            f"shut down, and vLLM hands its worker connector to this new engine (store {wanted}), which would then "
            "save and load through the old store and settings; shut the old engine down first (VLLMBackend.close(); "
            "for a bare vllm.LLM, llm.llm_engine.engine_core.shutdown(); if it is out of reach, "
            "vllm.distributed.kv_transfer.ensure_kv_transfer_shutdown()) or run each engine in its own process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=1)")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._refuse_other_engine()
        self._kv_caches = dict(kv_caches)
        numbers = {name: int(m.group(1)) for name in kv_caches if (m := re.search(r"\.(\d+)\.", name))}
        if len(numbers) != len(kv_caches):
            raise ValueError(f"ragfuse connector: cannot order attention layers {list(kv_caches)}")
        for i, name in enumerate(sorted(kv_caches, key=numbers.__getitem__)):
            self._layer_index[name] = i

    def _ensure_layout(self, forward_context: ForwardContext) -> PagedLayout:
        if self._layout is None:
            name = next(iter(self._layer_index))
            layer = forward_context.no_compile_layers[name]
            cache = self._kv_caches[name]

            def write(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, slots: torch.Tensor) -> None:
                layer.impl.do_kv_cache_update(layer, k, v, c, slots)

            self._layout = PagedLayout.probe(write, tuple(cache.shape[1:]), cache.dtype, self.block_size,
                                             self._num_kv_heads, self._head_dim)
        return self._layout

    def _rotate(self, k: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate ``k`` [tokens, heads, dim] to ``positions`` (or back from them), in float32."""
        return apply_rope_ref(k.float(), positions, self._cos, -self._sin if inverse else self._sin)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagfuseConnectorMetadata)
        if not meta.loads:
            return
        layout = self._ensure_layout(forward_context)
        self._layer_ready = {name: threading.Event() for name in self._layer_index}
        self._loader = threading.Thread(target=self._load_all, args=(meta.loads, layout, self._layer_ready),
                                        daemon=True, name="ragfuse-load")
        self._loader.start()

    def _load_all(self, loads: list[LoadOp], layout: PagedLayout, ready: dict[str, threading.Event]) -> None:
        """Layer by layer: read every item's layer i, rotate K to its positions, write into the cache.

        ``ready`` is this step's events, passed in: the thread still finishes its sources after the
        last layer, when the next step may already have put its own events on ``self``, and setting
        those would let that step read layers not yet loaded."""
        order = sorted(self._layer_index, key=self._layer_index.__getitem__)
        jobs = []  # (op, item, source, slots, positions)
        try:
            for op in loads:
                for item in op.items:
                    try:
                        source = open_source(self.store, item.key)
                    except Exception:  # a tier that cannot be read (I/O error, Redis down) is a miss
                        logger.exception("ragfuse connector: opening KV entry %s failed; recomputing", item.key)
                        source = None
                    if source is None or source.num_tokens < item.load_end - item.span_start:
                        self._fail(op, item.load_start)
                        break
                    slots = slots_for(op.block_ids, self.block_size, item.load_start, item.load_end)
                    positions = torch.arange(item.load_start, item.load_end)
                    jobs.append((op, item, source, slots, positions))
            for name in order:
                i = self._layer_index[name]
                cache = self._kv_caches[name]
                for op, item, source, slots, positions in jobs:
                    failed_from = self._failed_from.get(op.req_id)
                    if failed_from is not None and item.load_start >= failed_from:
                        continue  # reported failed: vLLM recomputes it; the items before it still load
                    try:
                        k, v = source.load_layer(i)
                    except CorruptEntryError as exc:
                        logger.warning("ragfuse connector: %s; recomputing", exc)
                        if hasattr(source, "drop"):
                            source.drop()
                        self._fail(op, item.load_start)
                        continue
                    except Exception:
                        logger.exception("ragfuse connector: reading KV entry %s failed; recomputing", item.key)
                        self._fail(op, item.load_start)
                        continue
                    lo, hi = item.load_start - item.span_start, item.load_end - item.span_start
                    k = k[lo:hi] if item.kind == CONTEXT else self._rotate(k[lo:hi], positions)
                    layout.scatter(cache, slots, k, v[lo:hi])
                ready[name].set()
        except Exception:  # whatever went wrong, no block this load did not finish may count as loaded
            logger.exception("ragfuse connector: loading KV failed; recomputing the requests' loaded tokens")
            for op in loads:
                if op.items:
                    self._fail(op, op.items[0].load_start)
        finally:
            for ev in ready.values():
                ev.set()
        for _, _, source, _, _ in jobs:  # after the step's layers are out: a failure here costs nothing loaded
            try:
                source.finish()
            except Exception:
                logger.exception("ragfuse connector: finishing a read of KV entry failed")

    def _fail(self, op: LoadOp, from_token: int) -> None:
        """Report the blocks from ``from_token`` on as not loaded: vLLM recomputes them (and keeps the
        blocks before, so everything before ``from_token`` must still be loaded)."""
        self._failed_from[op.req_id] = min(from_token, self._failed_from.get(op.req_id, from_token))
        first = from_token // self.block_size
        self._failed_blocks.update(op.block_ids[first:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        ev = self._layer_ready.get(layer_name)
        if ev is not None:
            ev.wait()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        self._failed_from = {}
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagfuseConnectorMetadata)
        if not meta.saves:
            return
        if self._layout is None:
            from vllm.forward_context import get_forward_context

            self._layout = self._ensure_layout(get_forward_context())
        i = self._layer_index[layer_name]
        for op in meta.saves:
            start, end = op.spans[0].start, max(s.end for s in op.spans)
            k, v = self._layout.gather(kv_layer, slots_for(op.block_ids, self.block_size, start, end))
            self._save_buffers.setdefault((op.req_id, i), []).append((k, v))

    def wait_for_save(self) -> None:
        """Hand the copied layers to the save thread; the step does not wait for disk writes. An op
        whose layers were not all copied (no forward ran) is dropped and its pending marks cleared."""
        if not self.has_connector_metadata():
            self._save_buffers.clear()
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagfuseConnectorMetadata)
        num_layers = len(self._layer_index)
        for op in meta.saves:
            layers = [self._save_buffers.get((op.req_id, i)) for i in range(num_layers)]
            # a load of this request failed in this step: its new KV attended to blocks never loaded
            # (vLLM recomputes them next step); stored, it would be served as exact to later requests
            if any(not entry for entry in layers) or op.req_id in self._failed_from:
                self._clear_pending(op)
                continue
            k = torch.stack([entry[0][0] for entry in layers])  # [layers, tokens, heads, dim]
            v = torch.stack([entry[0][1] for entry in layers])
            self._saver.submit(self._write, op, k, v)
        self._save_buffers.clear()

    def _clear_pending(self, op: SaveOp) -> None:
        for span in op.spans:
            try:
                self.pending.clear(span.key)
            except OSError:  # left to go stale (``PendingSaves.stale_s``), never a failed step
                logger.exception("ragfuse connector: clearing the save mark of %s failed", span.key)

    def _write(self, op: SaveOp, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put one entry per span: chunk K un-rotated (before RoPE, the engine's format, movable),
        context K as vLLM holds it (see ``plan.py``: its position is fixed by its key)."""
        base = op.spans[0].start
        try:
            for span in op.spans:
                lo, hi = span.start - base, span.end - base
                positions = torch.arange(span.start, span.end)
                ks = k[:, lo:hi] if span.kind == CONTEXT else torch.stack(
                    [self._rotate(layer, positions, inverse=True) for layer in k[:, lo:hi]])
                entry = StoredKV.from_kv(span.key, ks.to(self.settings.kv_dtype),
                                         v[:, lo:hi].to(self.settings.kv_dtype))
                self.store.put(entry)
        except Exception:  # a failed save is a future miss, never a failed request
            logger.exception("ragfuse connector: saving KV of request %s failed", op.req_id)
        finally:
            self._clear_pending(op)

    def shutdown(self) -> None:
        """Finish queued saves before the worker exits (a save cut short would only be a future miss)
        and the last load's reads (their open entry files), then let go of the shared store, which its
        last user closes. Once only: a second release would close a store another engine still uses."""
        self._saver.shutdown(wait=True)
        if self._loader is not None:
            self._loader.join()
        if not self._store_released:
            self._store_released = True
            release_store(self.settings)
