"""Documents clients upload: written under the store's own ``uploads/`` directory, then ingested.

The server never reads a path a request names: an upload is a file name (checked against a strict
pattern, no directories) plus its bytes. Each stored file is known to clients by an opaque id (a
hash of its stored path), so listings do not reveal the server's directory layout.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ragfuse.documents import SUFFIXES
from ragfuse.engine.atomic_file import write_atomic
from ragfuse.engine.errors import RequestError
from ragfuse.ingest import Ingestor
from ragfuse.rag_store import RagStore
from ragfuse.store_dir import StoreError

from .errors import APIError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")


def document_id(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:16]


def check_name(name: str) -> str:
    """A safe file name for an upload, or a ``RequestError`` saying what is wrong with it."""
    if not NAME.fullmatch(name) or ".." in name:
        raise RequestError(f"bad document name {name[:80]!r}: use letters, digits, '.', '_', '-' (no directories)")
    suffix = Path(name).suffix.lower()
    if suffix not in SUFFIXES:
        raise RequestError(f"unsupported document type {suffix or '(none)'} of {name!r} "
                           f"(one of {', '.join(sorted(SUFFIXES))})")
    return name


class DocumentLibrary:
    """Not thread-safe: one method at a time. ``list``, ``delete`` and ``chunk_tokens`` run on the
    thread that owns the engine and store; ``add`` may run on another, as its store accesses go
    through the ingestor's ``on_engine``."""

    def __init__(self, store: RagStore, ingestor: Ingestor) -> None:
        self.store, self.ingestor = store, ingestor
        self.uploads = (store.root / "uploads").resolve()
        if not store.read_only:  # a read-only store takes no uploads (``add`` refuses them)
            self.uploads.mkdir(parents=True, exist_ok=True)
            self._follow_the_store()
        # where the docstore's records put the uploads: this folder, unless a read-only store was moved
        self.recorded_uploads = Path(store.docs.folder("uploads") or self.uploads)

    def _follow_the_store(self) -> None:
        """Move the records of the uploads to this folder where the store was moved (or copied) here.

        Uploads are recorded by absolute path, so a moved store listed its uploads as not uploaded,
        kept a second record (and chunks) for a new upload of the same name, and its delete left the
        file on disk. A file recorded at both places (uploaded again here before this fix) keeps the
        record made here; the other one goes with its chunks."""
        docs, here = self.store.docs, str(self.uploads)
        before = docs.folder("uploads")
        if before is not None and before != here:
            recorded_here = {p for p, _ in docs.files(here)}
            twice = [p for p, _ in docs.files(before) if here + p[len(before):] in recorded_here]
            if twice:
                self.store.remove(twice)
        docs.move_folder("uploads", here)

    def add(self, files: list[tuple[str, bytes]]) -> dict[str, Any]:
        """Store and ingest ``(name, content)`` pairs; an upload with the name of an earlier one
        replaces it. A file the ingest skips (binary, empty...) is reported and changes nothing: its
        earlier upload, if any, stays on disk and in the store as it was. When every file is skipped
        the request failed (422, with each one's reason): a client checking only the status must
        not take it for stored."""
        if not files:
            raise RequestError("no documents in the request")
        self._check_writable("an upload")
        names = [check_name(n) for n, _ in files]
        if len(set(names)) != len(names):
            raise RequestError("two documents in one request have the same name")
        before = {n: self._read(n) for n in names}
        paths = [self._write(n, data) for n, data in files]
        try:
            report = self.ingestor.ingest(paths)
        except BaseException:  # e.g. no room for the KV: the uploads are put back as they were
            for name, old in before.items():
                self._restore(name, old)
            raise
        skipped = {Path(s.path).name for s in report.skipped}
        for name in skipped:
            self._restore(name, before[name])  # the ingest left the store's record of it alone
        if len(skipped) == len(names):
            raise APIError(422, "nothing ingested: " + "; ".join(f"{Path(s.path).name}: {s.reason}"
                                                                 for s in report.skipped), param="documents")
        wanted = {str(p) for p in paths if p.name not in skipped}
        stored = self.ingestor.on_engine(lambda: self.store.docs.files(str(self.uploads)))
        return {
            "object": "list",
            "data": [self._info(p, n) for p, n in stored if p in wanted],
            "skipped": [{"name": Path(s.path).name, "reason": s.reason} for s in report.skipped],
            "notes": [{"name": Path(n.path).name, "note": n.note} for n in report.notes],
            "ingest": {k: v for k, v in asdict(report).items() if isinstance(v, (int, float))},
        }

    def list(self) -> list[dict[str, Any]]:
        return [self._info(path, n) for path, n in self.store.docs.files()]

    def delete(self, doc_id: str) -> bool:
        for path, _ in self.store.docs.files():
            if document_id(path) == doc_id:
                self._check_writable("removing a document")
                self.store.remove([path])
                if Path(path).parent == self.uploads:
                    Path(path).unlink(missing_ok=True)
                return True
        return False

    def chunk_tokens(self, doc_ids: list[str]) -> list[list[int]]:
        """Token ids of every chunk of the documents ``doc_ids`` (for a backend that stores their KV itself)."""
        wanted = set(doc_ids)
        ids = [i for path, _ in self.store.docs.files() if document_id(path) in wanted
               for i in self.store.docs.chunk_ids(path)]
        return [list(c.token_ids) for c in self.store.docs.chunks(ids).values()]

    def _check_writable(self, what: str) -> None:
        """A read-only store refuses a change with 403: the server may serve it, not change it."""
        try:
            self.store.check_writable(what)
        except StoreError as exc:
            raise APIError(403, str(exc)) from exc

    def _read(self, name: str) -> bytes | None:
        """An earlier upload's bytes, or None."""
        path = self.uploads / name
        return path.read_bytes() if path.is_file() else None

    def _restore(self, name: str, old: bytes | None) -> None:
        """Put an upload back as it was before this request: its earlier bytes, or no file."""
        if old is None:
            (self.uploads / name).unlink(missing_ok=True)
        else:
            self._write(name, old)

    def _write(self, name: str, data: bytes) -> Path:
        """Write atomically (temp file, then rename), so a failed upload never leaves half a file;
        readable by everyone, as the store's other files (a CLI run by another user reads it), and
        the temp file a crash leaves is one ``store gc`` sweeps."""
        target = self.uploads / name
        write_atomic(target, data)
        return target

    def _info(self, path: str, chunks: int) -> dict[str, Any]:
        return {"id": document_id(path), "object": "document", "name": Path(path).name, "chunks": chunks,
                "uploaded": Path(path).parent == self.recorded_uploads}
