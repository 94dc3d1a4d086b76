"""Reading files into documents: plain text, Markdown, HTML, PDF, and JSON/JSONL records.

A file that cannot be read as text (empty, binary, undecodable, too large, a PDF or JSON file that
cannot be parsed, a record file without the asked-for text field, or a name that is not UTF-8) is
reported by name with the reason and skipped; it never stops an ingest. Text is UTF-8 unless the caller
names a fallback encoding for files that are not (Latin-1 and Windows-1252 files are common in old
document sets): guessing one from the bytes is unreliable on short files (charset detectors read a
Latin-1 sentence as Baltic cp775 and KOI8-R as Shift-JIS), and a wrong guess would be stored silently.
What was read only in part (records without the text field) or through the fallback is noted by file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst"}
HTML_SUFFIXES = {".html", ".htm"}
RECORD_SUFFIXES = {".json", ".jsonl"}
SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES | RECORD_SUFFIXES | {".pdf"}
DEFAULT_MAX_BYTES = 50 << 20
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str, surrogates are always lone (pairs are joined)


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # file path, plus "#record" for documents taken from a record file


@dataclass
class LoadedFile:
    path: str
    content_hash: str
    documents: list[Document] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what of it was not read as asked, for the report


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class FileNote:
    """Something about a file that was ingested, but not quite as asked (read in part, or through
    the fallback encoding)."""

    path: str
    note: str


class _Unreadable(Exception):
    pass


@dataclass
class FoundFiles:
    files: list[Path]  # resolved, each once
    missing: list[SkippedFile]
    # the real folders the walk went through (a linked folder's target among them): a folder ingest
    # mirrors each, since its files are stored by their resolved paths
    folders: list[Path]
    # each path given that exists, resolved (an ingest root), with the resolved files found under it:
    # the store records which roots reached a file, so one that no root reaches any more (its linked
    # folder removed or re-pointed) can go, and one another root still reaches stays
    roots: dict[Path, list[Path]]
    # roots whose walk met a folder it could not list (permissions, a folder removed meanwhile): what
    # they reach is not known in full, so nothing is removed or recorded for them as out of their reach
    incomplete: set[Path] = field(default_factory=set)


def find_files(paths: Iterable[str | Path], exclude: Path | None = None) -> FoundFiles:
    """Expand directories (recursively, supported suffixes only); name paths that do not exist.
    Roots that overlap (``docs docs/sub``, or a folder one root reaches through a link and another
    names) share one listing of each folder: each file is listed, and read, once. A walk does not
    enter ``exclude`` (the store's own folder, kept inside the documents: its settings and a server's
    uploads are not documents of this ingest)."""
    missing: list[SkippedFile] = []
    folders: dict[str, None] = {}
    roots: dict[Path, dict[Path, None]] = {}
    incomplete: set[Path] = set()
    lister = _FolderLister(os.path.realpath(exclude) if exclude is not None else None)
    for p in map(Path, paths):
        if p.is_dir():
            found, walked, complete = lister.walk(p)
            folders.update(walked)
            if not complete:
                incomplete.add(p.resolve())
        elif p.is_file():
            found = [p]
        else:
            missing.append(SkippedFile(_display_path(p), "no such file or directory"))
            continue
        roots.setdefault(p.resolve(), {}).update(dict.fromkeys(f.resolve() for f in found))
    missing += [SkippedFile(_display_path(e.filename), f"cannot list folder: {e.strerror or e}")
                for e in lister.unlisted]
    files = dict.fromkeys(f for under in roots.values() for f in under)  # a file two roots reach: once
    return FoundFiles(list(files), missing, [Path(f) for f in folders],
                      {root: list(under) for root, under in roots.items()}, incomplete)


class _FolderLister:
    """Walks the roots of one ``find_files``, listing each real folder once across them all.

    Linked folders are followed (a docs tree assembled from links is common), each real folder once
    per root: a link back up the tree would otherwise recurse without end. Each root is walked whole,
    through folders another root went through too, since what a root reaches is recorded per root;
    but such a folder's listing is the one taken before, so overlapping roots cost no second pass
    over the disk. Hidden files and folders are left out."""

    def __init__(self, exclude: str | None = None) -> None:
        self._exclude = exclude  # a real folder not to enter
        # by real path: the supported files' and the visible subfolders' names, None if it cannot be listed
        self._listings: dict[str, tuple[list[str], list[str]] | None] = {}
        # the errors of the folders that could not be listed, each once, which ``os.walk`` would
        # otherwise pass over in silence
        self.unlisted: list[OSError] = []

    def walk(self, root: Path) -> tuple[list[Path], dict[str, None], bool]:
        """The supported files below ``root`` (by their paths through ``root``, sorted), the real
        folders walked, and whether every one of them could be listed."""
        found: list[Path] = []
        seen: dict[str, None] = {}
        complete = True
        todo = [str(root)]
        while todo:
            folder = todo.pop()
            real = os.path.realpath(folder)
            if real in seen or real == self._exclude:
                continue
            seen[real] = None
            if real not in self._listings:
                self._listings[real] = self._list(folder)
            listing = self._listings[real]
            if listing is None:
                complete = False
                continue
            names, subfolders = listing
            found += [Path(folder, n) for n in names]
            todo += [os.path.join(folder, d) for d in reversed(subfolders)]
        return sorted(found), seen, complete

    def _list(self, folder: str) -> tuple[list[str], list[str]] | None:
        """``folder``'s supported files and visible subfolders (linked ones included), by name; None,
        with the error kept, where it cannot be listed."""
        names: list[str] = []
        subfolders: list[str] = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    if _is_folder(entry):
                        subfolders.append(entry.name)
                    elif Path(entry.name).suffix.lower() in SUFFIXES and os.path.isfile(entry.path):
                        names.append(entry.name)
        except OSError as exc:
            self.unlisted.append(exc)
            return None
        return names, sorted(subfolders)


def _is_folder(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a folder or a link to one (a link to nothing is neither)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def load_file(path: Path, max_bytes: int = DEFAULT_MAX_BYTES, text_field: str = "text",
              title_field: str | None = "title", encoding: str | None = None) -> LoadedFile | SkippedFile:
    """Read ``path`` into documents, or say why it was skipped. ``encoding``: how to read a text
    file that is not valid UTF-8 (by default it is skipped)."""
    if not utf8_name(path):
        return SkippedFile(_display_path(path), "file name is not valid UTF-8 (rename the file)")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            return SkippedFile(str(path), f"larger than the limit ({size} > {max_bytes} bytes)")
        data = path.read_bytes()
        if not data.strip():
            return SkippedFile(str(path), "empty")
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            return SkippedFile(str(path), f"unsupported file type {suffix or '(none)'}")
        notes: list[str] = []
        used: str | None = None
        if suffix == ".pdf":
            docs = [Document(_pdf_text(data), str(path))]
        else:
            text, used = _decode(data, encoding)
            if used is not None:
                notes.append(f"not UTF-8: read as {used}")
            if suffix in HTML_SUFFIXES:
                docs = [Document(_html_text(text), str(path))]
            elif suffix in RECORD_SUFFIXES:
                docs, without = _record_documents(text, suffix, str(path), text_field, title_field)
                if without:
                    records = "record" if without == 1 else "records"
                    notes.append(f"left out {without} {records} without a string field {text_field!r}")
            else:
                docs = [Document(text, str(path))]
    except OSError as exc:
        return SkippedFile(str(path), f"unreadable: {exc.strerror}")
    except _Unreadable as exc:
        return SkippedFile(str(path), str(exc))
    # a lone surrogate (JSON's escape of half an emoji, cut off in scraped text) is taken by neither the
    # tokenizer nor SQLite: one such character used to end the whole ingest with a TypeError
    docs = [Document(_LONE_SURROGATE.sub("\ufffd", d.text), d.source) for d in docs if d.text.strip()]
    if not docs:
        return SkippedFile(str(path), "no text in it")
    digest = hashlib.sha256(data)
    if used is not None:  # read through the fallback: another fallback reads other text from the same bytes
        digest.update(b"\0encoding=" + used.encode())
    if suffix in RECORD_SUFFIXES:  # which fields were read is part of what was ingested: a re-ingest
        # asking for other fields must read the file again, not find it unchanged
        digest.update(b"\0" + json.dumps([text_field, title_field]).encode())
    return LoadedFile(str(path), digest.hexdigest(), docs, notes)


def utf8_name(path: Path) -> bool:
    """Whether ``path`` is valid UTF-8. Python hands any other name over with surrogate escapes,
    which the docstore (SQLite, UTF-8) cannot hold, and which a UTF-8 terminal cannot print."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _display_path(path: str | Path) -> str:
    """``path`` as printable UTF-8 text: bytes of the name that are not UTF-8 appear as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _decode(data: bytes, fallback: str | None) -> tuple[str, str | None]:
    """The text, and the fallback encoding where it took that to read it (None: UTF-8)."""
    if b"\0" in data[:8192]:
        raise _Unreadable("binary (NUL bytes)")
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        if fallback is None:
            raise _Unreadable(f"not UTF-8 text ({exc.reason} at byte {exc.start}): convert it to UTF-8, or name "
                              "its encoding (`ragfuse ingest --encoding`, e.g. cp1252)") from exc
        utf8_error = exc
    try:
        return data.decode(fallback), fallback
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"neither UTF-8 ({utf8_error.reason} at byte {utf8_error.start}) nor {fallback} "
                          f"({exc.reason} at byte {exc.start})") from exc


def _html_text(html: str) -> str:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(["script", "style", "noscript"]):
        tag.decompose()
    return "\n".join(line.strip() for line in soup.get_text("\n").splitlines() if line.strip())


def _pdf_text(data: bytes) -> str:
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        return "\n\n".join(page.extract_text() or "" for page in reader.pages)
    except Exception as exc:
        # a damaged file makes pypdf raise its own errors (PdfReadError; LimitReachedError for an object
        # loop or a stream that inflates past its limits), DependencyError for an encryption it cannot
        # read, and built-in ones (ValueError, KeyError, AttributeError, RecursionError): all of them
        # mean this one file cannot be read
        raise _Unreadable(f"unreadable PDF ({str(exc) or type(exc).__name__})") from exc


def _record_documents(text: str, suffix: str, source: str, text_field: str,
                      title_field: str | None) -> tuple[list[Document], int]:
    """Documents from JSON (a list of records, or one record) or JSONL (one record a line), and how
    many records gave none (reported: a file of records read in part must not look read whole).

    ``text_field`` is a dotted path; ``[]`` after a name walks a list, so ``ctxs[].text`` takes the
    ``text`` of every element of each record's ``ctxs``. When the object holding the text also has
    ``title_field``, the title heads the document (it is often what a question names).
    """
    try:
        if suffix == ".jsonl":
            # records end at "\n" only: str.splitlines also cuts at characters JSON strings hold
            # unescaped (U+2028, U+0085, ...), which would break a record in two
            records = [_json(record, n) for n, record in enumerate(text.split("\n"), 1) if record.strip()]
        else:
            loaded = _json(text)
            records = loaded if isinstance(loaded, list) else [loaded]
    except RecursionError as exc:  # the decoder recurses once per level of nesting
        raise _Unreadable("JSON nested too deeply to read") from exc
    docs: list[Document] = []
    without = 0
    for i, rec in enumerate(records):
        before = len(docs)
        for where, holder, value in _walk(rec, text_field.split("."), f"#{i}"):
            if not isinstance(value, str):
                continue
            title = holder.get(title_field) if title_field and isinstance(holder, dict) else None
            docs.append(Document(f"{title}\n{value}" if isinstance(title, str) and title else value, source + where))
        without += len(docs) == before
    if not docs:
        raise _Unreadable(f"no record has a string field {text_field!r} (choose one with --text-field)")
    return docs, without


def _json(doc: str, first_line: int = 1) -> Any:
    """``doc`` parsed; invalid JSON is unreadable, named by the file's line (``doc`` starts at ``first_line``)."""
    try:
        return json.loads(doc, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise _Unreadable(f"invalid JSON ({exc.msg} at line {first_line + exc.lineno - 1})") from exc


def _parse_int(digits: str) -> int | float:
    """A JSON integer; one too long for ``int`` (Python refuses more than 4300 digits) as a float
    (inf), as JSON reads a number too large for a float: only the text and title fields are read,
    and a huge number elsewhere in a record must not cost the file, or stop the ingest."""
    try:
        return int(digits)
    except ValueError:
        return float(digits)


def _walk(obj: Any, parts: list[str], where: str) -> Iterator[tuple[str, Any, Any]]:
    """Yield (location, object holding the last field, value) for every match of ``parts``."""
    name = parts[0]
    many = name.endswith("[]")
    name = name.removesuffix("[]")
    if not isinstance(obj, dict) or name not in obj:
        return
    value = obj[name]
    items = list(enumerate(value)) if many and isinstance(value, list) else [(None, value)]
    for j, item in items:
        loc = f"{where}.{name}" + (f"[{j}]" if j is not None else "")
        if len(parts) == 1:
            yield loc, obj, item
        else:
            yield from _walk(item, parts[1:], loc)
