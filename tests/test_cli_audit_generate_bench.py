"""Audit of ``ragfuse generate``, ``ragfuse bench`` and ``ragfuse profile``: bad input is a one-line
error before the work starts, never a traceback from inside a measurement; ``--json`` counts the
whole prompt. Through the CLI's own entry point, in this process; a run that loads the default model goes
through a subprocess, whose memory (weights, a 1 GiB KV cache) goes with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragfuse.cli import main
from tests.test_cli import ragfuse


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``, which must stop with exit code 2; return its one-line message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ragfuse: error: ") and err.count("\n") == 1, err
    return err


def _runtime_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``, which must end in a RagfuseError (exit code 2, not an exception); return its line."""
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ragfuse: error: ")
    return line


# ---- generate ---------------------------------------------------------------------------------------

def test_generate_json_prompt_tokens_count_a_relayed_system_prompt() -> None:
    """With relay the engine's prompt holds only what follows the registered system prompt; the
    reported prompt_tokens must still be the whole prompt, as without relay (and as the server says)."""
    common = ["generate", "Hi", "--system", "You are terse.", "--max-tokens", "2", "--json"]
    relayed = json.loads(ragfuse(*common).stdout)
    plain = json.loads(ragfuse(*common, "--no-relay").stdout)
    assert relayed["relay"] and not plain["relay"]
    assert relayed["prompt_tokens"] == plain["prompt_tokens"]
    assert 0 < relayed["relay_system_tokens"] < relayed["prompt_tokens"] and plain["relay_system_tokens"] == 0
    # registering the system prompt (its KV computed before the request) is timed on its own, not hidden
    assert relayed["system_s"] > 0 and plain["system_s"] == 0


def test_generate_refuses_system_with_raw(capsys) -> None:
    """--raw sends PROMPT alone: a --system beside it was dropped without a word."""
    assert "--system" in _usage_error(["generate", "Hi", "--raw", "--system", "be brief"], capsys)


def test_generate_refuses_max_tokens_beyond_the_context() -> None:
    r = ragfuse("generate", "Hi", "--max-tokens", "100000000")
    assert r.returncode == 2 and r.stderr.startswith("ragfuse: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "--max-tokens 100000000" in r.stderr and "8192" in r.stderr


def test_generate_deeply_nested_transcript_is_a_clear_error(tmp_path, capsys) -> None:
    """A transcript nested past the JSON parser's recursion limit raised RecursionError (a traceback)."""
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "s.json").write_text("[" * 200_000 + "]" * 200_000)
    err = _runtime_error(["generate", "Hi", "--session", "s", "--session-dir", str(tmp_path)], capsys)
    assert "nested too deeply" in err and "delete the file" in err


def test_generate_transcript_with_an_unknown_role_is_a_clear_error(tmp_path, capsys) -> None:
    """A hand-edited role reached the chat template (rendered as text, or a jinja error)."""
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "s.json").write_text(json.dumps([{"role": "bogus", "content": "hi"}]))
    err = _runtime_error(["generate", "Hi", "--session", "s", "--session-dir", str(tmp_path)], capsys)
    assert "system/user/assistant" in err and "delete the file" in err


# ---- bench: arguments refused while parsing ---------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["engine", "--shape", "nope"],
    ["fusion", "--shape", "nope"],
    ["tree", "--shape", "nope"],
    ["tree", "--e2e-shape", "nope"],
    ["sessions", "--shape", "nope"],
    ["sessions", "--replay-shape", "nope"],
    ["relay", "--shapes", "nope"],
    ["relay", "--shapes", ""],  # fell back to the 7B defaults, which a CPU cannot hold
    ["engine", "--repeats", "0"],
    ["engine", "--context", "0"],  # taken as "not given": the default 2048 ran instead
    ["engine", "--decode-steps", "-1"],
    ["fusion", "--chunks", "0"],
    ["fusion", "--repeats", "0"],
    ["fusion", "--query-tokens", "0"],
    ["fusion", "--sweep", "0,2"],
    ["fusion", "--ratio", "3"],
    ["fusion", "--tiers", ""],
    ["fusion", "--tiers", "tape"],
    ["tree", "--page", "0"],
    ["tree", "--repeats", "0"],
    ["tree", "--private", "0"],
    ["tree", "--e2e-requests", "0"],
    ["relay", "--requests", "0"],
    ["relay", "--repeats", "0"],
    ["sessions", "--parts", ""],
    ["sessions", "--history", "0"],
    ["sessions", "--new-tokens", "0"],
    ["sessions", "--repeats", "0"],
    ["sessions", "--settings", "bad"],
    ["sessions", "--tiers", ""],
    ["server", "--seconds", "nan"],
    ["server", "--clients", "0"],
])
def test_bench_bad_arguments_are_usage_errors(argv, tmp_path, capsys) -> None:
    err = _usage_error(["bench", *argv, "--device", "cpu", "--out", str(tmp_path / "out")], capsys)
    assert "argument" in err
    assert not (tmp_path / "out").exists()  # nothing started


# ---- bench: checks before the measurement -----------------------------------------------------------

