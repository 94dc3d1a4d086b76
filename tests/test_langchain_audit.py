"""Third connector audit, LangChain side, with the real default model on CPU: token counting with the
model's own tokenizer and chat template."""

from __future__ import annotations

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
