"""Where the workplace's shared datasets live (musique_dev.json, wikimqa_dev.json, sharegpt_multiturn_dev.jsonl).

They sit in a ``shared/data`` folder beside the checkout, or beside the folder that holds it (git
worktrees, clean clones in a scratch directory); ``$RAGFUSE_DATA`` names the folder outright. Benchmarks
take these as defaults and tests read them, so one lookup serves both wherever the repository is cloned.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_FALLBACK = Path("/work/shared/data")  # this workplace's copy, for clones made elsewhere


def shared_data(name: str) -> Path:
    """The path of dataset ``name``: the first folder that has it, else the first candidate (so an
    error message names a sensible place)."""
    folders = [Path(os.environ["RAGFUSE_DATA"])] if os.environ.get("RAGFUSE_DATA") else []
    folders += [_REPO.parent / "shared" / "data", _REPO.parents[1] / "shared" / "data", _FALLBACK]
    return next((f / name for f in folders if (f / name).exists()), folders[0] / name)
