"""What the demo does, without the UI: ingest documents into a store, answer from it with fused KV
streaming, and measure full prefill's TTFT on the same question for comparison.

Kept apart from the Gradio layout so it can be driven (and tested) without a browser. One backend
serves every browser tab. The engine is single-threaded and the store's SQLite connection belongs to
the thread that opened it, while Gradio runs each event on a worker thread of its own: so the
pipeline is opened, and every call into it made, on one dedicated thread.
"""

from __future__ import annotations

import contextvars
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ragfuse.app import DEFAULT_MODEL, open_pipeline
from ragfuse.documents import DEFAULT_MAX_BYTES, SUFFIXES
from ragfuse.engine import RagfuseError, RequestError, SamplingParams
from ragfuse.ingest import Ingestor, IngestReport
from ragfuse.pipeline import AskResult, RagPipeline
from ragfuse.store_dir import StoreConfig, resolve_store_dir

FUSED_MODES = ("fuse", "reuse", "prefix")  # what the demo offers; full prefill is the comparison
T = TypeVar("T")
_DONE = object()


@dataclass
class Turn:
    """One question of the session: the fused answer, and full prefill of the same prompt (stopped at its
    first token: only its TTFT is compared)."""

    question: str
    fused: AskResult
    full: AskResult

    @property
    def speedup(self) -> float:
        return self.full.ttft_s / self.fused.ttft_s if self.fused.ttft_s > 0 else float("nan")


def ensure_store(root: Path, model: str) -> None:
    """A new store directory gets ``ragfuse ingest``'s default settings, so the demo can start empty."""
    if StoreConfig.load(root) is not None:
        return
    from ragfuse.embeddings import DEFAULT_EMBEDDING_MODEL, Embedder
    from ragfuse.rag_store import RagStore

    embedder = Embedder(DEFAULT_EMBEDDING_MODEL)
    config = StoreConfig(model=model, embedding_model=DEFAULT_EMBEDDING_MODEL, embedding_dim=embedder.dim,
                         index_kind="flat", chunk_tokens=512, chunk_overlap=0)
    RagStore(root, config).close()


