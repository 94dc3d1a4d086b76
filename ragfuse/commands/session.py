"""``ragfuse session ls|rm``: the conversations `generate --session` and `ask --session` keep
between runs (their KV, and for `generate` their messages), listed and deleted without a server
(which has ``GET``/``DELETE /v1/sessions`` for its own)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragfuse.engine.sessions import SessionStore


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("session", help="list or delete the conversations kept by generate/ask --session")
    ssub = p.add_subparsers(dest="session_command", required=True, parser_class=type(p))
    ls = ssub.add_parser("ls", help="the stored sessions, most recently used first")
    _add_where(ls)
    ls.add_argument("--json", action="store_true", help="one JSON object: {dir, sessions: [...]}")
    ls.set_defaults(func=list_sessions)
    rm = ssub.add_parser("rm", help="delete sessions: their KV and transcripts (the next turn of an id starts afresh)")
    rm.add_argument("ids", nargs="+", metavar="ID")
    _add_where(rm)
    rm.set_defaults(func=remove_sessions)


def _add_where(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--session-dir", "--sessions-dir", dest="session_dir", metavar="DIR",
                       help="the sessions of `generate --session` (default: $RAGFUSE_SESSIONS, else the per-user "
                            "data directory)")
    where.add_argument("--store", metavar="DIR", help="the sessions of `ask --session` over this store")


def _root(args: argparse.Namespace) -> Path:
    from ragfuse.commands.generate import sessions_dir
    from ragfuse.store_dir import resolve_store_dir

    return resolve_store_dir(args.store) / "sessions" if args.store else sessions_dir(args.session_dir)


def _open(root: Path, hold: bool = False) -> SessionStore | None:
    """The sessions under ``root`` (None where there is no such folder: nothing is created for a look);
    ``hold``: to delete, refused while another process keeps them."""
    from ragfuse.engine.sessions import SessionStore

    return SessionStore.browse(root, hold=hold) if (root / "records").is_dir() else None


def list_sessions(args: argparse.Namespace) -> int:
    root = _root(args)
    store = _open(root)
    found = []
    if store is not None:
        try:
            found = store.sessions()
        finally:
            store.close()
    if args.json:
        print(json.dumps({"dir": str(root), "sessions": [asdict(s) for s in found]}))
        return 0
    if not found:
        print(f"no sessions under {root}")
    for s in found:
        print(f"{s.session_id}: {s.tokens} tokens ({s.stored_rows} with stored KV, {s.nbytes / 2**20:.1f} MiB), "
              f"{s.tier or 'not held'}")
    return 0


def remove_sessions(args: argparse.Namespace) -> int:
    from ragfuse.commands.generate import transcript_path
    from ragfuse.engine.sessions import check_session_id

    ids = [check_session_id(i) for i in args.ids]
    root = _root(args)
    store = _open(root, hold=True)
    missing = []
    try:
        for sid in ids:
            had_kv = store is not None and store.delete(sid)
            chat = transcript_path(root, sid)
            had_chat = chat.exists()
            chat.unlink(missing_ok=True)
            if had_kv or had_chat:
                print(f"removed session {sid}")
            else:
                missing.append(sid)
    finally:
        if store is not None:
            store.close()
    if missing:
        sys.stderr.write(f"ragfuse: error: no session {', '.join(missing)} under {root}\n")
        return 2
    return 0
