"""Shared fixtures: the default model loaded once per test session (float32 on CPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels are then tested through its CPU interpreter (tests/test_kernels.py); Triton reads
    # this when it is first imported. The engine itself never runs Triton off CUDA.
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif "RAGFUSE_TEST_GPU_SHARE" in os.environ:
    # several test processes share one GPU (scripts/gpu_tests.py): each keeps to its share, so that one
    # process's cached allocations cannot leave another out of memory
    torch.cuda.set_per_process_memory_fraction(float(os.environ["RAGFUSE_TEST_GPU_SHARE"]))


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    """Freed GPU memory goes back to the device after each test, for the other processes sharing it."""
    yield
    if "RAGFUSE_TEST_GPU_SHARE" in os.environ:
        torch.cuda.empty_cache()


_LOADED: list = []  # the session's LLM once loaded


@pytest.fixture(scope="session")
def llm():
    """The embedded default model behind the ``LLM`` API, on CPU."""
    from ragfuse.engine import LLM

    _LOADED.append(LLM(device="cpu"))
    return _LOADED[0]


@pytest.fixture(autouse=True, scope="module")
def _release_relay_prompts():
    """System prompts a module's pipelines or chats registered on demand (``engine.relay_prompts``:
    the RAG instruction prefix, chat system messages) are released after it, so the next module
    finds the shared engine's cache blocks all free."""
    yield
    for loaded in _LOADED:
        loaded.engine.relay_prompts.release_idle()
    _drop_connector_engines()
    _return_freed_host_memory()


def _drop_connector_engines() -> None:
    """The engines and pipelines the connectors share in a process (``ragfuse.app.shared_pipeline``) are
    dropped after each module, to load again if a later one needs them: kept, the shared engine (1.5 GB
    with its KV cache) lived through every module after the first connector test."""
    app = sys.modules.get("ragfuse.app")
    if app is not None:  # no module imported it: nothing shared
        app.forget_shared()


def _return_freed_host_memory() -> None:
    """A module's engines, models and servers are collected and glibc's free lists handed back to the
    OS after it: one xdist worker runs dozens of modules, and their freed tensors kept in the
    allocator's arenas grew a worker to 15 GB, which the OOM killer ended on the 24 GiB CI box."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def engine(llm):
    return llm.engine


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' own implementation of the same weights, the reference for parity tests."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.checkpoint.path), dtype=torch.float32).eval()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def served(tmp_path_factory, llm):
    """A live ``ragfuse serve`` app over the demo documents (``serve_lighthouses``), one per test module;
    a module that needs another server defines its own ``served``, which ``client`` then talks to."""
    from tests.server_helpers import serve_lighthouses

    with serve_lighthouses(tmp_path_factory.mktemp("store"), llm) as srv:
        yield srv


@pytest.fixture
def client(served):
    """The official ``openai`` client for ``served``, authorised, without retries that hide errors."""
    import openai

    from tests.server_helpers import KEY

    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def redis_url():
    """A private ``redis-server`` on loopback for a module's tests (``start_redis``: skips where none
    is installed, fails in CI, which installs one)."""
    from tests.kvstore_helpers import start_redis

    proc, url = start_redis()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def read_only_fs(monkeypatch):
    """Every file open for writing or creating fails as on a read-only mount (root ignores file
    modes, so a chmod cannot make a folder read-only for the tests)."""
    import errno
    import os

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
