"""Writing a benchmark's results: ``results.json``, a markdown table ``results.md`` and PNG plots.

Every benchmark reports through here so their outputs look alike and carry the machine they ran on.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragfuse.engine.atomic_file import write_atomic

# a staging folder untouched this long is a dead writer's whatever its name says: a writer fills its
# folder and renames the files out within seconds (its longest step draws one plot)
STALE_STAGE_S = 3600.0

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


def prepare_out_dir(out: str | Path, option: str = "--out") -> Path:
    """Create the folder ``option`` names and make sure files can be written in it, or RagfuseError
    says why. Commands call this before their run: finding an --out that is a file or read-only only
    when the results are ready would throw the run away."""
    from ragfuse.engine.errors import RagfuseError

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except (FileExistsError, NotADirectoryError) as exc:
        raise RagfuseError(f"{option} {out}: a file is in the way ({exc.filename} is not a folder)") from exc
    except OSError as exc:
        raise RagfuseError(f"{option} {out}: cannot write there ({exc.strerror or exc})") from exc
    return out


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinite floats as None: JSON has no NaN, and ``json.dumps`` would write a
    bare ``NaN`` that strict parsers (jq, JavaScript) reject."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def speed_phrase(speedup: float, digits: int = 2) -> str:
    """``speedup`` (baseline time / this time) in words that say which way it went: "0.31x faster"
    reads as a gain where the run was 3.2x slower (a slow tier, a process's first request)."""
    return f"{speedup:.{digits}f}x faster" if speedup >= 1 else f"{1 / speedup:.{digits}f}x slower"


def write_report(
    out: str | Path,
    title: str,
    results: dict[str, Any],
    rows: list[dict[str, Any]],
    plot: Callable[[Any], None] | None = None,
    notes: str = "",
) -> Path:
    """Write results.json, results.md (title, notes, table) and, with ``plot``, results.png.

    ``plot`` receives a matplotlib Figure to draw on (the Agg backend: no display needed). NaN figures
    are written as null (``json_safe``). A folder that cannot be written is a RagfuseError, not a
    traceback. Results marked ``"interrupted"`` (a run the user stopped: ``partial.Report``) say so at
    the top of results.md. A plot that raises costs the PNG only, never the rows measured: results.md
    says why it is missing, and outside an interrupted run (whose rows a plot written for a whole run
    may not expect) the error is raised once the other two files are in place, as the bug it is.

    The three files are one set, so they are staged first, in a temporary folder beside them, and
    then moved in by renames only. A write that fails (a full disk) thus leaves the previous set
    whole. The move removes the old results.json first and puts the new one in last: a crash in
    between leaves no results.json rather than a new one beside an older table or plot, so a
    results.json always stands beside the results.md and results.png of its own run. A run that draws
    no plot removes the previous run's results.png. (Swapping a whole folder would be one rename, but
    ``out`` is the user's folder and may hold other files; the files stay where readers look.) A
    writer killed before its renames (SIGKILL, a power cut) leaves its staging folder behind: the
    next write into ``out`` removes it (``_remove_dead_stages``).
    """
    from ragfuse.engine.errors import RagfuseError

    out = prepare_out_dir(out)
    _remove_dead_stages(out)
    failed: Exception | None = None
    try:
        with tempfile.TemporaryDirectory(dir=out, prefix=_stage_prefix()) as tmp:
            stage = Path(tmp)
            head = f"# {title}\n\n"
            if results.get("interrupted"):
                head += f"**Interrupted:** {results['interrupted']}\n\n"
            if plot is not None:
                failed = _draw(stage / "results.png", plot)
            if failed is not None:
                head += f"No plot: drawing it failed ({type(failed).__name__}: {failed}).\n\n"
            if notes:
                head += f"{notes.strip()}\n\n"
            write_atomic(stage / "results.md", head + markdown_table(rows))
            write_atomic(stage / "results.json",
                         json.dumps(json_safe({**results, "rows": rows}), indent=2, default=str, allow_nan=False))
            (out / "results.json").unlink(missing_ok=True)
            if (stage / "results.png").exists():
                os.replace(stage / "results.png", out / "results.png")
            else:
                (out / "results.png").unlink(missing_ok=True)
            os.replace(stage / "results.md", out / "results.md")
            os.replace(stage / "results.json", out / "results.json")
    except OSError as exc:
        raise RagfuseError(f"cannot write the results in {out}: {exc.strerror or exc}") from exc
    if failed is not None and not results.get("interrupted"):
        raise failed
    return out


def _stage_prefix() -> str:
    """Name of a staging folder: its writer's pid and host, so a later writer can tell whether it is alive."""
    return f".results-{os.getpid()}@{socket.gethostname()}."


def _remove_dead_stages(out: Path) -> None:
    """Remove the staging folders in ``out`` that no live writer owns: those of this host whose pid
    runs no process, and any untouched for ``STALE_STAGE_S``. The pid tells at once and for certain on
    this host; the age covers what it cannot: a folder of another host sharing ``out`` (a network
    folder, whose pids mean nothing here), a pid reused since its writer died, and folders of
    versions that named none. Age alone would keep a dead writer's folder for an hour; the pid alone
    would remove a live writer's folder of another host. A folder that will not go stays for the next
    writer: it holds no results, and this write's own are what matters now."""
    from ragfuse.engine.kvstore.disk import pid_alive  # the KV tier's temp files are told apart the same way

    host = socket.gethostname()
    for stage in out.glob(".results-*"):
        pid, _, rest = stage.name.removeprefix(".results-").partition("@")
        try:
            age = time.time() - stage.stat().st_mtime
        except FileNotFoundError:
            continue  # another writer removed it meanwhile
        mine = rest.rpartition(".")[0] == host and pid.isdigit()
        if (mine and not pid_alive(int(pid))) or age > STALE_STAGE_S:
            shutil.rmtree(stage, ignore_errors=True)


def _draw(path: Path, plot: Callable[[Any], None]) -> Exception | None:
    """Draw ``plot`` into the PNG ``path``; what it raised, if it did (``write_report`` decides)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 4.5))
    try:
        plot(fig)
        fig.tight_layout()
    except Exception as exc:  # any bug of any benchmark's plot: the rows are kept whatever it was
        return exc
    else:
        write_atomic(path, b"", lambda f: fig.savefig(f, format="png", dpi=110))
        return None
    finally:
        plt.close(fig)
