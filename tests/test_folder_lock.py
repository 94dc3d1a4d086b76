"""Folder locks: one exclusive holder named by pid, shared holders with a short exclusive step,
and a read-only folder that cannot be locked for writing."""

from __future__ import annotations

import os

import pytest

from ragfuse.engine.folder_lock import FolderBusyError, FolderLock


def test_an_exclusive_hold_refuses_the_next_naming_its_pid_until_released(tmp_path):
    first = FolderLock(tmp_path / "x.lock", exclusive=True, busy="held by {pid}")
    with pytest.raises(FolderBusyError, match=f"held by {os.getpid()}"):
        FolderLock(tmp_path / "x.lock", exclusive=True, busy="held by {pid}")
    first.release()
    FolderLock(tmp_path / "x.lock", exclusive=True, busy="held by {pid}").release()


def test_a_refused_exclusive_step_keeps_the_shared_hold(tmp_path):
    """``flock`` drops a shared lock before trying an exclusive one: a refused step must not leave
    its holder unlocked (an exclusive taker would then get in beside it)."""
    mine = FolderLock(tmp_path / "open.lock", exclusive=False, busy="", wait=True)
    other = FolderLock(tmp_path / "open.lock", exclusive=False, busy="", wait=True)
    with pytest.raises(FolderBusyError, match="open elsewhere"):
        mine.exclusive("open elsewhere")
    other.release()
    with pytest.raises(FolderBusyError):  # mine still holds its shared lock
        FolderLock(tmp_path / "open.lock", exclusive=True, busy="busy")
    mine.exclusive("open elsewhere")  # alone now: the step goes through
    mine.shared()
    mine.release()


def test_a_read_only_folder_is_locked_read_only_or_not_at_all(tmp_path, request):
    (tmp_path / "there.lock").write_text("")
    request.getfixturevalue("read_only_fs")  # from here on
    there = FolderLock(tmp_path / "there.lock", exclusive=True, busy="")  # through a read-only descriptor
    absent = FolderLock(tmp_path / "absent.lock", exclusive=True, busy="")  # cannot be made: no lock
    there.release()
    absent.release()
    assert not (tmp_path / "absent.lock").exists()
