"""A passage a caller brings to the pipeline, as opposed to one the pipeline retrieves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

CHUNK_ID = "chunk_id"  # the metadata key under which a framework's document or node names its stored chunk


@dataclass(frozen=True)
class Passage:
    """A passage a caller brings (a framework's retrieved document): a stored chunk's id, its text, or both.

    Its identity is its content: the KV store is keyed by the passage's tokens, so text that was
    ingested brings its stored KV whichever retriever found it, and text that was not is prefilled.
    """

    text: str = ""
    id: int | None = None
    source: str = ""
    score: float | None = None  # the caller's retriever's, reported with the answer's sources as ``ask``'s are

    @staticmethod
    def score_of(value: object) -> float | None:
        """A retriever's score as a float, or None where it gave none (or something that is not a number)."""
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
