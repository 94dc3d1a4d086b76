"""The distribution as a user gets it: a wheel built from a clean copy of the sources, unpacked away from
the checkout, plus the README's commands against the real command line."""

from __future__ import annotations

import ast
import email
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import ragfuse
from ragfuse.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
SOURCES = {"ragfuse": "ragfuse", "engine": "ragfuse/engine", "kernels": "ragfuse/kernels",
           "connectors": "ragfuse/connectors"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built by setuptools' PEP 517 backend from a copy of what the build reads (so no stale
    build/ folder of the checkout can add or hide files)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in [*SOURCES, "demo"]:
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    out = root / "dist"
    out.mkdir()
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"],
                   cwd=src, check=True, capture_output=True, text=True, timeout=120)
    (whl,) = out.glob("ragfuse-*.whl")
    return whl


@pytest.fixture(scope="module")
def names(wheel: Path) -> list[str]:
    return zipfile.ZipFile(wheel).namelist()


@pytest.fixture(scope="module")
def metadata(wheel: Path, names: list[str]) -> email.message.Message:
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(zipfile.ZipFile(wheel).read(meta))


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory) -> Path:
    """The wheel unpacked as an installer lays it into site-packages, far from the checkout."""
    site = tmp_path_factory.mktemp("site")
    zipfile.ZipFile(wheel).extractall(site)
    return site


