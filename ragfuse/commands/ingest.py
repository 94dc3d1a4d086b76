"""``ragfuse ingest PATH...``: chunk, embed and precompute the KV of files into a store."""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from ragfuse.chunking import DEFAULT_CHUNK_TOKENS
from ragfuse.commands.generate import add_model_args, positive_int
from ragfuse.embeddings import DEFAULT_EMBEDDING_MODEL
from ragfuse.store_dir import CHUNK_KV_CONTEXTS, StoreConfig


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store directory (default: $RAGFUSE_STORE, else a per-user data dir)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ingest", help="add files and directories to a store (chunks, embeddings, per-chunk KV)")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".txt .md .html .pdf .json .jsonl files or directories")
    add_store_arg(p)
    # the store's settings: each one not given is the store's (a new store's default in brackets), so
    # adding files to a store needs none of them again; one given otherwise than the store has is refused
    add_model_args(p, store=True)
    p.add_argument("--chunk-tokens", type=positive_int, help="chunk size in the model's tokens [512]")
    p.add_argument("--chunk-overlap", type=int, metavar="N",
                   help="at most N tokens shared by consecutive chunks: whole paragraphs, lines or words of up "
                        "to N tokens carried into the next [0]")
    p.add_argument("--index", choices=["flat", "ivf", "hnsw"],
                   help="faiss index: exact [flat] or approximate for large corpora")
    p.add_argument("--embedding-model", help="packaged default [all-MiniLM-L6-v2] or a local directory")
    p.add_argument("--text-field", default="text",
                   help="field of JSON/JSONL records holding text; `a[].b` walks lists (e.g. ctxs[].text)")
    p.add_argument("--title-field", default="title", help="field put above the text when present ('' for none)")
    p.add_argument("--max-file-mb", type=float, default=50.0, help="skip files larger than this")
    p.add_argument("--encoding", type=_encoding, metavar="NAME",
                   help="read text files that are not valid UTF-8 in this encoding (e.g. cp1252, latin-1); "
                        "without it they are skipped (UTF-8 is always tried first)")
    p.add_argument("--no-kv", action="store_true", help="do not precompute per-chunk KV")
    p.add_argument("--chunk-kv-context", choices=CHUNK_KV_CONTEXTS, default=None,
                   help="compute each chunk's KV after the RAG prompt's instruction prefix (closer to full "
                        "prefill) [instruction] or alone (CacheBlend's way)")
    p.add_argument("--kv-capacity-gb", type=float, default=200.0,
                   help="capacity of the store's disk KV tier for this run: with less than the store holds, "
                   "the least recently used KV (any file's) is evicted, and the report counts it")
    p.add_argument("--redis", metavar="URL", help="also keep KV in this Redis server (remote tier)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragfuse.documents import SUFFIXES, find_files
    from ragfuse.embeddings import Embedder
    from ragfuse.engine import EngineConfig, LLMEngine
    from ragfuse.engine.errors import ModelError, RagfuseError
    from ragfuse.engine.kvstore import check_redis
    from ragfuse.ingest import Ingestor
    from ragfuse.rag_store import RagStore, check_store_folder_writable
    from ragfuse.store_dir import check_chunking, resolve_store_dir

    # a mistyped path is the user's mistake, told before anything loads or a store is made
    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        raise RagfuseError(f"no such file or directory: {', '.join(missing)} (nothing was ingested)")
    check_redis(args.redis)
    root = resolve_store_dir(args.store)
    check_store_folder_writable(root, "an ingest")  # a read-only store: told before the model loads
    existing = StoreConfig.load(root)
    if existing is None and not find_files(args.paths).files:  # (for a store, an emptied folder removes its files)
        raise RagfuseError(f"no documents in {', '.join(args.paths)}: ingest reads "
                           f"{' '.join(sorted(SUFFIXES))} files (nothing was ingested, no store made)")
    settings = _settings(args, existing)
    # the user's mistakes are told before a model loads (the store checks again, with the embedder's dim)
    check_chunking(settings["chunk_tokens"], settings["chunk_overlap"])
    if existing is not None:
        existing.check_compatible(StoreConfig(embedding_dim=existing.embedding_dim, **settings))
    engine = LLMEngine(EngineConfig(model=settings["model"], device=args.device, dtype=args.dtype))
    if engine.tokenizer is None:  # before the store is opened: a failed ingest leaves no store behind
        raise ModelError(f"model {settings['model']} has no tokenizer (tokenizer.json or tokenizer.model beside "
                         "its config.json): ingest needs one to cut documents into the model's tokens")
    embedder = Embedder(settings["embedding_model"])
    config = StoreConfig(embedding_dim=embedder.dim, **settings)
    store = RagStore(root, config, kv_capacity_gb=args.kv_capacity_gb, redis_url=args.redis)
    try:
        ingestor = Ingestor(store, engine, embedder, precompute_kv=not args.no_kv,
                            max_bytes=int(args.max_file_mb * 2**20), text_field=args.text_field,
                            title_field=args.title_field or None, encoding=args.encoding)
        report = ingestor.ingest(args.paths)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what to do next, before the CLI's one-line reason
        sys.stderr.write("ragfuse ingest: stopped; the same command again adds what is missing, reusing the "
                         "chunk KV already stored\n")
        raise
    finally:
        store.close()
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        for s in report.skipped:
            print(f"skipped {s.path}: {s.reason}")
        for n in report.notes:
            print(f"note {n.path}: {n.note}")
        for path in report.removed_files:
            print(f"removed {path}: no longer in its folder")
        print(f"{len(report.new_files)} new, {len(report.replaced_files)} changed, "
              f"{len(report.removed_files)} removed, {len(report.unchanged_files)} unchanged, "
              f"{len(report.skipped)} skipped files; "
              f"+{report.chunks_added} -{report.chunks_removed} chunks ({report.tokens} tokens); "
              f"KV computed {report.kv_computed}, reused {report.kv_reused}, removed {report.kv_removed}; "
              f"{report.seconds:.1f} s (KV {report.kv_seconds:.1f} s) -> {store.root}")
        if report.kv_evicted:
            print(f"note: the KV tier evicted {report.kv_evicted} stored entries (least recently used, any "
                  f"file's) to stay within --kv-capacity-gb {args.kv_capacity_gb:g}; they are recomputed when asked")
    if report.skipped and not (report.new_files or report.replaced_files or report.unchanged_files):
        # scripts check the status: an ingest that read no file of those it was given did not work
        sys.stderr.write("ragfuse: error: nothing ingested: every file was skipped (the reasons are above)\n")
        return 2
    return 0


def _encoding(name: str) -> str:
    """``--encoding``: a codec Python knows, by its canonical name (the name goes into the content hash)."""
    try:
        return codecs.lookup(name).name
    except LookupError:
        raise argparse.ArgumentTypeError(f"unknown encoding {name!r}") from None


# a new store's settings where the command line leaves them out (embedding_dim: the embedder's)
NEW_STORE = {"model": "smollm2-135m-instruct", "embedding_model": DEFAULT_EMBEDDING_MODEL, "index_kind": "flat",
             "chunk_tokens": DEFAULT_CHUNK_TOKENS, "chunk_overlap": 0, "chunk_kv_context": "instruction"}


def _settings(args: argparse.Namespace, existing: StoreConfig | None) -> dict[str, Any]:
    """The store settings this ingest runs with: each one given on the command line, else the
    existing store's, else a new store's default. Only a setting given otherwise than the store has
    is then refused (``StoreConfig.check_compatible``): adding files to a store made with, say,
    ``--chunk-tokens 128`` must not need the option again, nor be told to empty the store."""
    given = {"model": args.model, "embedding_model": args.embedding_model, "index_kind": args.index,
             "chunk_tokens": args.chunk_tokens, "chunk_overlap": args.chunk_overlap,
             "chunk_kv_context": args.chunk_kv_context}
    base = asdict(existing) if existing is not None else NEW_STORE
    return {k: v if v is not None else base[k] for k, v in given.items()}
