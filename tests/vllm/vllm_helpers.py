"""Helpers shared by the vLLM connector test modules (no vLLM import: importable in either venv)."""

from __future__ import annotations

import time
from pathlib import Path


def wait_saved(store_dir: str | Path) -> None:
    """Saves are written by a worker thread; wait until none is pending (bounded)."""
    pending = Path(store_dir) / "pending"
    deadline = time.time() + 60
    while any(pending.iterdir()) and time.time() < deadline:
        time.sleep(0.1)