def run_installed(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter whose ``ragfuse`` is the unpacked wheel, run outside the checkout.
    (The venv's other packages stay importable; the checkout's editable finder comes after ``site``.)"""
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=120)


def test_wheel_holds_one_ragfuse_tree_and_nothing_generic(names):
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ragfuse", f"ragfuse-{ragfuse.__version__}.dist-info"}, tops


def test_wheel_holds_every_source_module(names):
    shipped = set(names)
    missing = [f"{dest}/{p.relative_to(REPO / src).as_posix()}"
               for src, dest in SOURCES.items() for p in sorted((REPO / src).rglob("*.py"))
               if "__pycache__" not in p.parts and f"{dest}/{p.relative_to(REPO / src).as_posix()}" not in shipped]
    assert not missing, f"pyproject's package list leaves out: {missing}"
    kernels = [n for n in names if n.startswith("ragfuse/kernels/") and n.endswith("_triton.py")]
    assert kernels, "no Triton kernel in the wheel"


def test_wheel_ships_the_demo_documents(names):
    docs = sorted(p.name for p in (REPO / "demo" / "docs").iterdir() if p.is_file())
    assert docs
    assert all(f"ragfuse/demo_docs/{name}" in names for name in docs), [n for n in names if "demo" in n]


def test_wheel_entry_point_and_metadata(wheel, names, metadata):
    (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(eps).decode()
    assert re.search(r"^\[console_scripts\]\s*\nragfuse = ragfuse\.cli:main\s*$", text, re.M), text
    assert metadata["Name"] == "ragfuse" and metadata["Version"] == ragfuse.__version__
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["License-Expression"] == "Apache-2.0"
    core = [Requirement(r) for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert "torch==2.13.0" in {str(r) for r in core}
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"rag", "langchain", "llamaindex", "server", "demo", "gpu", "vllm", "all"} <= extras
    every = " ".join(metadata.get_all("Requires-Dist"))
    for dist in ("sentence-transformers", "faiss-cpu", "triton", "vllm", "fastapi", "langchain-core",
                 "llama-index-core"):
        assert re.search(rf"\b{re.escape(dist)}\b", every), dist


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "ragfuse"}


def test_core_commands_need_no_extra(metadata):
    """`pip install ragfuse` alone runs `ragfuse generate` (also `--session`): whatever the CLI's core and
    that command import comes with the core dependencies (directly or through them)."""
    closure, todo = set(), [Requirement(r).name for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in closure:
            continue
        closure.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate({"extra": ""})]
    providers = packages_distributions()
    files = [REPO / "ragfuse" / "cli.py", REPO / "ragfuse" / "commands" / "generate.py"]
    uncovered = {m for f in files for m in _third_party_imports(f)
                 if not {d.lower().replace("_", "-") for d in providers.get(m, [m])} & closure}
    assert not uncovered, f"imported by the core CLI but only in an extra: {uncovered}"


def test_installed_packages_import_outside_the_checkout(site):
    r = run_installed(site, (
        "import ragfuse, ragfuse.engine, ragfuse.kernels, ragfuse.connectors, ragfuse.commands, ragfuse.bench\n"
        "import ragfuse.kernels.paged_attention, ragfuse.engine.kvstore\n"
        "mods = [ragfuse, ragfuse.engine, ragfuse.kernels, ragfuse.connectors, ragfuse.kernels.paged_attention]\n"
        "print('\\n'.join(m.__file__ for m in mods))\n"))
    assert r.returncode == 0, r.stderr
    files = r.stdout.split()
    assert len(files) == 5 and all(Path(f).is_relative_to(site) for f in files), files


def test_installed_cli_help_and_entry_point(site):
    r = run_installed(site, (
        "import sys\n"
        "from importlib.metadata import distribution\n"
        "(ep,) = [e for e in distribution('ragfuse').entry_points if e.group == 'console_scripts']\n"
        "main = ep.load()\n"
        "print(sys.modules[main.__module__].__file__)\n"
        "for args in (['--help'], ['ingest', '--help'], ['ask', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (args, exc.code)\n"))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.splitlines()[0]).is_relative_to(site), r.stdout[:300]
    assert "usage: ragfuse [-h]" in r.stdout and "usage: ragfuse ingest" in r.stdout and "--compare" in r.stdout


def test_installed_demo_offers_the_shipped_documents(site):
    """`ragfuse demo`'s document picker defaults to the demo documents in an installed wheel too (it looked
    for the checkout's demo/docs only, so an installed demo offered nothing)."""
    r = run_installed(site, (
        "from ragfuse.cli import build_parser\n"
        "print(build_parser('demo').parse_args(['demo']).docs)\n"))
    assert r.returncode == 0, r.stderr
    docs = Path(r.stdout.strip())
    assert docs.is_relative_to(site) and (docs / "lighthouses.md").is_file(), r.stdout


# ---- README: its commands exist with the options it shows


def _readme_blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


def _command_parser(words: list[str]):
    """The parser of ``ragfuse WORDS...`` (its subcommand words), and the words left after them."""
    parser = build_parser(words[0])
    while words and words[0] in _subparsers(parser):
        parser, words = _subparsers(parser)[words[0]], words[1:]
    return parser, words


def _synopses() -> list[str]:
    """Synopsis lines of the README (``ragfuse CMD [--opt X] ...``), continuation lines joined."""
    lines: list[str] = []
    for lang, body in _readme_blocks():
        if lang not in ("", "bash"):
            continue
        for line in body.splitlines():
            code = line.split("#", 1)[0].rstrip()
            if re.match(r"\s*(\.venv/bin/)?ragfuse \w", code) and "[" in code:
                lines.append(code.strip().removeprefix(".venv/bin/"))
            elif lines and re.match(r"\s+\[", code):
                lines[-1] += " " + code.strip()
    return lines


def test_readme_synopses_name_real_options():
    lines = _synopses()
    assert len(lines) >= 10, lines
    wrong = []
    for line in lines:
        words = line.split()[1:]
        alternatives = words[0].split("|")
        assert alternatives[0] in COMMANDS, line
        for cmd in alternatives:
            rest = words[1:]
            subs = rest[0].split("|") if rest and re.fullmatch(r"[a-z][a-z-]*(\|[a-z-]+)*", rest[0]) else [None]
            for sub in subs:
                parser, _ = _command_parser([cmd, *([sub] if sub else [])])
                known = {o for a in parser._actions for o in a.option_strings}
                wrong += [f"ragfuse {cmd} {sub or ''}: {o}" for o in re.findall(r"--[a-z][a-z0-9-]*", line)
                          if o not in known]
    assert not wrong, wrong


def _bash_commands() -> list[list[str]]:
    """Every complete ``ragfuse`` invocation in the README's bash blocks (synopses left out)."""
    found = []
    for lang, body in _readme_blocks():
        if lang != "bash":
            continue
        for line in body.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                argv = [w for w in shlex.split(part) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
                if argv and argv[0] in ("ragfuse", ".venv/bin/ragfuse") and "[" not in part:
                    found.append(argv[1:])
    return found


def test_readme_bash_commands_parse():
    """The quickstart's ingest and ask (and the other shown commands) parse with the real command line."""
    commands = _bash_commands()
    assert ["ingest", "demo/docs", "--store", ".demo-store"] in commands
    assert any(c[:1] == ["ask"] and "--compare" in c and "--store" in c for c in commands), commands
    for argv in commands:
        args = build_parser(argv[0]).parse_args(argv)
        assert callable(args.func), argv


def test_readme_test_command_is_what_ci_runs():
    test_section = (REPO / "README.md").read_text().split("## Test it", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", test_section, re.S)
    command = block.strip()
    assert command == "bash scripts/test.sh"
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1].strip() == command, ci
