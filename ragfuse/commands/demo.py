"""``ragfuse demo``: the Gradio demo (documents, streamed answers with sources, fused vs full TTFT)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ragfuse.commands.generate import add_model_args
from ragfuse.commands.ingest import add_store_arg
from ragfuse.commands.serve import LOOPBACK

# the demo documents: shipped in the wheel as ragfuse/demo_docs (pyproject maps demo/docs there), or the
# repository's demo/docs when running from a checkout (an editable install)
PACKAGED_DOCS = Path(__file__).resolve().parents[1] / "demo_docs"
REPO_DOCS = Path(__file__).resolve().parents[2] / "demo" / "docs"
DEMO_DOCS = next((d for d in (PACKAGED_DOCS, REPO_DOCS) if d.is_dir()), None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the Gradio demo over a store (created empty if missing)")
    add_store_arg(p)
    add_model_args(p, store=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (1-65535)")
    p.add_argument("--docs", default=str(DEMO_DOCS) if DEMO_DOCS else None,
                   help="directory of documents offered for picking (default: ragfuse's demo documents)")
    p.add_argument("--no-gate", action="store_true",
                   help="skip the accuracy gate's r* calibration (recompute ratio: the policy's default)")
    p.add_argument("--auth", default=os.environ.get("RAGFUSE_DEMO_AUTH"), metavar="USER:PASSWORD",
                   help="the login the page asks for (default: $RAGFUSE_DEMO_AUTH; none: open)")
    p.set_defaults(func=run)


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """``USER:PASSWORD`` as Gradio's login pair; None for an open page. A malformed value is an error
    before the model loads, never a page left open by mistake."""
    from ragfuse.engine import RagfuseError

    if value is None:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user.strip() or not password:
        raise RagfuseError("--auth must be USER:PASSWORD, both non-empty")
    return user, password


def launch(app: Any, host: str, port: int | None, auth: tuple[str, str] | None, block: bool = True) -> None:
    """Serve the page, behind ``auth`` when given (the demo ingests and answers for whoever reaches it).
    ``block=False`` returns once it listens (tests)."""
    app.queue().launch(server_name=host, server_port=port, share=False, show_error=True, quiet=True, auth=auth,
                       prevent_thread_lock=not block)


def check_listen(host: str, port: int) -> None:
    """Fail in a line before the model loads, not in Gradio's traceback after it."""
    from ragfuse.engine import RagfuseError

    if not 0 < port < 65536:
        raise RagfuseError(f"--port must be in 1-65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise RagfuseError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    check_listen(args.host, args.port)
    auth = parse_auth(args.auth)
    if args.host not in LOOPBACK and auth is None:
        sys.stderr.write(f"ragfuse: warning: the demo on {args.host} without --auth: anyone who can reach the port "
                         "can add documents and ask\n")
    if args.docs and not Path(args.docs).is_dir():
        raise RagfuseError(f"--docs {args.docs} is not a directory")
    try:
        from ragfuse.connectors.gradio_demo import DemoBackend
        from ragfuse.connectors.gradio_demo.app import build_app
    except ModuleNotFoundError as exc:
        raise RagfuseError(f"the demo needs `pip install 'ragfuse[demo]'` ({exc.name} is missing)") from exc

    from ragfuse.app import serving_model

    backend = DemoBackend(args.store, serving_model(args.store, args.model), args.device, args.dtype,
                          docs_dir=args.docs, gate=not args.no_gate)
    app = build_app(backend)
    print(f"ragfuse demo on http://{args.host}:{args.port} (store {backend.pipe.store.root})", flush=True)
    launch(app, args.host, args.port, auth)
    return 0
