"""Writing a benchmark's results: ``results.json``, a markdown table ``results.md`` and PNG plots.

Every benchmark reports through here so their outputs look alike and carry the machine they ran on.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_report(
    out: str | Path,
    title: str,
    results: dict[str, Any],
    rows: list[dict[str, Any]],
    plot: Callable[[Any], None] | None = None,
    notes: str = "",
) -> Path:
    """Write results.json, results.md (title, notes, table) and, with ``plot``, results.png.

    ``plot`` receives a matplotlib Figure to draw on (the Agg backend: no display needed).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**results, "rows": rows}, indent=2, default=str))
    md = f"# {title}\n\n{notes.strip()}\n\n{markdown_table(rows)}" if notes else f"# {title}\n\n{markdown_table(rows)}"
    (out / "results.md").write_text(md)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(10, 4.5))
        plot(fig)
        fig.tight_layout()
        fig.savefig(out / "results.png", dpi=110)
        plt.close(fig)
    return out
