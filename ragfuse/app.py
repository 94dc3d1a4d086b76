"""Assembling the pieces an entry point needs (CLI, server, connectors): engine, store, retriever,
loading controller and accuracy gate, from a store directory and a model name."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ragfuse.controller_source import Controlled, ControllerSource
from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.errors import RagfuseError
from ragfuse.engine.kvstore import DelayProfile, KVStoreError, LoadingController, MemoryTier, profile_path
from ragfuse.engine.kvstore.entry import dtype_name
from ragfuse.pipeline import RagPipeline
from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever
from ragfuse.store_dir import StoreConfig, ingested_store, model_reference, resolve_store_dir

log = logging.getLogger("ragfuse.app")
DEFAULT_MODEL = "smollm2-135m-instruct"


def serving_model(store: str | Path | None, model: str | None) -> str:
    """The model a pipeline over ``store`` serves, known before any model loads: the one the store
    was ingested with (``model``, where given, must be that one: another model's KV would miss every
    chunk and be written beside it), else ``model``, else the default (no store yet, or none)."""
    config = StoreConfig.load(resolve_store_dir(store)) if store is not None else None
    if config is None:
        return model or DEFAULT_MODEL
    if model is not None and model_reference(model) != config.model:
        raise RagfuseError(f"the store at {resolve_store_dir(store)} was ingested with model {config.model!r}, "
                           f"not {model!r} (leave the model out to serve the store's)")
    return config.model


def store_profile_path(root: Path, engine: LLMEngine) -> Path:
    """Where a store keeps the delay profile of ``engine`` (its model build, device and dtype): one
    place for ``ragfuse profile``, which writes it, and the pipelines, which read it."""
    return profile_path(root / "profiles", engine.fingerprint, str(engine.device), dtype_name(engine.dtype))


def open_pipeline(
    store: str | None,
    model: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    redis_url: str | None = None,
    cpu_cache_gb: float = 2.0,
    gpu_cache_gb: float = 4.0,
    engine: LLMEngine | None = None,
    gate: bool = True,
) -> RagPipeline:
    """A pipeline over the store at ``store`` (or the default store), serving ``model`` (default:
    the model the store was ingested with). KV tiers: GPU pool (with CUDA), CPU pool, disk, Redis."""
    root, config = ingested_store(store)
    serving_model(root, model)
    engine = engine or LLMEngine(EngineConfig(model=config.model, device=device, dtype=dtype))
    tiers = []
    if engine.device.type == "cuda":
        tiers.append(MemoryTier("gpu", engine.device, int(gpu_cache_gb * 2**30)))
    tiers.append(MemoryTier("cpu", "cpu", int(cpu_cache_gb * 2**30), pin=torch.cuda.is_available()))
    rag = RagStore(root, config, redis_url=redis_url, memory_tiers=tiers)
    r_star = None
    if gate:
        from ragfuse.gate import calibrated_r_star

        r_star = calibrated_r_star(engine, kv_context=config.chunk_kv_context)
    prof_file = store_profile_path(root, engine)
    controller = ControllerSource(prof_file, lambda: _profile_controller(prof_file, engine, config.model, r_star))
    return RagPipeline(engine, rag, r_star=r_star, controller=controller)


def _profile_controller(prof_file: Path, engine: LLMEngine, model: str, r_star: float | None) -> Controlled:
    """The loading controller of the delay profile at ``prof_file``; or none, and why where a profile
    was meant to be there (said in the log, and in the notes of the answers it would have served)."""
    if prof_file.exists():
        # the controller's floor is the gate's r*: with its own default (15%) it raised every ratio the
        # gate had measured safe below that, so profiling a store made its answers slower
        try:
            profile = DelayProfile.load(prof_file)
        except KVStoreError as exc:  # damaged, or made by an older ragfuse: answers need no profile
            unusable = f"{exc}; recompute ratio r* without the loading controller"
            log.warning(unusable)
            return None, unusable
        log.info("delay profile %s read: the loading controller chooses recompute ratios", prof_file)
        return (LoadingController(profile) if r_star is None else LoadingController(profile, r_star=r_star)), None
    if any(prof_file.parent.glob("profile-*.json")):  # profiled for another build, device or dtype
        unusable = (f"the store's delay profiles were measured for another model build, device or dtype, not "
                    f"{model} on {engine.device} in {dtype_name(engine.dtype)} (run `ragfuse profile "
                    f"--device {engine.device.type} --dtype {dtype_name(engine.dtype)}`); recompute ratio r* "
                    "without the loading controller")
        log.warning(unusable)
        return None, unusable
    log.info("no delay profile at %s (run `ragfuse profile`): recompute ratio r* without the controller", prof_file)
    return None, None


_SHARED: dict[tuple, object] = {}
_SHARED_LOCK = threading.Lock()


def _shared_engine(store: str | None, model: str | None, device: str) -> tuple[str | None, str, str, LLMEngine]:
    """(store folder, model, device, engine) of ``shared_engine``; the caller holds ``_SHARED_LOCK``."""
    if store is not None:
        store = str(ingested_store(store)[0])
    model = serving_model(store, model)
    # keyed by the device "auto" resolves to: frameworks asking for "auto" and "cpu" on a CPU box
    # share one engine rather than load the model twice
    device = str(EngineConfig(model=model, device=device).resolve_device())
    ekey = ("engine", model, device)
    if ekey not in _SHARED:
        _SHARED[ekey] = LLMEngine(EngineConfig(model=model, device=device))
    engine = _SHARED[ekey]
    assert isinstance(engine, LLMEngine)
    return store, model, device, engine


def shared_engine(store: str | None, model: str | None = None, device: str = "auto") -> LLMEngine:
    """The engine serving ``store`` (its model, or ``model``) in this process, loaded once per model and
    device. What needs only the model (a framework's context window, its token counts) takes this, not
    ``shared_pipeline``: a pipeline with the accuracy gate calibrates r* when it is made (minutes on a CPU
    the first time), which making a LlamaIndex query engine, reading its LLM's context window, waited for."""
    with _SHARED_LOCK:
        return _shared_engine(store, model, device)[3]


def shared_pipeline(store: str | None, model: str | None = None, device: str = "auto", gate: bool = True,
                    ) -> RagPipeline:
    """The pipeline for ``store`` (None: no store, every prompt prefilled) in this process, made once.

    Framework objects (a LangChain chat model, a LlamaIndex LLM) are created often, per chain or per
    test case, and are cheap to create: they share one engine per model and device, loaded on first use,
    and one pipeline per store."""
    with _SHARED_LOCK:
        store, model, device, engine = _shared_engine(store, model, device)
        pkey = ("pipeline", store, model, device, gate and store is not None)
        if pkey not in _SHARED:  # without a store nothing is fused: no r* to calibrate
            _SHARED[pkey] = (open_pipeline(store, model, engine=engine, gate=gate) if store
                             else RagPipeline(engine, None))
        pipe = _SHARED[pkey]
        assert isinstance(pipe, RagPipeline)
        return pipe


def forget_shared() -> None:
    """Drop this process's shared engines, pipelines and retrievers, so the next framework object loads
    afresh (another model, a re-ingested store) and an engine nothing else holds is freed with its weights
    and KV cache. Objects already holding a pipeline keep theirs."""
    with _SHARED_LOCK:
        _SHARED.clear()


def shared_retriever(store: str | None) -> Retriever:
    """A retriever over ``store`` made once per process (no model loaded: retrieval needs only embeddings)."""
    root = resolve_store_dir(store)
    with _SHARED_LOCK:
        key = ("retriever", str(root))
        if key not in _SHARED:
            _SHARED[key] = Retriever(RagStore.open_existing(root))
        found = _SHARED[key]
        assert isinstance(found, Retriever)
        return found
