"""Fourth server audit, with the ``openai`` client and raw HTTP against a live server over the default
model on CPU: JSON types taken loosely (``true`` served as 1 token, ``"yes"`` as a stream), a request
asking for more tokens than the context leaves cut short and called ``length`` instead of refused,
bodies that are not JSON or not an object, errors of a list field that blamed its type; and
``ragfuse profile`` making a folder for a mistyped ``--store``."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_helpers import KEY, MODEL, LiveServer

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours."}]
QUESTION = "When was the Hollowpoint lighthouse electrified?"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_profile_refuses_a_store_that_does_not_exist(tmp_path, capsys) -> None:
    """``--store`` naming no folder made one (and its profiles/) for a typo; now a one-line error,
    exit 2, before the model loads, and nothing created."""
    from ragfuse.cli import main

    missing = tmp_path / "nowhere" / "store"
    assert main(["profile", "--store", str(missing), "--lengths", "16", "--entries", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no ragfuse store at {missing}" in err, err
    assert not (tmp_path / "nowhere").exists()


def post(served, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers=AUTH, timeout=120)


def refused(r: httpx.Response, param: str | None, says: str) -> None:
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
    assert error["param"] == param and says in error["message"], r.text


CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
COMPLETION_BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
RAG_BODY = {"question": QUESTION, "top_k": 1, "max_tokens": 4}


@pytest.mark.parametrize("path, body, option, value, says", [
    ("/v1/chat/completions", CHAT_BODY, "max_tokens", True, "valid integer"),
    ("/v1/chat/completions", CHAT_BODY, "max_tokens", 2.0, "valid integer"),
    ("/v1/chat/completions", CHAT_BODY, "max_completion_tokens", "3", "valid integer"),
    ("/v1/chat/completions", CHAT_BODY, "stream", "yes", "valid boolean"),
    ("/v1/chat/completions", CHAT_BODY, "stream", 1, "valid boolean"),
    ("/v1/chat/completions", CHAT_BODY, "temperature", "0.5", "valid number"),
    ("/v1/chat/completions", CHAT_BODY, "temperature", False, "valid number"),
    ("/v1/chat/completions", CHAT_BODY, "n", 1.0, "valid integer"),
    ("/v1/chat/completions", CHAT_BODY, "seed", True, "valid integer"),
    ("/v1/chat/completions", CHAT_BODY, "relay", "false", "valid boolean"),
    ("/v1/chat/completions", CHAT_BODY, "logprobs", 0, "does not support logprobs"),
    ("/v1/chat/completions", CHAT_BODY, "presence_penalty", False, "does not support presence_penalty"),
    ("/v1/completions", COMPLETION_BODY, "max_tokens", True, "valid integer"),
    ("/v1/completions", COMPLETION_BODY, "top_p", "1", "valid number"),
    ("/v1/completions", COMPLETION_BODY, "best_of", True, "does not support best_of"),
    ("/v1/rag/query", RAG_BODY, "top_k", True, "valid integer"),
    ("/v1/rag/query", RAG_BODY, "recompute_ratio", "0.5", "valid number"),
    ("/v1/rag/query", RAG_BODY, "stream", "true", "valid boolean"),
])
def test_json_types_are_strict(served, path, body, option, value, says):
    """pydantic's lax mode served ``"max_tokens": true`` as 1 token, ``"stream": "yes"`` as a stream,
    ``"temperature": "0.5"`` as 0.5; OpenAI's API refuses a wrong JSON type, naming the option."""
    refused(post(served, path, {**body, option: value}), option, says)


def test_strict_types_keep_what_json_allows(served):
    """Integers stay numbers, ``null`` stays the default, and an explicit neutral value (``false``,
    ``0.0``) for an unsupported option stays accepted."""
    r = post(served, "/v1/chat/completions", {**CHAT_BODY, "temperature": 0, "top_p": 1, "stream": None,
                                              "logprobs": False, "presence_penalty": 0.0})
    assert r.status_code == 200, r.text
    r = post(served, "/v1/rag/query", {**RAG_BODY, "recompute_ratio": 1, "relay": False})
    assert r.status_code == 200, r.text
    r = post(served, "/v1/completions", {**COMPLETION_BODY, "stream_options": {"include_usage": "yes"}})
    refused(r, "stream_options.include_usage", "valid boolean")
    r = post(served, "/v1/documents", {"documents": [{"name": 5, "text": "x"}]})
    refused(r, "documents.0.name", "valid string")


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT_BODY),
                                        ("/v1/completions", COMPLETION_BODY)])
