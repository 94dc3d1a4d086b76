"""An ingest of roots that overlap (``docs docs/sub``, and a folder ``docs`` also reaches through a
link) lists each folder and reads each file once, as the kernel sees it (inotify), while the store still
records every root a file was found under. A real ingest with the default model and embedder."""

from __future__ import annotations

import ctypes
import os
import struct
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ragfuse.rag_store import RagStore
from tests.test_ingest import _config, _ingest, embedder  # noqa: F401 - embedder: the module's fixture

IN_OPEN = 0x20
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name, NUL-padded


@contextmanager
def _opens(folders: list[Path]) -> Iterator[Counter[str]]:
    """Counts, once the block ends, every open of ``folders`` (a listing, by the folder's path) and of
    the files in them (by the file's path), as the kernel reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    if fd < 0:
        pytest.skip(f"inotify is not available: {os.strerror(ctypes.get_errno())}")
    try:
        watched = {libc.inotify_add_watch(fd, os.fsencode(f), IN_OPEN): f for f in folders}
        if min(watched) < 0:
            pytest.skip(f"inotify cannot watch a folder: {os.strerror(ctypes.get_errno())}")
        counts: Counter[str] = Counter()
        yield counts
        data = b""
        while chunk := _read(fd):
            data += chunk
        while data:
            wd, mask, _, size = _EVENT.unpack_from(data)
            name = data[_EVENT.size:_EVENT.size + size].rstrip(b"\0").decode()
            data = data[_EVENT.size + size:]
            if mask & IN_OPEN and not (name and mask & IN_ISDIR):  # a watched subfolder reports its own
                counts[str(watched[wd] / name) if name else str(watched[wd])] += 1
    finally:
        os.close(fd)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def test_overlapping_roots_list_and_read_each_file_once_and_record_every_root(tmp_path, engine, embedder):  # noqa: F811
    tmp = tmp_path.resolve()  # the store holds resolved paths
    docs, sub, shared = tmp / "docs", tmp / "docs" / "sub", tmp / "shared"
    sub.mkdir(parents=True)
    shared.mkdir()
    (docs / "keep.txt").write_text("The Hollowpoint lighthouse was electrified in 1931.")
    (sub / "ferry.txt").write_text("The ferry to Saltmarsh stopped running in 1952.")
    (shared / "quarry.txt").write_text("Granite from the Brenn quarry paved the harbour road.")
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    store = RagStore(tmp / "store", _config(embedder))
    with _opens([docs, sub, shared]) as opens:
        rep = _ingest(store, engine, embedder, [docs, sub, shared])
    files = [docs / "keep.txt", sub / "ferry.txt", shared / "quarry.txt"]
    assert opens == Counter({str(p): 1 for p in [docs, sub, shared, *files]})
    assert sorted(rep.new_files) == sorted(map(str, files)) and rep.chunks_added == 3 and rep.skipped == []
    assert store.docs.file_roots([str(docs)]) == {
        str(docs / "keep.txt"): {str(docs)},
        str(sub / "ferry.txt"): {str(docs), str(sub)},
        str(shared / "quarry.txt"): {str(docs), str(shared)},
    }
    # the records still drive removal: with the link gone, docs no longer reaches quarry.txt, which
    # shared still holds: it stays, recorded under shared alone
    (docs / "linked").unlink()
    assert _ingest(store, engine, embedder, [docs]).removed_files == []
    assert store.docs.file_roots([str(shared)]) == {str(shared / "quarry.txt"): {str(shared)}}
    store.close()
