"""``ragfuse serve``: the OpenAI-compatible HTTP server with RAG (``ragfuse.connectors.server``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ragfuse.commands.generate import add_model_args, positive_int
from ragfuse.commands.ingest import add_store_arg
from ragfuse.engine.errors import RagfuseError

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API with RAG over a store's fused KV")
    add_store_arg(p)
    add_model_args(p, store=True)
    p.add_argument("--backend", choices=["ragfuse", "vllm"], default="ragfuse",
                   help="ragfuse's own engine, or vLLM with ragfuse's KV connector (needs vllm installed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: loopback only; elsewhere set --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (1-65535)")
    p.add_argument("--api-key", default=os.environ.get("RAGFUSE_API_KEY"),
                   help="key every route but /health needs (default: $RAGFUSE_API_KEY; none: open)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser calls from this origin (repeatable; default: none)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, uploads included")
    p.add_argument("--max-tokens", type=positive_int, default=1024, help="most tokens one request may generate")
    p.add_argument("--max-top-k", type=positive_int, default=20, help="most chunks one RAG query may retrieve")
    p.add_argument("--sessions-dir", metavar="DIR",
                   help="where sessions' KV is kept between turns (default: the store's sessions/ directory)")
    p.add_argument("--session-memory-gb", type=float, default=4.0, help="host memory for sessions' KV")
    p.add_argument("--session-disk-gb", type=float, default=32.0, help="disk for sessions' KV")
    p.add_argument("--no-relay", action="store_true",
                   help="serve chats' system messages by plain prefill (default: relay attention, registered once)")
    p.add_argument("--no-prefix-tree", action="store_true",
                   help="no automatic sharing of common prompt prefixes' KV blocks (for comparisons)")
    p.add_argument("--no-gate", action="store_true",
                   help="skip the accuracy gate's r* calibration (recompute ratio: the policy's default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's (uvicorn's) log level")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise SystemExit(_usage(f"--port must be in 1..65535, got {args.port}"))
    if args.max_body_mb <= 0:
        raise SystemExit(_usage("--max-body-mb must be positive"))
    if args.session_memory_gb < 0 or args.session_disk_gb < 0:
        raise SystemExit(_usage("--session-memory-gb and --session-disk-gb must not be negative"))
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit(_usage("--api-key is empty"))
    if args.host not in LOOPBACK and not args.api_key:
        sys.stderr.write(f"ragfuse: warning: serving on {args.host} without an API key: anyone who can reach "
                         "the port can use it\n")
    sock = _bind(args.host, args.port)  # a port in use is told before the model loads (seconds to minutes)
    import uvicorn  # after the checks: the server stack takes seconds to import

    from ragfuse.connectors.server import ServerSettings, create_app

    settings = ServerSettings(api_key=args.api_key, cors_origins=tuple(args.cors_origin),
                              max_body_bytes=int(args.max_body_mb * 2**20), max_tokens=args.max_tokens,
                              max_top_k=args.max_top_k, relay=not args.no_relay)
    try:
        backend = build_backend(args)
        app = create_app(backend, settings)
    except BaseException:
        sock.close()
        raise
    # a signal ends the engine's requests at once: their streams close with an error event instead of
    # being cut off mid-chunk (with a traceback) when the grace period runs out
    end_requests = backend.stop if args.backend == "vllm" else backend.loop.stop
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    # uvicorn raises the signal again once it has shut down: KeyboardInterrupt (Ctrl-C) or the CLI's
    # Terminated (SIGTERM); the shutdown was clean, so the exit status is 0
    with contextlib.suppress(KeyboardInterrupt):
        _server_class(end_requests)(config).run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: uvicorn binds only once the app is built, so a port
    in use (another server) failed after the model had loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise RagfuseError(f"cannot serve on {host}: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "in use (another server?)" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise RagfuseError(f"cannot serve on {host}:{port}: {why}") from exc
    return sock


def _server_class(end_requests: Callable[[], None]) -> type:
    """uvicorn's server, which on SIGINT/SIGTERM also calls ``end_requests`` (on the event loop: a
    signal handler must not take the locks of a queue its own thread may hold)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not serving yet or any more: the app's shutdown ends the engine
                return
            loop.call_soon_threadsafe(end_requests)

    return Server


def build_backend(args: argparse.Namespace):  # noqa: ANN201 (a Backend; its module imports the server stack)
    from ragfuse.app import serving_model

    model = serving_model(args.store, args.model)  # the store's, known before a model loads
    if args.backend == "vllm":
        from ragfuse.connectors.server.vllm_backend import VLLMServeBackend

        return VLLMServeBackend.open(args.store, model)
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline
    from ragfuse.engine.sessions.store import hold_sessions
    from ragfuse.rag_store import store_folder_writable
    from ragfuse.store_dir import resolve_store_dir

    # another process keeping these sessions (a server on the same store) is told before the model loads;
    # a read-only store's replica keeps them in memory unless given a folder of their own
    root = resolve_store_dir(args.store)
    on_disk = args.sessions_dir is not None or store_folder_writable(root)
    if not on_disk:
        sys.stderr.write(f"ragfuse: warning: the store at {root} is read-only: sessions are kept in memory only, lost "
                         "when the server stops (--sessions-dir DIR keeps them on disk)\n")
    held = hold_sessions(Path(args.sessions_dir) if args.sessions_dir else root / "sessions") if on_disk else None
    engine = None
    if args.no_prefix_tree:
        from ragfuse.engine import EngineConfig, LLMEngine

        engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype, prefix_tree=False))
    pipeline = open_store_pipeline(args.store, model, args.device, args.dtype, engine=engine,
                                   gate=not args.no_gate)
    return EngineBackend(pipeline, model, args.sessions_dir, int(args.session_memory_gb * 2**30),
                         int(args.session_disk_gb * 2**30), sessions_lock=held, sessions_on_disk=on_disk)


def _usage(msg: str) -> int:
    sys.stderr.write(f"ragfuse: error: {msg}\n")
    return 2
