"""Report fields a README audit found wrong: a re-ingest that only filled in KV called its files
changed; the refusal of unsupported options named only the first; a prompt filling the context by
itself got a plain 400 without ``context_length_exceeded``; ``full`` mode reported ratio 1 beside
0 recomputed tokens."""

from __future__ import annotations

import json
import re

import pytest

from ragfuse.cli import main
from tests.server_helpers import MODEL
from tests.test_server_context_precheck import CONTEXT, forwards, post, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours."}]
LONG = "fox " * 600  # over 512 tokens however it is wrapped


def _ingest(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["ingest", *args]) == 0
    return capsys.readouterr().out.splitlines()[-1]


def test_a_reingest_that_only_computes_kv_reports_its_files_unchanged(tmp_path, capsys):
    """After a --no-kv ingest, the same files ingested with KV were reported as "3 changed, +3 -3
    chunks": their text had not changed, only their KV was computed now."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in [("a.txt", "Bees make honey."), ("b.txt", "Owls hunt at night."), ("c.txt", "Rain falls.")]:
        (docs / name).write_text(text)
    base = ["--store", str(tmp_path / "store"), "--device", "cpu"]
    assert len(json.loads(_ingest(capsys, str(docs), *base, "--no-kv", "--json"))["new_files"]) == 3
    line = _ingest(capsys, str(docs), *base)
    assert line.startswith("0 new, 0 changed, 0 removed, 3 unchanged, 0 skipped files; +0 -0 chunks (0 tokens); "
                           "KV computed 3, reused 0, removed 0;"), line
    (docs / "d.txt").write_text("Snow is cold.")
    _ingest(capsys, str(docs), *base, "--no-kv", "--json")
    d = str((docs / "d.txt").resolve())
    filled = json.loads(_ingest(capsys, str(docs), *base, "--json"))
    assert (filled["new_files"], filled["replaced_files"], filled["kv_filled_files"]) == ([], [], [d]), filled
    assert len(filled["unchanged_files"]) == 4 and d in filled["unchanged_files"], filled
    assert (filled["chunks_added"], filled["chunks_removed"], filled["tokens"], filled["kv_computed"]) == (0, 0, 0, 1)
    (docs / "d.txt").write_text("Snow is cold and white.")  # a real change keeps its old report
    changed = json.loads(_ingest(capsys, str(docs), *base, "--json"))
    assert (changed["replaced_files"], changed["kv_filled_files"], changed["chunks_added"],
            changed["chunks_removed"], changed["kv_computed"]) == ([d], [], 1, 1, 1), changed


def test_every_unsupported_option_is_named_in_one_refusal(server):  # noqa: F811
    """`tools` with `logprobs: true` was refused naming `tools` only; the client fixed it and was
    refused again for `logprobs`. Now one 400 names them all, located at the first asked for."""
    url = server[0]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": tools, "logprobs": True},
         "tools", "tools and logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 2,
                                  "tools": tools, "presence_penalty": 0.5}, "logprobs",
         "logprobs, top_logprobs, tools and presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True, "best_of": 2, "suffix": "!"},
         "echo", "echo, best_of and suffix"),
    ]
    for path, body, param, named in cases:
        r = post(url, path, body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, r.text
        assert error["message"] == f"{param}: ragfuse does not support {named}: leave them out", r.text
    # the neutral values still ask for nothing, and one option alone reads as before
    ok = post(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, "tools": [],
                                            "logprobs": False})
    assert ok.status_code == 200, ok.text
    one = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True})
    assert one.json()["error"]["message"] == "echo: ragfuse does not support echo: leave it out", one.text


def _refused_alone(r, param: str) -> int:
    """The prompt's tokens named by a refusal of a prompt that fills the context by itself."""
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, r.text
    found = re.fullmatch(rf"the model's context is {CONTEXT} tokens, but the prompt alone takes (\d+) "
                         rf"\({param}\), leaving none for the completion; shorten the prompt", error["message"])
    assert found is not None, r.text
    return int(found.group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_fills_the_context_alone_is_context_length_exceeded(server, forwards, stream):  # noqa: F811
    """Such a prompt got the engine's plain 400 (code and param null), unlike a prompt that only its
    max_tokens pushed past the context; now both are `context_length_exceeded`, before any prefill,
    with the request field holding the prompt as param, a RAG session turn included."""
    url = server[0]
    fits = post(url, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 100 + CONTEXT - 1)),
                                         "stream": stream})
    rag = post(url, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1, "max_tokens": 1})
    assert fits.status_code == rag.status_code == 200, (fits.text, rag.text)  # the RAG prompt's KV stored
    forwards.clear()
    assert _refused_alone(post(url, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 100 + CONTEXT)),
                                                        "stream": stream}), "prompt") == CONTEXT
    assert _refused_alone(post(url, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 700)),
                                                        "max_tokens": 5, "stream": stream}), "prompt") == 600
    chat = [{"role": "user", "content": LONG}]
    assert _refused_alone(post(url, "/v1/chat/completions", {"model": MODEL, "messages": chat, "stream": stream}),
                          "messages") > CONTEXT
    assert _refused_alone(post(url, "/v1/chat/completions", {"model": MODEL, "messages": chat, "stream": stream,
                                                             "max_completion_tokens": 3}), "messages") > CONTEXT
    for extra in [{}, {"session_id": f"long-{stream}"}]:
        rag = post(url, "/v1/rag/query", {"question": LONG, "top_k": 1, "stream": stream, **extra})
        assert _refused_alone(rag, "question") > CONTEXT
    assert forwards == [], "a refused request ran the model"


def test_recomputed_tokens_agree_with_the_ratio_in_every_mode(server):  # noqa: F811
    """`--mode full` reported recompute_ratio 1.0 beside recomputed_tokens 0: the stored chunk's
    tokens, all computed in full (and prefix) mode, are now counted as recomputed, in `ragfuse ask
    --json`'s report and the /v1/rag/query `fusion` block it feeds alike."""
    url = server[0]

    def fusion(mode: str, **extra: object) -> dict:
        r = post(url, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1, "max_tokens": 1,
                                        "mode": mode, "relay": False, **extra})
        assert r.status_code == 200, r.text
        return r.json()["fusion"]

    reuse, prefix = fusion("reuse"), fusion("prefix")
    chunk = reuse["reused_tokens"] - prefix["reused_tokens"]  # the chunk's stored tokens, beyond the instruction
    assert chunk > 0 and (reuse["recompute_ratio"], reuse["recomputed_tokens"]) == (0.0, 0), reuse
    for mode, extra in [("full", {}), ("prefix", {}), ("fuse", {"recompute_ratio": 1.0})]:
        got = prefix if mode == "prefix" else fusion(mode, **extra)
        assert (got["recompute_ratio"], got["recomputed_tokens"]) == (1.0, chunk), (mode, got)
    fused = fusion("fuse", recompute_ratio=0.5)
    assert 0 < fused["recomputed_tokens"] < chunk, fused
    assert fused["recomputed_tokens"] == pytest.approx(fused["recompute_ratio"] * chunk), fused
