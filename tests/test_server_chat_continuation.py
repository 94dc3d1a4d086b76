"""``/v1/chat/completions`` with vLLM's ``add_generation_prompt`` and ``continue_final_message``:
a chat whose final assistant message the model continues ("assistant prefill"), through the
official ``openai`` client (``extra_body``) against a live server on the default model."""

from __future__ import annotations

import openai
import pytest

from tests.server_helpers import MODEL

pytestmark = pytest.mark.slow
TOKENS = 10
PREFILL = [{"role": "user", "content": "Name three colours."},
           {"role": "assistant", "content": "Here are three colours: red,"}]
SYSTEM = {"role": "system", "content": "You are a painter who answers in one short sentence."}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def rendered(tokenizer: object, messages: list[dict[str, str]], **options: bool) -> list[int]:
    """The prompt ids transformers itself renders (not ragfuse's ``render_chat``), the reference."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, tuple[int, str, int]]:
    """(prompt tokens, greedy text, completion tokens) the engine generates from each reference
    rendering, computed before the server's loop owns the engine."""
    from ragfuse.engine import SamplingParams

    prompts = {
        "continued": rendered(llm.tokenizer, PREFILL, **CONTINUE),
        "system": rendered(llm.tokenizer, [SYSTEM, *PREFILL], **CONTINUE),
        "no_header": rendered(llm.tokenizer, PREFILL[:1], add_generation_prompt=False),
    }
    outs = llm.generate(list(prompts.values()), SamplingParams(max_tokens=TOKENS, temperature=0.0))
    return {name: (len(ids), out.text, len(out.token_ids)) for (name, ids), out in zip(prompts.items(), outs)}


def test_llm_chat_continues_the_final_message(llm, expected):
    """``LLM.chat`` takes the same two options as the server (it runs before the module's server takes
    the engine): its text is the continuation the reference rendering gives. Before, ``chat`` had no
    way to ask for it and opened a new assistant turn."""
    from ragfuse.engine import SamplingParams

    out = llm.chat(PREFILL, SamplingParams(max_tokens=TOKENS, temperature=0.0), **CONTINUE)
    assert (out.prompt_tokens, out.text) == expected["continued"][:2]


@pytest.fixture(scope="module")
def served(tmp_path_factory, llm, expected):
    from tests.server_helpers import serve_lighthouses

    with serve_lighthouses(tmp_path_factory.mktemp("store"), llm) as srv:
        yield srv


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **extra: object) -> object:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0,
                                          extra_body=extra)


def assert_answer(reply: object, want: tuple[int, str, int]) -> None:
    prompt_tokens, text, completion_tokens = want
    assert reply.choices[0].message.role == "assistant"
    assert (reply.usage.prompt_tokens, reply.choices[0].message.content, reply.usage.completion_tokens) == \
        (prompt_tokens, text, completion_tokens)


def test_a_continued_message_is_the_engines_greedy_continuation(client, expected):
    """The final message rendered open (no end of turn, no new assistant header) and continued: the
    response holds only the continuation, the engine's own greedy tokens from that prompt, streamed
    or not. Before, the fields were ignored and a new assistant turn was opened after the message."""
    assert_answer(ask(client, PREFILL, **CONTINUE), expected["continued"])
    chunks = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=TOKENS, temperature=0,
                                            stream=True, extra_body=CONTINUE)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["continued"][1]


def test_continuation_behind_a_relay_system_prompt(client, expected):
    """The system message is still a token prefix of the continued chat's rendering, so it is served
    by relay attention; the tokens are the same with relay off."""
    relayed = ask(client, [SYSTEM, *PREFILL], **CONTINUE)
    assert relayed.usage.model_extra["ragfuse"]["relay_system_tokens"] > 0
    assert_answer(relayed, expected["system"])
    plain = ask(client, [SYSTEM, *PREFILL], relay=False, **CONTINUE)
    assert plain.usage.model_extra["ragfuse"]["relay_system_tokens"] == 0
    assert_answer(plain, expected["system"])


