"""Small real KV entries for the store tests (random values of a tiny model shape)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from ragfuse.bench.serve_process import free_port
from ragfuse.engine.kvstore import StoredKV, kv_key

LAYERS, HEADS, DIM = 4, 2, 16


def make_entry(seed: int, tokens: int = 32, dtype: torch.dtype = torch.float32) -> StoredKV:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, tokens, HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(LAYERS, tokens, HEADS, DIM, generator=gen).to(dtype)
    return StoredKV.from_kv(kv_key("test-model", dtype, [seed, tokens]), k, v)


def same(a: StoredKV, b: StoredKV) -> bool:
    ka, va = a.kv()
    kb, vb = b.kv()
    return a.key == b.key and torch.equal(ka.cpu(), kb.cpu()) and torch.equal(va.cpu(), vb.cpu())


def start_redis(*options: str) -> tuple[subprocess.Popen, str]:
    """A private ``redis-server`` (with ``options``) on a free loopback port, and its URL, once it
    accepts connections."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (scripts/setup.sh installs it in CI)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"
