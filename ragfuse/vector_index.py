"""The faiss index over chunk embeddings: exact by default, IVF or HNSW for large corpora.

The docstore holds every embedding, so the index is a derived artifact: saved with the docstore
generation it was built from (its ``generation``), and rebuilt from the docstore when the two disagree
(e.g. a crash between committing chunks and saving the index, or another process's commit since it
was loaded), instead of silently serving stale ids. The exact index is
updated in place; IVF lists and HNSW graphs are best built from the whole corpus (and HNSW cannot
drop nodes), so those are rebuilt after an ingest that changes the corpus.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import faiss
import numpy as np

from ragfuse.engine.errors import RagfuseError
from ragfuse.store_dir import StoreError

INDEX_KINDS = ("flat", "ivf", "hnsw")


class VectorIndex:
    def __init__(self, dim: int, kind: str = "flat", num_vectors_hint: int = 0, generation: int = 0) -> None:
        """``generation``: the docstore generation whose chunks the index holds (kept current by its owner)."""
        if kind not in INDEX_KINDS:
            raise RagfuseError(f"unknown index kind {kind!r} ({', '.join(INDEX_KINDS)})")
        self.dim, self.kind, self.generation = dim, kind, generation
        self.index = faiss.IndexIDMap2(self._base(num_vectors_hint))

    def _base(self, n: int) -> faiss.Index:
        if self.kind == "hnsw":
            return faiss.IndexHNSWFlat(self.dim, 32, faiss.METRIC_INNER_PRODUCT)
        if self.kind == "ivf":
            nlist = max(1, int(math.sqrt(max(n, 1))))  # the usual ~sqrt(N) lists
            return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        return faiss.IndexFlatIP(self.dim)

    @classmethod
    def build(cls, dim: int, kind: str, ids: np.ndarray, vectors: np.ndarray, generation: int) -> VectorIndex:
        """A fresh index over all vectors (IVF is trained on them), those of docstore ``generation``."""
        idx = cls(dim, kind, len(ids), generation)
        base = faiss.downcast_index(idx.index.index)
        if kind == "ivf" and len(ids):
            base.train(vectors)
            base.nprobe = max(1, base.nlist // 8)
        idx.add(ids, vectors)
        return idx

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids):
            self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))

    def remove(self, ids: np.ndarray) -> None:
        if len(ids):
            self.index.remove_ids(ids.astype(np.int64))

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores (cosine) and ids of the ``k`` nearest, best first; ids of -1 mean fewer exist."""
        scores, ids = self.index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k)
        return scores[0], ids[0]

    def save(self, path: Path) -> None:
        """Write the index, then its stamp (generation and kind): a stamp older than the file only
        makes the next open rebuild. One saver at a time (the caller holds the store's index lock).

        A write that fails (a full disk: faiss reports it as a RuntimeError) removes its temp file and
        raises a StoreError; the saved index stays as it was, stale, so it is rebuilt when next opened.
        """
        tmp, stamp = path.with_suffix(".tmp"), path.with_suffix(".json")
        try:
            faiss.write_index(self.index, str(tmp))
            os.replace(tmp, path)
            tmp.write_text(json.dumps({"generation": self.generation, "kind": self.kind}))
            os.replace(tmp, stamp)
        except (OSError, RuntimeError) as exc:
            tmp.unlink(missing_ok=True)
            reason = exc.strerror if isinstance(exc, OSError) else str(exc).rsplit("failed: ", 1)[-1]
            raise StoreError(f"cannot save the vector index {path} ({reason}); the docstore keeps every chunk, "
                             "and the index is rebuilt from it when the store is next opened") from exc

    @classmethod
    def load(cls, path: Path, dim: int, kind: str) -> VectorIndex | None:
        """The saved index (its ``generation`` as stamped) if it is readable and of ``kind`` and ``dim``,
        else None (rebuild it)."""
        try:
            info = json.loads(path.with_suffix(".json").read_text())
            if info["kind"] != kind:
                return None
            idx = cls.__new__(cls)
            idx.dim, idx.kind, idx.generation = dim, kind, int(info["generation"])
            idx.index = faiss.read_index(str(path))
            return idx if idx.index.d == dim else None
        except (OSError, ValueError, KeyError, TypeError, RuntimeError):
            return None
