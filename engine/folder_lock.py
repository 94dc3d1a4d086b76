"""A lock a process holds on a folder for as long as it keeps the folder's state in memory.

Session stores and RAG stores read their folder once and then work from memory. A second process
changing the folder under them (another server saving the same session, ``store rm --all`` resetting
the settings a server chunks uploads by) made one of them overwrite the other's work without a word.
Holders take an ``flock`` on a file in the folder: exclusive where one process at a time may write
(sessions), shared where readers may share and one destructive step needs it alone (a store's reset).
``flock`` locks end with the process, so a crash never leaves one behind, and a holder refused gets
the pid the exclusive holder wrote into the file.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .errors import RagfuseError


class FolderBusyError(RagfuseError):
    """Another process holds the folder in a way this use would conflict with."""


class FolderLock:
    """``flock`` on ``path``, held until ``release`` (or the process ends). A folder this process
    cannot write to (a read-only mount) is locked through a read-only descriptor where the file
    exists, and not at all where it does not: nobody can change such a folder, from here at least.
    ``writable`` says which: holders of such a folder only read it."""

    def __init__(self, path: Path, exclusive: bool, busy: str, wait: bool = False) -> None:
        """``busy``: the refusal's message, ``{pid}`` standing for the holder's. ``wait``: block until
        the lock is free instead of refusing (for a shared lock behind a short exclusive step)."""
        self.path = path
        self._fd, self.writable = _open(path)
        if self._fd is None:
            return
        try:
            self._take(exclusive, busy, wait)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def _take(self, exclusive: bool, busy: str, wait: bool) -> None:
        how = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(self._fd, how if wait else how | fcntl.LOCK_NB)  # type: ignore[arg-type]
        except BlockingIOError as exc:
            raise FolderBusyError(busy.format(pid=self._holder())) from exc
        if exclusive:
            self._write_pid()

    def exclusive(self, busy: str) -> None:
        """Turn a shared hold into the only one, or refuse with ``busy`` while another process holds
        (keeping the shared hold: ``flock`` drops it before trying, so it is taken again)."""
        if self._fd is not None:
            try:
                self._take(True, busy, wait=False)
            except FolderBusyError:
                self.shared()
                raise

    def shared(self) -> None:
        """Back to a shared hold after ``exclusive``."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write_pid(self) -> None:
        try:
            os.ftruncate(self._fd, 0)  # type: ignore[arg-type]
            os.pwrite(self._fd, str(os.getpid()).encode(), 0)  # type: ignore[arg-type]
        except OSError:  # read-only descriptor: the refusal then names no pid
            pass

    def _holder(self) -> str:
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        return text if text.isdigit() else "unknown"


def _open(path: Path) -> tuple[int | None, bool]:
    """(descriptor, whether the folder can be written): read-write where it can, else read-only where
    the file exists, else none."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), True
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    try:
        return os.open(path, os.O_RDONLY), False
    except FileNotFoundError:
        return None, False
