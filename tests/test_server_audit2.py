"""Third server audit: what an OpenAI client sends that the server took wrongly (``null`` for an option
left unset, audio and web search asked for and silently not given, ``max_completion_tokens`` refused
under another name) and what a RAG answer told clients about the server's disk (each source's path),
against a live server over the default model on CPU; and the Gradio demo's backend given two uploads
of one name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_helpers import DEMO, KEY, MODEL

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours."}]
QUESTION = "When was the Hollowpoint lighthouse electrified?"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_demo_refuses_two_uploads_of_one_name(tmp_path, engine):
    """Uploads are copied into the store under their own names: of two files named alike (from two
    folders) only the last was ingested, the other lost without a word. Runs first in this file, before
    the module's server takes the engine over."""
    pytest.importorskip("gradio", reason="the demo needs ragfuse[demo]")
    from ragfuse.app import open_pipeline
    from ragfuse.connectors.gradio_demo import DemoBackend
    from ragfuse.engine import RequestError

    backend = DemoBackend(str(tmp_path / "store"), docs_dir=DEMO,
                          open_pipe=lambda r: open_pipeline(str(r), engine=engine, gate=False))
    try:
        first, second = tmp_path / "a" / "notes.md", tmp_path / "b" / "notes.md"
        for path, text in ((first, "The red fox is called Alma."), (second, "The blue whale is called Bert.")):
            path.parent.mkdir()
            path.write_text(text)
        with pytest.raises(RequestError, match="same name: notes.md"):
            backend.ingest([], [str(first), str(second)])
        assert backend.stored_files() == []
    finally:
        backend.close()


def chat(served, **options: object) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, **options}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def test_null_options_mean_their_default(served):
    """OpenAI's spec makes temperature, top_p, n and stream nullable; clients that send every option
    send null for those left unset, and get the answer of a request without them."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None}
    sent = chat(served, seed=7, **nulls)
    assert sent.status_code == 200, sent.text
    left_out = chat(served, seed=7)
    assert sent.json()["choices"][0]["message"]["content"] == left_out.json()["choices"][0]["message"]["content"]
    r = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **nulls})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = httpx.post(f"{served.url}/v1/rag/query", headers=AUTH, timeout=120,  # RAG's own default: greedy
                   json={"question": QUESTION, "top_k": 1, "max_tokens": 16, **nulls})
    greedy = httpx.post(f"{served.url}/v1/rag/query", headers=AUTH, timeout=120,
                        json={"question": QUESTION, "top_k": 1, "max_tokens": 16})
    assert r.status_code == 200 and r.json()["answer"] == greedy.json()["answer"], r.text


@pytest.mark.parametrize("option, value", [
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
])
def test_audio_and_web_search_are_refused_not_ignored(client, option, value):
    """An answer without the asked-for audio or web search would pass for one: refused, like tools."""
    with pytest.raises(openai.BadRequestError, match=f"does not support {option}") as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={option: value})
    assert err.value.body["param"] == option and err.value.body["type"] == "invalid_request_error"


def test_text_only_modalities_are_served(served):
    r = chat(served, modalities=["text"], audio=None, web_search_options=None)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_max_completion_tokens_over_the_limit_names_that_option(client):
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be at most 64") as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=1000)
    assert err.value.body["param"] == "max_completion_tokens"
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, max_tokens=50).usage
    assert usage.completion_tokens == 3  # the newer option wins, as in OpenAI's API


@pytest.mark.parametrize("stream", [False, True])
def test_rag_sources_name_documents_not_server_paths(served, stream):
    """``/v1/documents`` shows files by name and opaque id only; the answer's sources did show each
    file's absolute path on the server (its store directory and layout)."""
    body = {"question": QUESTION, "top_k": 1, "max_tokens": 4, "stream": stream}
    with httpx.stream("POST", f"{served.url}/v1/rag/query", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert str(served.store) not in text and "/uploads/" not in text
    listed = httpx.get(f"{served.url}/v1/documents", headers=AUTH).json()["data"]
    answer = json.loads(next(line.removeprefix("data: ") for line in text.splitlines() if '"rag.answer"' in line))
    source = answer["sources"][0]
    assert source["source"] == "lighthouses.md"
    assert source["document_id"] == next(d["id"] for d in listed if d["name"] == "lighthouses.md")


@pytest.mark.parametrize("body, param, tries", [
    ({"model": MODEL, "messages": CHAT, "stop": 123}, "stop", ("valid string", "valid list")),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     ("valid string", "valid list")),
])
def test_a_field_of_several_types_is_named_as_sent_and_every_type_said(served, body, param, tries):
    """pydantic tags each type it tried into the error's location (``stop.constrained-str``): the
    client gets the field's own name and every type it may take, not the first try's alone."""
    r = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["message"].startswith(f"{param}: ") and all(t in error["message"] for t in tries), r.text

