"""``ragfuse demo``: the Gradio demo (documents, streamed answers with sources, fused vs full TTFT)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from ragfuse.commands.generate import add_model_args
from ragfuse.commands.ingest import add_store_arg

# the demo documents: shipped in the wheel as ragfuse/demo_docs (pyproject maps demo/docs there), or the
# repository's demo/docs when running from a checkout (an editable install)
PACKAGED_DOCS = Path(__file__).resolve().parents[1] / "demo_docs"
REPO_DOCS = Path(__file__).resolve().parents[2] / "demo" / "docs"
DEMO_DOCS = next((d for d in (PACKAGED_DOCS, REPO_DOCS) if d.is_dir()), None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the Gradio demo over a store (created empty if missing)")
    add_store_arg(p)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--docs", default=str(DEMO_DOCS) if DEMO_DOCS else None,
                   help="directory of documents offered for picking (default: ragfuse's demo documents)")
    p.add_argument("--no-gate", action="store_true",
                   help="skip the accuracy gate's r* calibration (recompute ratio: the policy's default)")
    p.set_defaults(func=run)


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
    if args.docs and not Path(args.docs).is_dir():
        raise RagfuseError(f"--docs {args.docs} is not a directory")
    try:
        from ragfuse.connectors.gradio_demo import DemoBackend
        from ragfuse.connectors.gradio_demo.app import build_app
    except ModuleNotFoundError as exc:
        raise RagfuseError(f"the demo needs `pip install 'ragfuse[demo]'` ({exc.name} is missing)") from exc

    backend = DemoBackend(args.store, args.model, args.device, args.dtype, docs_dir=args.docs, gate=not args.no_gate)
    app = build_app(backend)
    print(f"ragfuse demo on http://{args.host}:{args.port} (store {backend.pipe.store.root})", flush=True)
    app.queue().launch(server_name=args.host, server_port=args.port, share=False, show_error=True, quiet=True)
    return 0
