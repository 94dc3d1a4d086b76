"""A store of the demo documents (chunks, embeddings, per-chunk KV) ingested with a given engine."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "demo" / "docs"


def ingest_demo(root: Path, engine) -> Path:
    from ragfuse.embeddings import Embedder
    from ragfuse.ingest import Ingestor
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreConfig

    embedder = Embedder()
    cfg = StoreConfig(model="smollm2-135m-instruct", embedding_model=embedder.name, embedding_dim=embedder.dim,
                      index_kind="flat", chunk_tokens=512, chunk_overlap=0)
    rag = RagStore(root, cfg)
    report = Ingestor(rag, engine, embedder, progress=False).ingest([DEMO])
    assert report.kv_computed >= 3
    rag.close()
    return root


@functools.cache
def connector_store() -> str:
    """The demo store ingested with the engine the connectors share on CPU (so the same KV keys), made once
    per test process in a temporary directory."""
    from ragfuse.app import shared_pipeline

    engine = shared_pipeline(None, device="cpu").engine
    root = Path(tempfile.mkdtemp(prefix="ragfuse-connectors-"))
    atexit.register(shutil.rmtree, root, True)
    return str(ingest_demo(root, engine))
