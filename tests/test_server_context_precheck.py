"""A request whose prompt and explicit ``max_tokens`` exceed the context is refused before the engine
prefills its prompt (it was refused only at the first delta, after a prefill that could take seconds
and held the engine meanwhile); a left-out ``max_tokens`` runs to what the context leaves, up to the
server's ``--max-tokens``, on either backend (it was a fixed default of 256)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server_helpers import KEY, MODEL, LiveServer

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Name three colours."}]
CONTEXT = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, object]]:
    """A server over an engine of 512 tokens of context, whose limit lets a request ask for them all,
    with one document stored for the RAG route: its URL and the engine."""
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline
    from ragfuse.engine import LLM

    llm = LLM(device="cpu", max_model_len=CONTEXT, kv_cache_bytes=64 << 20)
    pipeline = open_store_pipeline(str(tmp_path_factory.mktemp("precheck")), MODEL, engine=llm.engine, gate=False)
    app = create_app(EngineBackend(pipeline, MODEL), ServerSettings(api_key=KEY, max_tokens=1024))
    with LiveServer(app) as srv:
        r = post(srv.url, "/v1/documents", {"documents": [{"name": "fox.md", "text": "The red fox is Alma."}]})
        assert r.status_code == 200, r.text
        yield srv.url, llm.engine


def post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=300)


@pytest.fixture
def forwards(server) -> Iterator[list[int]]:
    """Tokens each forward pass of the served model ran over, while the test runs (a hook on the
    real model: a prefill shows up as a pass however fast it was)."""
    seen: list[int] = []
    hook = server[1].runner.model.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    yield seen
    hook.remove()


def refused_past_context(r: httpx.Response, prompt: int, completion: int, param: str) -> None:
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, r.text
    assert (f"the model's context is {CONTEXT} tokens, but this request needs {prompt + completion}: {prompt} for "
            f"the prompt and {completion} for the completion ({param}); shorten the prompt or lower {param}"
            ) == error["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_context_is_refused_without_a_prefill(server, forwards, stream):
    url = server[0]
    fits = post(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1})
    prompt = fits.json()["usage"]["prompt_tokens"]
    rag = post(url, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1, "max_tokens": 1})
    rag_prompt = rag.json()["usage"]["prompt_tokens"]
    assert fits.status_code == rag.status_code == 200 and forwards, (fits.text, rag.text)
    forwards.clear()
    refused_past_context(post(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": stream,
                                                            "max_completion_tokens": CONTEXT + 1 - prompt}),
                         prompt, CONTEXT + 1 - prompt, "max_completion_tokens")
    refused_past_context(post(url, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 400)),
                                                       "max_tokens": 213, "stream": stream}), 300, 213, "max_tokens")
    refused_past_context(post(url, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1,
                                                     "stream": stream, "max_tokens": CONTEXT + 1 - rag_prompt}),
                         rag_prompt, CONTEXT + 1 - rag_prompt, "max_tokens")
    assert forwards == [], "a refused request ran the model"


def test_max_tokens_left_out_runs_to_what_the_context_leaves(server):
    """Left out, the completion took a fixed 256 tokens although the context left more (and the
    server's limit allowed more); now it may take all the context leaves."""
    r = post(server[0], "/v1/completions", {"model": MODEL, "prompt": list(range(100, 200)), "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length", r.text
    assert body["usage"]["completion_tokens"] == CONTEXT - 100, r.text


def test_completion_tokens_settles_the_limit():
    """The rule both backends apply to a prompt's length: explicit limits checked, left-out ones filled
    up to the server's limit; a prompt filling the context alone is refused as its own field's."""
    from ragfuse.connectors.server.backend import Sampling
    from ragfuse.connectors.server.errors import APIError

    assert Sampling(max_tokens=None, limit=1024).completion_tokens(100, CONTEXT, "prompt") == CONTEXT - 100
    assert Sampling(max_tokens=None, limit=64).completion_tokens(100, CONTEXT, "prompt") == 64
    assert Sampling(max_tokens=12, limit=64).completion_tokens(CONTEXT - 12, CONTEXT, "prompt") == 12
    for max_tokens, prompt in [(None, CONTEXT), (12, CONTEXT + 5)]:
        with pytest.raises(APIError) as info:
            Sampling(max_tokens=max_tokens, limit=64).completion_tokens(prompt, CONTEXT, "messages")
        assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(APIError) as info:
        Sampling(max_tokens=13, limit=64, param="max_completion_tokens").completion_tokens(
            CONTEXT - 12, CONTEXT, "messages")
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_completion_tokens"
