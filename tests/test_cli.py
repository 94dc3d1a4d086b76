"""The ``ragfuse`` command as a user runs it: real subprocesses, real model."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest


def ragfuse(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragfuse.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_reports_answer_and_timings():
    r = ragfuse("generate", "What is the capital of France?", "--max-tokens", "12", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "prompt_tokens", "ttft_s", "total_s", "model", "device"):
        assert key in out
    assert "Paris" in out["text"]
    assert 0 < out["ttft_s"] <= out["total_s"]
    assert out["device"] == "cpu" and out["model"] == "smollm2-135m-instruct"
    assert 0 < len(out["token_ids"]) <= 12


def test_generate_streams_plain_text_with_system_prompt():
    r = ragfuse("generate", "Say hello.", "--system", "You always answer in French.", "--max-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize(
    "args, needle",
    [
        (("generate", "hi", "--model", "no-such-model"), "unknown model"),
        (("generate", "hi", "--model", "/nonexistent/model.gguf"), "does not exist"),
        (("generate", "hi", "--model", "nobody-here/no-such-model"), "not available locally"),
        (("generate", "hi", "--max-tokens", "0"), "at least 1"),
        (("generate", "hi", "--device", "tpu"), "invalid choice"),
        (("generate", "   "), "empty"),
        (("generate", "hi", "--temperature", "-2"), "temperature"),
        (("frobnicate",), "invalid choice"),
        (("store",), "name a command: stats, rm, gc"),  # said "required: store_command"
        (("search", "x", "--top-k", "abc"), "must be a whole number, got 'abc'"),  # said "invalid positive_int"
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle):
    r = ragfuse(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("usage")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_version_and_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "ragfuse", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ragfuse 0.1.0", r.stderr


def _transcript(session_dir, session="s1"):
    return session_dir / "chats" / f"{session}.json"


@pytest.mark.parametrize("content", [
    '[{"role": "user", "content": "hi"}, {"role": "assis',  # a write cut short
    '{"role": "user", "content": "hi"}',  # not a list of messages
])
def test_generate_session_with_an_unreadable_transcript_is_one_line(tmp_path, content):
    _transcript(tmp_path).parent.mkdir(parents=True)
    _transcript(tmp_path).write_text(content)
    r = ragfuse("generate", "and then?", "--session", "s1", "--session-dir", str(tmp_path), "--max-tokens", "4",
                "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("ragfuse: error:")]
    assert f"transcript {_transcript(tmp_path)} cannot be read" in line and "delete the file" in line
    assert _transcript(tmp_path).read_text() == content  # left for the user to look at


def test_generate_session_turn_saves_its_transcript(tmp_path):
    r = ragfuse("generate", "Hi, I am Ana.", "--session", "ana", "--session-dir", str(tmp_path), "--max-tokens", "4",
                "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    saved = json.loads(_transcript(tmp_path, "ana").read_text())
    assert saved == [{"role": "user", "content": "Hi, I am Ana."},
                     {"role": "assistant", "content": json.loads(r.stdout)["text"]}]
    assert [p.name for p in _transcript(tmp_path, "ana").parent.iterdir()] == ["ana.json"]  # no temporary file


def test_a_transcript_write_that_fails_leaves_the_previous_one(tmp_path):
    """A write that fails part way (a file-size limit standing in for a full disk) leaves the previous
    turn's transcript whole, and says so; the old in-place write left half a file behind."""
    path = _transcript(tmp_path)
    path.parent.mkdir(parents=True)
    before = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    path.write_text(before)
    longer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 100}]
    code = ("import sys, json, pathlib; from ragfuse.commands.generate import _write_transcript\n"
            "_write_transcript(pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]))")
    r = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(longer)], capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 50,) * 2))
    assert r.returncode != 0 and "cannot save the session's transcript" in r.stderr and "File too large" in r.stderr
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["s1.json"]
