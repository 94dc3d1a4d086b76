"""``ragfuse search QUERY``: the top-k chunks of a store."""

from __future__ import annotations

import argparse
import json

from ragfuse.commands.generate import positive_int
from ragfuse.commands.ingest import add_store_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="retrieve the chunks nearest to QUERY")
    p.add_argument("query")
    add_store_arg(p)
    p.add_argument("--top-k", type=positive_int, default=5, help="chunks to return, nearest first")
    p.add_argument("--json", action="store_true", help="one JSON object: {query, sources: [{id, text, source, score}]}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.rag_store import RagStore
    from ragfuse.retrieval import Retriever
    from ragfuse.store_dir import resolve_store_dir

    if not args.query.strip():
        raise RagfuseError("QUERY is empty")
    store = RagStore.open_existing(resolve_store_dir(args.store))
    try:
        results = Retriever(store).search(args.query, args.top_k)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"query": args.query, "sources": [r.as_dict() for r in results]}))
        return 0
    for rank, r in enumerate(results, 1):
        text = " ".join(r.text.split())
        print(f"{rank}. [{r.score:.3f}] #{r.id} {r.source}\n   {text[:300]}{'...' if len(text) > 300 else ''}")
    return 0
