"""Closing the vLLM side, and building one engine after another in a process.

- ``VLLMServeBackend.close()`` stopped at a failing ``llm.shutdown()``: the store worker thread and
  the store's open files were left behind.
- ``VLLMBackend.close()`` twice raised ``AttributeError``, and so did a closed backend's ``generate``.
- vLLM keeps the worker-side KV connector in a process-wide variable, created only when it is empty:
  a second in-process engine beside one never shut down silently reused the first one's connector,
  so its chunks were stored under the first engine's ``store_dir``.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where that variable is shared;
three in-process engine starts (a few seconds each once vLLM is imported) and one server engine
(``AsyncLLM``, its own process: about a minute on a 2-core box).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from ragfuse.connectors.vllm.backend import close_each
from ragfuse.engine.kvstore import DiskTier
from tests.kvstore_helpers import make_entry

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------- no engine needed


def test_close_each_runs_every_step_and_raises_the_first_failure(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    ran: list[str] = []

    def engine_shutdown() -> None:
        ran.append("engine")
        raise RuntimeError("engine core did not stop")

    def worker_shutdown() -> None:
        ran.append("worker")
        raise OSError("worker failed too")

    with pytest.raises(RuntimeError, match="engine core did not stop") as caught:
        close_each(engine_shutdown, worker_shutdown, disk.close, lambda: ran.append("last"))
    assert ran == ["engine", "worker", "last"]
    assert any("worker failed too" in note for note in caught.value.__notes__)  # the later failure is kept
    with pytest.raises(Exception):  # noqa: B017,PT011 - the tier is closed: any use fails
        disk.put(make_entry(1))


# ---------------------------------------------------------------- with vLLM

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines share vLLM's connector variable

from ragfuse.connectors.vllm.backend import VLLMBackend  # noqa: E402
from ragfuse.connectors.vllm.connector import StaleConnectorError  # noqa: E402
from ragfuse.connectors.vllm.plan import plan_spans  # noqa: E402
from ragfuse.engine.errors import RagfuseError  # noqa: E402
from tests.vllm.test_vllm_release import _open_files_under  # noqa: E402
from tests.vllm.vllm_helpers import wait_saved  # noqa: E402

CHUNK_TEXT = "The Zephyr ferry to Isle Marrow leaves every morning at 7:40 from pier nine. " * 12


def test_a_failing_vllm_shutdown_still_releases_the_store_and_its_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("faiss")  # the server backend's store needs ragfuse's [rag] extra
    from ragfuse.connectors.server.vllm_backend import VLLMServeBackend

    root = tmp_path / "store"
    backend = VLLMServeBackend.open(str(root), "smollm2-135m-instruct")
    real_shutdown = backend.llm.shutdown

    def shutdown_then_fail() -> None:  # vLLM's own shutdown runs; only its failure is injected
        real_shutdown()
        raise RuntimeError("engine core did not stop")

    monkeypatch.setattr(backend.llm, "shutdown", shutdown_then_fail)
    assert asyncio.run(backend.list_documents()) == []  # the store worker thread has started
    assert _open_files_under(root) != []
    with pytest.raises(RuntimeError, match="engine core did not stop"):
        backend.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("ragfuse-store")] == []
    assert _open_files_under(root) == []


def test_a_server_backend_whose_store_cannot_open_starts_no_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store is opened before vLLM's engine: a store that fails to open is reported at once,
    without first starting the engine (about a minute on this box) only to shut it down again."""
    pytest.importorskip("faiss")
    from vllm.v1.engine.async_llm import AsyncLLM

    from ragfuse.connectors.server.engine_backend import ensure_store
    from ragfuse.connectors.server.vllm_backend import VLLMServeBackend
    from ragfuse.store_dir import StoreError

    started: list[object] = []
    real = AsyncLLM.from_engine_args

    def recorded(*args: object, **kwargs: object) -> object:  # the real start, only counted
        started.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(AsyncLLM, "from_engine_args", recorded)
    root = ensure_store(str(tmp_path / "store"), "smollm2-135m-instruct")
    (root / "docstore.sqlite").write_bytes(bytes(range(256)) * 16)
    with pytest.raises(StoreError, match="file is not a database"):
        VLLMServeBackend.open(str(root), "smollm2-135m-instruct")
    assert started == []


def test_a_backend_closes_twice_harmlessly_and_refuses_work_once_closed(tmp_path: Path) -> None:
    backend = VLLMBackend(store_dir=tmp_path / "kv", memory_mb=0)
    prompt = backend.chat_prompt([{"role": "user", "content": "Hello"}])
    backend.close()
    backend.close()
    with pytest.raises(RagfuseError, match="backend is closed"):
        backend.generate(prompt, max_tokens=1)
    with pytest.raises(RagfuseError, match="backend is closed"):
        backend.store_chunks([prompt.token_ids])


def _stored(store_dir: Path, backend: VLLMBackend, chunk: list[int]) -> bool:
    """Whether ``chunk``'s standalone KV is in ``store_dir``, under the key ``backend`` stores it as."""
    settings = backend.settings
    (span,) = plan_spans(chunk, [(0, len(chunk))], settings.fingerprint, settings.kv_dtype, settings.span_tokens)
    disk = DiskTier(store_dir, 1 << 30)
    try:
        return disk.get(span.key) is not None
    finally:
        disk.close()


def test_an_engine_beside_one_never_shut_down_is_refused_then_stores_in_its_own_dir(tmp_path: Path) -> None:
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first = VLLMBackend(store_dir=first_dir, memory_mb=0)
    try:
        with pytest.raises(StaleConnectorError, match=r"shut the old engine down first.*VLLMBackend\.close\(\)"):
            VLLMBackend(store_dir=second_dir, memory_mb=0)
    finally:
        first.close()
    second = VLLMBackend(store_dir=second_dir, memory_mb=0)
    try:
        chunk = second.encode(CHUNK_TEXT)
        second.store_chunks([chunk])
        wait_saved(second_dir)
        assert _stored(second_dir, second, chunk)
        assert not _stored(first_dir, second, chunk)
        assert list((second_dir / "pending").iterdir()) == []  # no mark left for a save that never came
    finally:
        second.close()