class DemoBackend:
    def __init__(self, store: str | None, model: str = DEFAULT_MODEL, device: str = "auto", dtype: str | None = None,
                 docs_dir: str | Path | None = None,
                 open_pipe: Callable[[Path], RagPipeline] | None = None, gate: bool = True) -> None:
        """``docs_dir``: documents offered for picking (the repository's demo documents by default).
        ``open_pipe``: how to open the pipeline over the store directory (default: ``open_pipeline``,
        with the accuracy gate's r* calibration unless ``gate`` is False)."""
        root = resolve_store_dir(store)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragfuse-demo")
        ensure_store(root, model)
        opener = open_pipe or (lambda r: open_pipeline(str(r), model, device, dtype, gate=gate))
        self.pipe: RagPipeline = self._call(opener, root)
        self.uploads = root / "uploads"
        self.docs_dir = Path(docs_dir) if docs_dir else None

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the pipeline's thread, in the caller's context (Gradio's progress tracker
        lives in a context variable)."""
        return self._thread.submit(contextvars.copy_context().run, fn, *args).result()

    def close(self) -> None:
        self._call(self.pipe.store.close)
        self._thread.shutdown()

    # ---- documents ---------------------------------------------------------------------------

    def sample_docs(self) -> list[str]:
        """Names of the documents that can be picked (files of a supported kind directly in ``docs_dir``)."""
        if self.docs_dir is None or not self.docs_dir.is_dir():
            return []
        return sorted(p.name for p in self.docs_dir.iterdir()
                      if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in SUFFIXES)

    def stored_files(self) -> list[tuple[str, int]]:
        """(file name, chunks) of what the store holds."""
        return [(Path(path).name, n) for path, n in self._call(self.pipe.store.docs.files)]

    def ingest(self, picked: list[str], uploaded: list[str]) -> IngestReport:
        """Ingest picked sample documents and uploaded files (copied into the store's ``uploads/``
        first, under their own names: uploading a file again replaces its chunks, not doubles them).
        An upload the ingest skips (binary, empty...) does not stay there: its earlier upload, if
        any, is put back, as the server does."""
        self.pipe.store.check_writable("an ingest")  # a read-only store: said before anything is copied
        unknown = [name for name in picked if name not in self.sample_docs()]
        if unknown:
            raise RequestError(f"not a demo document: {', '.join(unknown)}")
        paths = [self.docs_dir / name for name in picked] if self.docs_dir else []
        names = [Path(src).name for src in uploaded]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # copied under one name, the last would silently replace the others
            raise RequestError(f"uploads with the same name: {', '.join(twice)}; rename all but one")
        for src in uploaded:
            size = Path(src).stat().st_size if Path(src).is_file() else None
            if size is None:
                raise RequestError(f"no uploaded file {Path(src).name}")
            if size > DEFAULT_MAX_BYTES:  # refused before it is copied
                raise RequestError(f"{Path(src).name} is larger than {DEFAULT_MAX_BYTES >> 20} MB")
        if not paths and not uploaded:
            raise RequestError("pick or upload at least one document")
        if uploaded:
            self.uploads.mkdir(parents=True, exist_ok=True)
        earlier: dict[Path, bytes | None] = {}  # each upload's path -> what was there before
        for src in uploaded:
            dest = self.uploads / Path(src).name
            earlier[dest] = dest.read_bytes() if dest.is_file() else None
            shutil.copyfile(src, dest)
            paths.append(dest)
        ingestor = Ingestor(self.pipe.store, self.pipe.engine, self.pipe.retriever.embedder)
        try:
            report = self._call(ingestor.ingest, paths)
        except BaseException:
            _put_back(earlier)
            raise
        skipped = {Path(s.path).name for s in report.skipped}
        _put_back({dest: old for dest, old in earlier.items() if dest.name in skipped})
        return report

    # ---- questions ---------------------------------------------------------------------------

    def ask(self, question: str, mode: str = "fuse", top_k: int = 3, max_tokens: int = 64
            ) -> Iterator[str | AskResult | Turn]:
        """Yield the fused answer's text as it grows, its ``AskResult`` once it is done (the page shows
        its TTFT while full prefill runs), then the ``Turn`` (with full prefill's TTFT measured right
        after, on the same question and the same retrieved chunks)."""
        steps = self._answer(question, mode, top_k, max_tokens)
        try:
            while (item := self._call(next, steps, _DONE)) is not _DONE:
                yield item
        finally:  # a page that goes away mid-answer: the request is aborted, on the pipeline's thread
            self._call(steps.close)

    def _answer(self, question: str, mode: str, top_k: int, max_tokens: int) -> Iterator[str | AskResult | Turn]:
        if not question.strip():
            raise RequestError("the question is empty")
        if mode not in FUSED_MODES:
            raise RequestError(f"unknown mode {mode!r} ({', '.join(FUSED_MODES)})")
        if not self.pipe.store.docs.files():
            raise RagfuseError("the store holds no documents yet: pick or upload some and ingest them")
        result: AskResult | None = None
        for item in self.pipe.stream(question, mode=mode, top_k=top_k, params=SamplingParams(max_tokens=max_tokens)):
            if isinstance(item, AskResult):
                result = item
            else:
                yield item.text
        assert result is not None
        yield result
        # TTFT needs only the first token: full prefill of the same prompt, stopped there
        full = self.pipe.ask(question, mode="full", top_k=top_k, params=SamplingParams(max_tokens=1))
        yield Turn(question, result, full)


def _put_back(earlier: dict[Path, bytes | None]) -> None:
    """Each upload's path as it was before: its earlier bytes, or no file."""
    for dest, old in earlier.items():
        if old is None:
            dest.unlink(missing_ok=True)
        else:
            dest.write_bytes(old)
