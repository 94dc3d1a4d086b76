"""``write_atomic``: the file is always some writer's whole content, and a failed write leaves no trace."""

from __future__ import annotations

import threading

import pytest

from ragfuse.engine.atomic_file import write_atomic


def test_writers_at_once_each_replace_the_file_whole(tmp_path):
    """Two gate calibrations or two ingests write the same file at once; with one fixed temporary
    name, one could rename the other's half-written bytes into place."""
    path = tmp_path / "r_star.json"
    contents = [bytes([65 + i]) * (1 << 16) * (i + 1) for i in range(4)]
    seen: set[bytes] = set()
    stop = threading.Event()

    def writer(data: bytes) -> None:
        for _ in range(40):
            write_atomic(path, data)

    def reader() -> None:
        while not stop.is_set():
            if path.exists():
                seen.add(path.read_bytes())

    threads = [threading.Thread(target=writer, args=(c,)) for c in contents]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert seen and seen <= set(contents) and path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == ["r_star.json"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "store.json"
    write_atomic(path, '{"chunk_tokens": 512}')

    def half_then_fail(f) -> None:
        f.write(b'{"chunk_')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, write=half_then_fail)
    assert path.read_text() == '{"chunk_tokens": 512}'
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]
    assert path.stat().st_mode & 0o777 == 0o644
