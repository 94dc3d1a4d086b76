"""The scheduler's view of a span (stored, being saved, missing) against a real disk tier and real
pending marks: pure Python, runs in both venvs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragfuse.connectors.vllm.settings import PendingSaves, SpanState
from ragfuse.engine.kvstore import DiskTier
from tests.kvstore_helpers import make_entry


def _tier_and_marks(tmp_path: Path) -> tuple[DiskTier, PendingSaves]:
    return DiskTier(tmp_path, 64 << 20), PendingSaves(tmp_path)


def test_stored_saving_and_missing(tmp_path: Path) -> None:
    disk, pending = _tier_and_marks(tmp_path)
    try:
        stored, saving, missing = make_entry(1), make_entry(2), make_entry(3)
        disk.put(stored)
        pending.mark(saving.key)
        assert pending.lookup(stored.key, disk.contains) is SpanState.STORED
        assert pending.lookup(saving.key, disk.contains) is SpanState.SAVING
        assert pending.lookup(missing.key, disk.contains) is SpanState.MISSING
    finally:
        disk.close()


@pytest.mark.parametrize("writer", ["this process", "another host"])
def test_a_mark_expires_with_age(tmp_path: Path, writer: str) -> None:
    """A mark whose writer cannot be seen to be gone (a live scheduler whose worker was killed
    mid-save, a writer on another host sharing the store) holds until it is ``stale_s`` old."""
    disk, pending = _tier_and_marks(tmp_path)
    try:
        key = make_entry(4).key
        if writer == "this process":
            pending.mark(key)
        else:
            (pending.dir / key).write_text("some-other-host 1")
        assert pending.lookup(key, disk.contains) is SpanState.SAVING
        old = time.time() - pending.stale_s - 1
        os.utime(pending.dir / key, (old, old))
        assert pending.lookup(key, disk.contains) is SpanState.MISSING
    finally:
        disk.close()


def test_a_mark_left_by_a_process_that_is_gone_is_ignored_at_once(tmp_path: Path) -> None:
    """An engine restarted after a crash finds its predecessor's marks, seconds old: the requests
    they cover must not wait out ``stale_s`` for saves nobody will finish."""
    disk, pending = _tier_and_marks(tmp_path)
    try:
        gone, alive = make_entry(6).key, make_entry(7).key
        script = ("import sys; from ragfuse.connectors.vllm.settings import PendingSaves; "
                  "PendingSaves(sys.argv[1]).mark(sys.argv[2])")
        subprocess.run([sys.executable, "-c", script, str(tmp_path), gone], check=True)
        pending.mark(alive)
        assert (pending.dir / gone).exists()
        assert pending.lookup(gone, disk.contains) is SpanState.MISSING
        assert pending.lookup(alive, disk.contains) is SpanState.SAVING
    finally:
        disk.close()


def test_a_save_ending_between_the_two_checks_is_not_a_miss(tmp_path: Path) -> None:
    """The writer stores, then clears the mark. A scheduler that sees "not stored" just before the
    store and "not marked" just after the clear must still find the entry (a miss here sent a
    follow-up request to recompute a chunk stored a moment before)."""
    disk, pending = _tier_and_marks(tmp_path)
    try:
        entry = make_entry(5)
        pending.mark(entry.key)
        looks: list[bool] = []

        def stored_then_save_finishes(key: str) -> bool:
            found = disk.contains(key)
            looks.append(found)
            if len(looks) == 1:  # the saver thread runs right after the first look
                disk.put(entry)
                pending.clear(entry.key)
            return found

        assert pending.lookup(entry.key, stored_then_save_finishes) is SpanState.STORED
        assert looks == [False, True]
    finally:
        disk.close()
