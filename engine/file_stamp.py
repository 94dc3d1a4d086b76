"""What tells a reader that a file changed since it last read it, for the price of one ``stat``."""

from __future__ import annotations

import os
from pathlib import Path

Stamp = tuple[int, int, int]


def file_stamp(path: Path) -> Stamp | None:
    """(inode, mtime in ns, size) of ``path``, None where there is none: a write in place changes the
    time or size, a save by rename the inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
