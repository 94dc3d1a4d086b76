"""Files replaced whole: written to a temporary file in the same folder, then renamed over the target.

A reader, a crash, Ctrl-C or a full disk leaves the previous file or the new one whole, never half of
one. The temporary name is unique (``mkstemp``): two processes writing the same file at once (two
``ragfuse ingest`` runs, two gate calibrations) each rename their own complete copy, where a fixed
``.tmp`` name would let one rename the other's half-written bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomic(path: str | Path, data: bytes | str = b"", write: Callable[[IO[bytes]], object] | None = None) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8), or with what ``write`` writes to the open
    binary file. The file is synced before the rename, so a power cut cannot leave an empty target;
    it is readable by everyone (as ``open`` would create it), not ``mkstemp``'s owner-only mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if write is not None:
                write(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
