"""``ragfuse ingest PATH...``: chunk, embed and precompute the KV of files into a store."""

from __future__ import annotations

import argparse
import json

from ragfuse.commands.generate import add_model_args, positive_int
from ragfuse.store_dir import CHUNK_KV_CONTEXTS


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="store directory (default: $RAGFUSE_STORE, else a per-user data dir)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ingest", help="add files and directories to a store (chunks, embeddings, per-chunk KV)")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".txt .md .html .pdf .json .jsonl files or directories")
    add_store_arg(p)
    add_model_args(p)
    p.add_argument("--chunk-tokens", type=positive_int, default=512, help="chunk size in the model's tokens")
    p.add_argument("--chunk-overlap", type=int, default=0, help="tokens shared by consecutive chunks")
    p.add_argument("--index", choices=["flat", "ivf", "hnsw"], default="flat",
                   help="faiss index: exact (default) or approximate for large corpora")
    p.add_argument("--embedding-model", default="all-MiniLM-L6-v2", help="packaged default or a local directory")
    p.add_argument("--text-field", default="text",
                   help="field of JSON/JSONL records holding text; `a[].b` walks lists (e.g. ctxs[].text)")
    p.add_argument("--title-field", default="title", help="field put above the text when present ('' for none)")
    p.add_argument("--max-file-mb", type=float, default=50.0, help="skip files larger than this")
    p.add_argument("--no-kv", action="store_true", help="do not precompute per-chunk KV")
    p.add_argument("--chunk-kv-context", choices=CHUNK_KV_CONTEXTS, default=None,
                   help="compute each chunk's KV after the RAG prompt's instruction prefix (a new store's "
                        "default: closer to full prefill) or alone (CacheBlend's way); default: the store's")
    p.add_argument("--kv-capacity-gb", type=float, default=200.0, help="capacity of the disk KV tier")
    p.add_argument("--redis", metavar="URL", help="also keep KV in this Redis server (remote tier)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ragfuse.embeddings import Embedder
    from ragfuse.engine import EngineConfig, LLMEngine
    from ragfuse.engine.errors import ModelError
    from ragfuse.ingest import Ingestor
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreConfig, check_chunking, resolve_store_dir

    check_chunking(args.chunk_tokens, args.chunk_overlap)  # before a model loads (StoreConfig checks again)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    if engine.tokenizer is None:  # before the store is opened: a failed ingest leaves no store behind
        raise ModelError(f"model {args.model} has no tokenizer (tokenizer.json or tokenizer.model beside its "
                         "config.json): ingest needs one to cut documents into the model's tokens")
    embedder = Embedder(args.embedding_model)
    root = resolve_store_dir(args.store)
    existing = StoreConfig.load(root)
    context = args.chunk_kv_context or (existing.chunk_kv_context if existing else "instruction")
    config = StoreConfig(model=args.model, embedding_model=args.embedding_model, embedding_dim=embedder.dim,
                         index_kind=args.index, chunk_tokens=args.chunk_tokens, chunk_overlap=args.chunk_overlap,
                         chunk_kv_context=context)
    store = RagStore(root, config, kv_capacity_gb=args.kv_capacity_gb, redis_url=args.redis)
    try:
        ingestor = Ingestor(store, engine, embedder, precompute_kv=not args.no_kv,
                            max_bytes=int(args.max_file_mb * 2**20), text_field=args.text_field,
                            title_field=args.title_field or None)
        report = ingestor.ingest(args.paths)
    finally:
        store.close()
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        for s in report.skipped:
            print(f"skipped {s.path}: {s.reason}")
        print(f"{len(report.new_files)} new, {len(report.replaced_files)} changed, "
              f"{len(report.unchanged_files)} unchanged, {len(report.skipped)} skipped files; "
              f"+{report.chunks_added} -{report.chunks_removed} chunks ({report.tokens} tokens); "
              f"KV computed {report.kv_computed}, reused {report.kv_reused}, removed {report.kv_removed}; "
              f"{report.seconds:.1f} s (KV {report.kv_seconds:.1f} s) -> {store.root}")
    return 0
