"""Third connector audit, LangChain side, with the real default model on CPU: token counting with the
model's own tokenizer and chat template."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages

from ragfuse.connectors.langchain import ChatRagfuse

PARAMS = {"device": "cpu", "max_tokens": 4, "recompute_ratio": 0.2}


def test_token_counts_are_the_models_own():
    """``get_num_tokens`` fell back to GPT-2's tokenizer from the Hub (offline: every text 0 tokens), so
    ``trim_messages(token_counter=model)`` kept everything; counts are now the model's, and a chat's count
    is the prompt the model reads, the same as the answer's ``input_tokens``."""
    model = ChatRagfuse(**PARAMS)
    tokenizer = model._pipeline().engine.tokenizer
    text = "The Hollowpoint lighthouse was electrified in 1952."
    assert model.get_num_tokens(text) == len(tokenizer.encode(text, add_special_tokens=False)) > 5

    chat = [SystemMessage("Answer in a few words."), HumanMessage("Hi."), AIMessage("Hello!"),
            HumanMessage("Name a colour.")]
    counted = model.get_num_tokens_from_messages(chat)
    assert counted == model.invoke(chat).usage_metadata["input_tokens"]

    last = chat[-1:]
    trimmed = trim_messages(chat, max_tokens=model.get_num_tokens_from_messages(last), token_counter=model,
                            strategy="last")
    assert trimmed == last


def test_a_store_of_another_model_is_served_by_that_model_never_the_default(tmp_path):
    """The connectors defaulted to the default model, which missed every chunk of such a store and
    wrote its own KV beside them; the model is now the store's, and another one is refused before
    anything loads."""
    from ragfuse.app import DEFAULT_MODEL, serving_model
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.store_dir import StoreConfig

    StoreConfig("other-model", "all-MiniLM-L6-v2", 384, "flat", 512, 0).save(tmp_path)
    assert serving_model(tmp_path, None) == serving_model(tmp_path, "other-model") == "other-model"
    assert serving_model(tmp_path / "nothing-here", None) == DEFAULT_MODEL
    with pytest.raises(RagfuseError, match="ingested with model 'other-model', not 'smollm2-135m-instruct'"):
        ChatRagfuse(store=str(tmp_path), model=DEFAULT_MODEL).invoke("Hi")


def test_malformed_calls_are_clear_errors():
    from ragfuse.engine.errors import RequestError

    with pytest.raises(ValueError, match="unknown mode 'bogus'"):
        ChatRagfuse(mode="bogus")  # when made, not at the first call
    model = ChatRagfuse(**PARAMS)
    with pytest.raises(ValueError, match="needs its text"):
        model.invoke([HumanMessage(content=[{"type": "text"}])])
    with pytest.raises(ValueError, match="not dict"):
        model.invoke("Who built it?", documents=[{"page_content": "A lighthouse."}])
    with pytest.raises(RequestError, match=r"a number in \[0, 1\], got '0.2'"):
        model.invoke("Who built it?", recompute_ratio="0.2")
