"""A real uvicorn server on a loopback port, in a thread of the test process, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import uvicorn

DEMO = Path(__file__).resolve().parents[1] / "demo" / "docs"
MODEL = "smollm2-135m-instruct"
KEY = "test-key-0123456789"


class LiveServer:
    def __init__(self, app: object) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextmanager
def serve_lighthouses(store: Path, llm: Any, **backend_options: Any) -> Iterator[SimpleNamespace]:
    """ragfuse's server over a new store at ``store`` on ``llm``'s engine, the demo's lighthouse
    document uploaded: ``url``, ``store``, ``backend``, ``engine`` (the app closes the backend).
    ``backend_options``: for ``EngineBackend`` (e.g. small session bounds, so a test reaches them)."""
    import httpx

    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline

    pipeline = open_store_pipeline(str(store), MODEL, engine=llm.engine, gate=False)
    backend = EngineBackend(pipeline, MODEL, **backend_options)
    app = create_app(backend, ServerSettings(api_key=KEY, max_body_bytes=1 << 20, max_tokens=64))
    with LiveServer(app) as srv:
        doc = DEMO / "lighthouses.md"
        r = httpx.post(f"{srv.url}/v1/documents", files=[("files", (doc.name, doc.read_bytes()))],
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
        assert r.status_code == 200, r.text
        yield SimpleNamespace(url=srv.url, store=store, backend=backend, engine=llm.engine)

