"""What the vLLM side leaves behind once closed: no connector thread, no open file under the store
folder, no store object, and no queued save lost or half-written.

The connector's per-process store (``shared_store``) was kept for the life of the process: an engine
run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as these tests and notebook users run it) left,
after ``VLLMBackend.close()``, the store's manifest open (three files under the store folder) and its
memory tier's cached KV reachable. One engine start for the module (about 10-40 s on a 2-core box).
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest

from ragfuse.connectors.vllm import settings as connector_settings
from ragfuse.connectors.vllm.plan import plan_spans
from ragfuse.connectors.vllm.settings import ConnectorSettings, release_store, shared_store
from ragfuse.engine.kvstore import DiskTier
from tests.kvstore_helpers import make_entry

pytestmark = pytest.mark.timeout(600)


def _open_files_under(root: Path) -> list[str]:
    """Paths under ``root`` this process holds open (its file descriptors, as the kernel lists them)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
        if target.startswith(f"{root}/"):
            found.append(target)
    return found


def _collected(ref: weakref.ref[object]) -> bool:
    gc.collect()
    return ref() is None


# ---------------------------------------------------------------- no engine needed


def test_the_shared_store_stays_open_until_its_last_user_lets_go(tmp_path: Path) -> None:
    """The scheduler and worker connectors of one engine process share one store: the first to shut
    down must not close it under the other; the last closes it, and the next engine opens it anew."""
    root = tmp_path / "kv"
    settings = ConnectorSettings(store_dir=str(root), fingerprint="fp", memory_mb=0)
    first = shared_store(settings)
    assert shared_store(settings) is first
    release_store(settings)
    entry = make_entry(1)
    first.put(entry)  # still open for its other user
    assert first.locate(entry.key) == "disk"
    release_store(settings)
    assert _open_files_under(root) == []
    reopened = shared_store(settings)
    try:
        assert reopened is not first
        assert reopened.locate(entry.key) == "disk"
    finally:
        release_store(settings)


# ---------------------------------------------------------------- with vLLM

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: what it leaves is seen

from ragfuse.connectors.vllm.backend import VLLMBackend, kv_transfer_config  # noqa: E402
from tests.vllm.vllm_helpers import wait_saved  # noqa: E402


def test_a_connector_shut_down_twice_lets_go_of_the_store_once(tmp_path: Path) -> None:
    """A second ``shutdown`` of one connector must not close the store under its other users (the
    other side's connector, another engine on the same settings in this process)."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ragfuse.connectors.vllm.connector import RagfuseKVConnector

    root = tmp_path / "kv"
    settings = ConnectorSettings(store_dir=str(root), fingerprint="fp", memory_mb=0)
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings)))
    connector = RagfuseKVConnector(config, KVConnectorRole.SCHEDULER, None)
    other = shared_store(settings)
    connector.shutdown()
    connector.shutdown()
    entry = make_entry(2)
    other.put(entry)
    assert other.locate(entry.key) == "disk"
    release_store(settings)
    assert _open_files_under(root) == []


def _ragfuse_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ragfuse-")]


def test_a_closed_backend_leaves_no_thread_open_file_or_store_and_loses_no_save(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    backend = VLLMBackend(store_dir=root, memory_mb=16)
    try:
        history = backend.chat_prompt([{"role": "user", "content": "Tell me about Oxford and its colleges. " * 20}])
        backend.generate(history, max_tokens=2)
        wait_saved(root)
        # a load too, so the loader thread has read entry files from the disk tier
        assert backend.generate(history, max_tokens=2).connector["loaded_tokens"] > 0
        fresh = backend.chat_prompt([{"role": "user", "content": "Now tell me about Cambridge instead. " * 20}])
        assert backend.generate(fresh, max_tokens=1).connector["saved_spans"] > 0  # queued; not waited for
        store = weakref.ref(connector_settings._STORES[backend.settings])
        settings = backend.settings
    finally:
        backend.close()
    del backend
    assert _ragfuse_threads() == []
    assert _open_files_under(root) == []
    assert _collected(store)
    # the save queued just before close reached disk whole (every span, checksums verified), no mark left
    assert list((root / "pending").iterdir()) == []
    disk = DiskTier(root, 1 << 30)
    try:
        keys = [s.key for s in plan_spans(fresh.token_ids, [], settings.fingerprint, settings.kv_dtype,
                                          settings.span_tokens)]
        assert [k for k in keys if disk.get(k) is None] == []
    finally:
        disk.close()