def test_continuation_as_a_session_turn(client, expected):
    """A session turn may continue a message: the stored KV is matched by common prefix, so the
    continued turn reuses the previous turn's, and the next turn (the continued message now closed)
    reuses the continued one's up to where its message was left open."""
    first = ask(client, PREFILL[:1], session_id="cont-1")
    assert first.usage.model_extra["ragfuse"]["session_tokens_reused"] == 0
    continued = ask(client, PREFILL, session_id="cont-1", **CONTINUE)
    assert continued.usage.model_extra["ragfuse"]["session_tokens_reused"] >= first.usage.prompt_tokens
    assert_answer(continued, expected["continued"])
    closed = {"role": "assistant", "content": PREFILL[1]["content"] + continued.choices[0].message.content}
    after = ask(client, [*PREFILL[:1], closed, {"role": "user", "content": "And three more?"}], session_id="cont-1")
    assert after.usage.model_extra["ragfuse"]["session_tokens_reused"] >= continued.usage.prompt_tokens


def test_without_a_generation_prompt_no_assistant_header_is_rendered(client, expected):
    """``add_generation_prompt: false`` alone renders the chat as it is, closed, with no assistant
    header after it (the prompt is three tokens shorter than with one)."""
    assert_answer(ask(client, PREFILL[:1], add_generation_prompt=False), expected["no_header"])
    assert ask(client, PREFILL[:1]).usage.prompt_tokens > expected["no_header"][0]


@pytest.mark.parametrize(("messages", "extra", "says"), [
    (PREFILL, {"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    (PREFILL, {"continue_final_message": True}, "add_generation_prompt defaults to true"),
    (PREFILL[:1], CONTINUE, "the last message's role is user"),
    ([SYSTEM], CONTINUE, "the last message's role is system"),
])
def test_what_cannot_be_continued_is_a_400(client, messages, extra, says):
    """vLLM's two refusals: a new turn opened after a message that is left open, and a final message
    that is not the assistant's."""
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, messages, **extra)
    error = caught.value.body
    assert error["param"] == "continue_final_message" and says in error["message"], error


@pytest.mark.parametrize("field", ["add_generation_prompt", "continue_final_message"])
@pytest.mark.parametrize("value", [1, 0, "true", "false", None])
def test_the_fields_take_json_booleans_only(client, field, value):
    """Strict as every other field: ``1``, ``"false"`` or ``null`` is a client's mistake, not a choice."""
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, PREFILL, **{field: value})
    assert caught.value.body["param"] == field and "valid boolean" in caught.value.body["message"]


def test_the_vllm_prompt_builder_renders_the_continuation(llm):
    """The vLLM backend's chat prompts (``PromptBuilder.chat_prompt``) render the same ids."""
    from ragfuse.connectors.vllm.backend import PromptBuilder

    builder = PromptBuilder()
    builder.tokenizer = llm.tokenizer
    assert builder.chat_prompt(PREFILL, **CONTINUE).token_ids == rendered(llm.tokenizer, PREFILL, **CONTINUE)
    no_header = rendered(llm.tokenizer, PREFILL[:1], add_generation_prompt=False)
    assert builder.chat_prompt(PREFILL[:1], add_generation_prompt=False).token_ids == no_header


def test_a_template_that_rewrites_the_final_message_cannot_continue_it(llm):
    """transformers finds where to cut by the message's text in the rendering; a template that
    rewrites it (here upper-cases it) cannot be continued: a RequestError (a 400), not a traceback."""
    import copy

    from ragfuse.engine.chat_template import render_chat
    from ragfuse.engine.errors import RequestError

    tokenizer = copy.deepcopy(llm.tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(RequestError, match="the model's chat template cannot continue the final message: ") as caught:
        render_chat(tokenizer, PREFILL, **CONTINUE)
    assert "\n" not in str(caught.value) and "does not appear in the chat" in str(caught.value)
