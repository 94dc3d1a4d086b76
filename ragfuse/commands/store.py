"""``ragfuse store stats|rm|gc``: what a store holds, removing files from it, and removing what
nothing needs (KV no chunk uses, crash leftovers, with ``--verify`` damaged KV)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ragfuse.commands.ingest import add_store_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="inspect or prune a store")
    ssub = p.add_subparsers(dest="store_command", required=True, parser_class=type(p))
    s = ssub.add_parser("stats", help="files, chunks, tokens, index and KV tiers")
    add_store_arg(s)
    s.add_argument("--json", action="store_true",
                   help="one JSON object: {store, files, chunks, tokens, index, index_vectors, config, kv}")
    s.set_defaults(func=stats)
    r = ssub.add_parser("rm", help="remove files (or everything under a directory) and their unused KV")
    r.add_argument("paths", nargs="*", metavar="PATH")
    r.add_argument("--all", action="store_true",
                   help="remove every file and all stored KV, and reset the settings (the next ingest sets them)")
    add_store_arg(r)
    r.set_defaults(func=rm)
    g = ssub.add_parser("gc", help="remove KV no stored chunk uses and what crashed writers left")
    add_store_arg(g)
    g.add_argument("--dry-run", action="store_true", help="remove nothing; report what would be removed")
    g.add_argument("--verify", action="store_true",
                   help="also read every KV entry and remove those failing their checksum (reads the whole tier)")
    g.add_argument("--redis", metavar="URL",
                   help="also collect the store's entries in this Redis server (the URL its ingests and asks use)")
    g.add_argument("--json", action="store_true", help="print the report as one JSON object")
    g.set_defaults(func=gc)


def stats(args: argparse.Namespace) -> int:
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import resolve_store_dir

    store = RagStore.open_existing(resolve_store_dir(args.store))
    try:
        out = {"store": str(store.root), **store.docs.counts(), "index": store.config.index_kind,
               "index_vectors": len(store.index), "config": store.config.__dict__,
               "kv": {name: s.as_dict() for name, s in store.kv.stats().items()}}
    finally:
        store.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"store {out['store']}: {out['files']} files, {out['chunks']} chunks, {out['tokens']} tokens; "
              f"{out['index']} index of {out['index_vectors']} vectors")
        for name, s in out["kv"].items():
            print(f"  KV tier {name}: {s['entries']} entries, {s['bytes'] / 2**30:.2f} of "
                  f"{s['capacity'] / 2**30:.1f} GiB")
    return 0


def rm(args: argparse.Namespace) -> int:
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import resolve_store_dir

    if not args.paths and not args.all:
        raise RagfuseError("name the files to remove, or pass --all")
    if args.paths and args.all:  # which one was meant? --all alone would silently remove every file
        raise RagfuseError("--all removes every file: name no PATH with it")
    if args.all:
        files, chunks, kv = RagStore.clear_at(resolve_store_dir(args.store))
        print(f"removed {files} files, {chunks} chunks, {kv} KV entries; the store's settings are reset "
              "(the next ingest sets them)")
        return 0
    store = RagStore.open_existing(resolve_store_dir(args.store))
    try:
        targets = [p for path in args.paths for p, _ in store.docs.files(str(Path(path).resolve()))]
        if not targets:
            raise RagfuseError(f"no stored file matches {' '.join(args.paths)}")
        chunks, kv = store.remove(targets)
    finally:
        store.close()
    print(f"removed {len(targets)} files, {chunks} chunks, {kv} KV entries")
    return 0


def gc(args: argparse.Namespace) -> int:
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import resolve_store_dir

    store = RagStore.open_existing(resolve_store_dir(args.store), sweep_kv=False, redis_url=args.redis)
    try:
        report = store.gc(dry_run=args.dry_run, verify=args.verify)
    finally:
        store.close()
    if args.json:
        print(json.dumps({**asdict(report), "bytes": report.bytes}))
        return 0
    verb = "would remove" if report.dry_run else "removed"
    print(f"{verb} {report.unreferenced_entries} KV entries no chunk uses ({_mib(report.unreferenced_bytes)}), "
          f"{len(report.leftover_files)} crash leftovers ({_mib(report.leftover_bytes)})"
          + (f", {len(report.corrupt_entries)} of {report.verified_entries} KV entries failing their checksum "
             f"({_mib(report.corrupt_bytes)})" if args.verify else "")
          + f"; {_mib(report.bytes)} in all")
    if report.redis is not None:
        print(f"  Redis: {verb} {report.redis.unreferenced_entries} KV entries no chunk uses "
              f"({_mib(report.redis.unreferenced_bytes)})"
              + (f", {len(report.redis.corrupt_entries)} of {report.redis.verified_entries} failing their checksum "
                 f"({_mib(report.redis.corrupt_bytes)})" if args.verify else ""))
    for name in report.leftover_files:
        print(f"  leftover {name}")
    for key in report.corrupt_entries + (report.redis.corrupt_entries if report.redis is not None else []):
        print(f"  damaged KV entry {key}")
    return 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