def test_bench_fusion_gpu_tier_needs_cuda(tmp_path, capsys) -> None:
    argv = ["bench", "fusion", "--shape", "tiny-llama", "--chunks", "2", "--chunk-tokens", "16", "--query-tokens",
            "4", "--repeats", "1", "--sweep", "0", "--tiers", "gpu", "--device", "cpu", "--out", str(tmp_path)]
    assert "--tiers gpu" in _runtime_error(argv, capsys)
    assert not (tmp_path / "results.json").exists()


def test_bench_engine_lengths_past_the_context_fail_before_timing(tmp_path, capsys) -> None:
    argv = ["bench", "engine", "--shape", "tiny-llama", "--prefill", "32,5000", "--decode-batches", "1",
            "--context", "16", "--decode-steps", "2", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path)]
    err = _runtime_error(argv, capsys)
    assert "--prefill" in err and "4096" in err


RELAY = ["bench", "relay", "--systems", "64", "--contexts", "16", "--batches", "2", "--e2e-systems", "64",
         "--requests", "2", "--max-prompt", "8", "--max-output", "2", "--repeats", "1", "--device", "cpu"]


def test_bench_relay_bad_data_fails_before_the_op_part(tmp_path, capsys) -> None:
    """A --data file that is not ShareGPT JSONL was a JSONDecodeError traceback, after the op part."""
    data = tmp_path / "data.jsonl"
    data.write_text("this is not json\n")
    err = _runtime_error([*RELAY, "--shapes", "tiny-llama", "--data", str(data), "--out", str(tmp_path / "out")],
                         capsys)
    assert f"{data}:1" in err and "ShareGPT" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_bench_relay_with_both_parts_skipped_is_refused(tmp_path, capsys) -> None:
    argv = [*RELAY, "--shapes", "tiny-llama", "--skip-op", "--skip-e2e", "--out", str(tmp_path)]
    assert "nothing to measure" in _runtime_error(argv, capsys)


def test_bench_relay_cpu_default_shape_is_tiny(tmp_path, capsys) -> None:
    """The default shapes were the 7B ones on any device: on a CPU their float32 end-to-end engines
    (28 GB and more) got the process killed for memory, without a word."""
    assert main([*RELAY, "--skip-e2e", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["shapes"] == ["tiny-llama"]
    assert {row["shape"] for row in results["rows"]} == {"tiny-llama"}


def test_bench_store_dir_that_is_a_file(tmp_path, capsys) -> None:
    """--dir naming a file was a NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = ["bench", "store", "--chunks", "1", "--tokens", "16", "--repeats", "1", "--dir", str(afile),
            "--device", "cpu", "--out", str(tmp_path / "out")]
    assert "--dir" in _runtime_error(argv, capsys)


def test_bench_sessions_bad_rates_fail_before_the_ttft_part(tmp_path, capsys) -> None:
    rates = tmp_path / "rates.json"
    rates.write_text("{}")
    argv = ["bench", "sessions", "--parts", "ttft,replay", "--history", "64", "--new-tokens", "8", "--repeats", "1",
            "--conversations", "5", "--rates", str(rates), "--device", "cpu", "--out", str(tmp_path / "out")]
    assert "--rates" in _runtime_error(argv, capsys)
    assert not (tmp_path / "out" / "results.json").exists()


# ---- profile ----------------------------------------------------------------------------------------

def test_profile_store_that_is_a_file_fails_before_measuring(tmp_path, capsys) -> None:
    """The store folder was made only after the measurement: a path that is a file (or a profiles/
    that is one) ended the run with a FileExistsError traceback, the measurement lost. A path that is
    a file holds no store, which is said before anything else."""
    from ragfuse.store_dir import StoreConfig

    store = tmp_path / "store"
    store.mkdir()
    StoreConfig("smollm2-135m-instruct", "all-MiniLM-L6-v2", 384, "flat", 64, 0).save(store)
    (store / "profiles").write_text("x")
    argv = ["profile", "--store", str(store), "--lengths", "16", "--entry-tokens", "16", "--entries", "2"]
    assert "a file is in the way" in _runtime_error(argv, capsys)
    afile = Path(tmp_path / "afile")
    afile.write_text("x")
    assert f"no ragfuse store at {afile}" in _runtime_error([*argv[:2], str(afile), *argv[3:]], capsys)


@pytest.mark.parametrize("argv", [["--entries", "0"], ["--entry-tokens", "0"], ["--context", "0"],
                                  ["--r-star", "5"], ["--r-star", "0"]])
def test_profile_bad_arguments_are_usage_errors(argv, tmp_path, capsys) -> None:
    assert "argument" in _usage_error(["profile", "--store", str(tmp_path), *argv], capsys)


def test_generate_interrupted_ends_the_answers_line() -> None:
    """Ctrl-C while the answer streams: exit 130 with one line on stderr, and the text so far ends its
    line (the shell's prompt was left on the answer's last line)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "ragfuse.cli", "generate", "Tell me a long story about a lighthouse.",
         "--max-tokens", "2000", "--temperature", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job ignores it
    )
    try:
        first = proc.stdout.read(1)  # the answer has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first and proc.returncode == 130
    assert (first + out).decode().endswith("\n") and err.decode().strip().splitlines()[-1] == "ragfuse: interrupted"
