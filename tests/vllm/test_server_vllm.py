"""``ragfuse serve --backend vllm``: the same API with vLLM and ragfuse's connector as the engine,
started as a real server process and queried with the official ``openai`` client (vLLM venv only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("faiss")  # the RAG routes need ragfuse's [rag] extra in this venv too

import httpx  # noqa: E402
import openai  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the server's start on a loaded 2-core CI box took over 7 minutes
MODEL = "smollm2-135m-instruct"
KEY = "vllm-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOC = ("The Zephyr ferry to Isle Marrow leaves every morning at 7:40 from pier nine and returns at dusk. "
       "Tickets are sold on board; bicycles travel free. ") * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "ragfuse.cli", "serve", "--backend", "vllm", "--store", str(tmp / "store"),
         "--port", str(port), "--api-key", KEY, "--max-tokens", "32", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 840
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the vLLM server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_openai_client_streaming_and_not(server):
    assert httpx.get(f"{server}/health").json()["backend"] == "vllm"
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert full.choices[0].message.content and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 5
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        full.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=4)  # longer than the context
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


def test_rag_query_loads_uploaded_chunks_through_the_connector(server):
    r = httpx.post(f"{server}/v1/documents", json={"documents": [{"name": "ferry.md", "text": DOC}]},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["ingest"]["kv_computed"] == 1  # vLLM computed the chunk's KV, the connector stored it
    body = {"question": "When does the Zephyr ferry leave?", "top_k": 1, "max_tokens": 8, "temperature": 0}
    # the first query stores the prompt's header (the chunk cannot load before its prefix is stored);
    # the second loads header and chunk: the stored chunk is used in the middle of the prompt
    _, ans = (httpx.post(f"{server}/v1/rag/query", json=body, headers=AUTH, timeout=300).json()
                  for _ in range(2))
    assert ans["sources"][0]["text"].startswith("The Zephyr ferry")
    assert ans["kv_tiers"] == ["vllm-connector"] and ans["fusion"]["reused_tokens"] > 100
    assert ans["fusion"]["mode"] == "full-reuse" and ans["answer"]
    full = httpx.post(f"{server}/v1/rag/query", json={**body, "mode": "full"}, headers=AUTH, timeout=300).json()
    assert full["fusion"]["mode"] == "full" and full["kv_tiers"] == ["computed"]


def test_context_refusal_and_left_out_max_tokens_as_on_ragfuses_engine(server):
    """Both backends settle ``max_tokens`` from the prompt's length before the engine takes the request:
    past the context it is the same 400 (no prefill), and left out it is what the context leaves, up to
    the server's --max-tokens (this server's 32); it was a fixed 256 sent to vLLM."""
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [1] * 2030, "max_tokens": 32},
                   headers=AUTH, timeout=300)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert "context is 2048 tokens, but this request needs 2062: 2030 for the prompt and 32" in error["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [1] * 2040, "temperature": 0},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8, r.text


def test_chat_continues_a_final_assistant_message(server):
    """vLLM's ``continue_final_message``: the chat's final (assistant) message is rendered open and
    continued, the response holding only the continuation: what vLLM generates greedily from that
    rendering sent as token ids. Before, the fields were ignored and a new assistant turn opened."""
    from transformers import AutoTokenizer

    from ragfuse.engine.checkpoint import resolve

    messages = [{"role": "user", "content": "Name three colours."},
                {"role": "assistant", "content": "The three colours are"}]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(MODEL).path))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                        tokenize=True, return_dict=False)
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    chat = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=300).json()
    plain = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": list(ids), "max_tokens": 8,
                                                         "temperature": 0}, headers=AUTH, timeout=300).json()
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"], (chat, plain)
    assert chat["usage"]["prompt_tokens"] == len(ids) and chat["usage"]["completion_tokens"] == 8


def test_rag_recompute_figures_count_the_stored_chunks_as_on_ragfuses_engine(server):
    """``recomputed_tokens``/``recompute_ratio`` are of the stored chunks' tokens, as on the engine
    backend (they were the whole prompt less the loaded tokens, and a ratio of 0 always)."""
    doc = ("The Quillon observatory on Mount Saber opens its telescope dome at 21:15 on clear nights. "
           "Visitors need a red torch; the dome stays shut when the wind exceeds 40 km/h. ") * 4
    r = httpx.post(f"{server}/v1/documents", json={"documents": [{"name": "quillon.md", "text": doc}]},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    body = {"question": "When does the Quillon observatory open its dome?", "top_k": 1, "max_tokens": 4,
            "temperature": 0}
    # mode full marks no chunk: nothing of it is loaded (no stored span covers it), all of it is computed
    full = httpx.post(f"{server}/v1/rag/query", json={**body, "mode": "full"}, headers=AUTH, timeout=300).json()
    assert full["sources"][0]["text"].startswith("The Quillon observatory")
    chunk_tokens = full["fusion"]["recomputed_tokens"]
    assert full["fusion"]["recompute_ratio"] == 1.0
    assert 0 < chunk_tokens < full["fusion"]["prompt_tokens"] - full["fusion"]["reused_tokens"]
    # the second reusing query loads header and chunk (the first stored the header), in whole blocks: the
    # chunk is reused from its start, and only a tail past the loaded blocks is computed in context
    _, ans = (httpx.post(f"{server}/v1/rag/query", json=body, headers=AUTH, timeout=300).json()
              for _ in range(2))
    fusion = ans["fusion"]
    assert ans["kv_tiers"] == ["vllm-connector"] and fusion["mode"] == "full-reuse", fusion
    assert fusion["prompt_tokens"] == full["fusion"]["prompt_tokens"]
    assert 0 <= fusion["recomputed_tokens"] < chunk_tokens
    assert fusion["recompute_ratio"] == pytest.approx(fusion["recomputed_tokens"] / chunk_tokens)
    assert fusion["reused_tokens"] >= chunk_tokens - fusion["recomputed_tokens"]
