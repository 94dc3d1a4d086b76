"""``ragfuse serve`` in a child process, for the benchmarks that load it through its HTTP API.

The server runs in its own process so the client's work (asyncio, httpx) never competes with the
engine for the GIL, and so its resident memory can be read apart from the client's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServedProcess:
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def served(serve_args: list[str], key: str, workdir: Path) -> Iterator[ServedProcess]:
    """Start ``ragfuse serve SERVE_ARGS`` on a free loopback port, wait for ``/health``, and stop it
    on exit (terminate, then kill after 30 s). Its output goes to ``workdir/server.log``, quoted in
    the error when it dies before answering."""
    port = free_port()
    cmd = [sys.executable, "-m", "ragfuse.cli", "serve", "--port", str(port), *serve_args]
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAGFUSE_API_KEY": key})
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, server, log_path)
            yield ServedProcess(url, server)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def free_port() -> int:
    """A loopback port free now, picked by the OS (another process could still take it first: a rare,
    harmless race for benchmarks and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    import httpx

    from ragfuse.engine.errors import RagfuseError

    print("starting ragfuse serve (model load, store) ...", file=sys.stderr)
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RagfuseError(f"ragfuse serve exited with {server.returncode}: {log.read_text()[-500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RagfuseError(f"ragfuse serve did not answer /health within {timeout:.0f} s")
        time.sleep(0.5)
