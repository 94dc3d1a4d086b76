"""The ``ragfuse`` command as a user runs it: real subprocesses, real model."""

from __future__ import annotations

import json
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
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle):
    r = ragfuse(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("usage")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