def test_stream_options_need_a_stream(served, path, body):
    """``stream_options`` without ``stream: true`` (left out, false or null) was served as a plain
    request, its usage chunk never sent; OpenAI's API refuses it. With a stream it stays valid."""
    for stream in ({}, {"stream": False}, {"stream": None}):
        r = post(served, path, {**body, **stream, "stream_options": {"include_usage": True}})
        refused(r, "stream_options", "only allowed when stream is true")
    with httpx.stream("POST", f"{served.url}{path}", headers=AUTH, timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"usage"' in lines[-2], lines[-3:]


@pytest.mark.parametrize("content, error", [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                                            (b"", "must be a JSON object")])
def test_a_body_that_is_not_a_json_object(served, content, error):
    """Not JSON at all was "1: JSON decode error" with param "1" (the character offset taken for a
    field); a JSON array was pydantic's "valid dictionary or object to extract fields from", an empty
    body a bare "Field required"."""
    r = httpx.post(f"{served.url}/v1/chat/completions", content=content, timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    refused(r, None, error)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_numbers_json_has_not_are_refused_as_such(served, value):
    """Python's JSON reader takes NaN and Infinity; a NaN temperature was refused as "less than or
    equal to 2", a negative infinite one "greater than or equal to 0"."""
    content = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "temperature": {value}}}'
    r = httpx.post(f"{served.url}/v1/chat/completions", content=content.encode(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    refused(r, "temperature", "finite number")


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/completions", {**COMPLETION_BODY, "prompt": [True, 5]}, "prompt.0", "valid integer"),
    ("/v1/chat/completions", {**CHAT_BODY, "stop": ["\n", "x" * 300]}, "stop.1", "at most 256 characters"),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "messages.0.content.0.type", "'text'"),
])
def test_a_bad_item_of_a_list_field_is_named(served, path, body, param, says):
    """A list of token ids with a ``true`` in it, a stop list with a 300-character string, an image
    part: each was blamed on the field's type ("prompt: Input should be a valid string"), though a
    list was right and one item was wrong."""
    refused(post(served, path, body), param, says)


def test_a_batch_of_one_prompt_is_that_prompt(served, client):
    """OpenAI's ``prompt`` may be a batch, and clients send ``["Hello"]`` for one prompt: it was
    refused as "a valid string"; a batch of several is refused as a batch."""
    one = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=3, temperature=0)
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert one.choices[0].text == plain.choices[0].text and one.usage.prompt_tokens == plain.usage.prompt_tokens
    ids = client.completions.create(model=MODEL, prompt=[[19556]], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 1
    refused(post(served, "/v1/completions", {**COMPLETION_BODY, "prompt": ["Hello", "Hi"]}), "prompt",
            "one prompt per request, got a batch of 2")


def test_a_model_id_with_a_slash_is_looked_up(client):
    """``/v1/models/{model}`` took no slash, so an id like "org/name" (or a checkpoint's path, which
    ``--model`` takes) got the router's bare "Not Found" instead of the model's own answer."""
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert info.value.code == "model_not_found" and "HuggingFaceTB/SmolLM2-135M-Instruct" in info.value.message


def test_method_not_allowed_says_what_is(served):
    """A 405 must name the allowed methods (``Allow``); the OpenAI-format error dropped the header."""
    r = httpx.delete(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"], r.text
    assert httpx.head(f"{served.url}/v1/models", headers=AUTH, timeout=60).headers["allow"] == "GET"


def test_a_prompt_longer_than_the_context_is_refused(served):
    refused(post(served, "/v1/completions", {**COMPLETION_BODY, "prompt": "word " * 9000}), "prompt",
            "the model's context is 8192 tokens, but the prompt alone takes")


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    """A server over an engine of 256 tokens of context, whose limit lets a request ask for them all."""
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline
    from ragfuse.engine import LLM

    llm = LLM(device="cpu", max_model_len=256, kv_cache_bytes=64 << 20)
    pipeline = open_store_pipeline(str(tmp_path_factory.mktemp("small")), MODEL, engine=llm.engine, gate=False)
    with LiveServer(create_app(EngineBackend(pipeline, MODEL), ServerSettings(api_key=KEY, max_tokens=512))) as srv:
        yield srv


def openai_refusal(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_and_max_tokens_past_the_context_are_refused(small_context, stream):
    """The engine cut ``max_tokens`` to what the context left and finished with ``length``, a limit the
    client never set; OpenAI's and vLLM's servers refuse it with every number named."""
    client = openai.OpenAI(base_url=f"{small_context.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    prompt = chat.usage.prompt_tokens
    exc = openai_refusal(lambda: client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=257 - prompt, stream=stream))
    assert exc.code == "context_length_exceeded" and exc.param == "max_completion_tokens", exc
    assert (f"context is 256 tokens, but this request needs 257: {prompt} for the prompt and {257 - prompt} "
            "for the completion (max_completion_tokens)") in exc.message
    exc = openai_refusal(lambda: client.completions.create(model=MODEL, prompt=list(range(100, 300)),
                                                           max_tokens=57, stream=stream))
    assert exc.param == "max_tokens" and "needs 257: 200 for the prompt and 57" in exc.message, exc
    fits = client.completions.create(model=MODEL, prompt=list(range(100, 300)), max_tokens=56, temperature=0)
    assert fits.usage.prompt_tokens == 200 and fits.choices[0].finish_reason in ("length", "stop")


def test_max_tokens_left_out_is_what_the_context_leaves(small_context):
    """No explicit limit: the default is cut to the context, no error."""
    r = post(small_context, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 352)), "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 252 and usage["completion_tokens"] <= 4, r.text


def test_rag_query_past_the_context_is_refused(small_context):
    """The RAG route takes ``max_tokens`` too: refused like the others (an empty store's question
    would be refused first, so a document is uploaded)."""
    r = post(small_context, "/v1/documents", {"documents": [{"name": "fox.md", "text": "The red fox is Alma."}]})
    assert r.status_code == 200, r.text
    r = post(small_context, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1, "max_tokens": 256})
    refused(r, "max_tokens", "for the completion (max_tokens)")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(small_context, "/v1/rag/query", {"question": "What is the fox called?", "top_k": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
