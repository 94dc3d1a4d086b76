"""The RAG prompt, cut into the segments that cache fusion works on.

The model's own chat template is rendered once around placeholders and split there, so every
passage's tokens sit in the prompt exactly as they were stored at ingest (each passage tokenized
alone): that is what lets its stored KV be reused at any position. The prompt shape follows the
CacheBlend experiments: an instruction, the passages, the question, an answer within a few words.

The instruction is the template's system message; a template that refuses one gets it at the start of
the user message instead (``render_chat``). Either way the prefix (everything before the passages) is
the same tokens at the head of every prompt, which is all that its stored KV, chunk KV computed after
it and relay attention over it rely on.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ragfuse.engine.chat_template import render_chat

DEFAULT_INSTRUCTION = (
    "You are given several passages and a question. Answer the question using the passages. "
    "Answer within a few words."
)
_PASSAGES = "\x00ragfuse-passages\x00"
_QUESTION = "\x00ragfuse-question\x00"
_ANSWER = "\x00ragfuse-answer\x00"


def passage_token_ids(tokenizer: Any, text: str) -> list[int]:
    """How a passage is tokenized for storage: alone, as it will appear in the prompt (what counts a
    passage's tokens needs only the tokenizer, not a builder)."""
    return list(tokenizer.encode(text.strip(), add_special_tokens=False))


class RagPromptBuilder:
    def __init__(self, tokenizer: Any, instruction: str = DEFAULT_INSTRUCTION) -> None:
        self.tokenizer = tokenizer
        self.instruction = instruction
        user = f"{_PASSAGES}Question: {_QUESTION}"
        first = [{"role": "system", "content": instruction}, {"role": "user", "content": user}]
        if getattr(tokenizer, "chat_template", None):
            text = render_chat(tokenizer, first, tokenize=False)
            # the same chat one answer later: what opens a follow-up question (the template's end of
            # the assistant's turn and its next user header)
            later = render_chat(tokenizer, [*first[:1], {"role": "user", "content": "?"},
                                            {"role": "assistant", "content": _ANSWER}, first[1]], tokenize=False)
            self._turn_head = later.split(_ANSWER)[1].split(_PASSAGES)[0]
        else:  # a base model: plain text
            text = f"{instruction}\n\n{user}\nAnswer:"
            self._turn_head = "\n\n"
        self._head, rest = text.split(_PASSAGES)
        self._before_q, self._after_q = rest.split(_QUESTION)
        self.prefix = self._encode(self._head)
        self.separator = self._encode("\n\n")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tail(self, question: str, after_passages: bool = True) -> list[int]:
        """The question and the template's assistant header (after the passages, or opening a
        follow-up question that brings none)."""
        q = " ".join(question.split())
        lead = "\n" if after_passages else ""
        return self._encode(f"{lead}{self._before_q}{q}{self._after_q}")

    def turn_head(self, history: list[int], ends: Collection[int] = ()) -> list[int]:
        """What opens a follow-up question after ``history`` (a session's turns so far): the
        template's next user header, after the end of the assistant's turn unless the answer
        already ended with that token, or with another of the model's end tokens ``ends`` where the
        turn's is one too (a model with several, like Llama 3's, may stop on any)."""
        head = self._encode(self._turn_head)
        if head and history and (history[-1] == head[0] or (history[-1] in ends and head[0] in ends)):
            return head[1:]
        return head

    def passage_tokens(self, text: str) -> list[int]:
        """``passage_token_ids`` with this builder's tokenizer."""
        return passage_token_ids(self.tokenizer, text)

    def token_ids(self, passages: list[list[int]], question: str) -> list[int]:
        """The whole prompt as one token list (what full prefill runs)."""
        out = list(self.prefix)
        for i, p in enumerate(passages):
            if i:
                out += self.separator
            out += p
        return out + self.tail(question)
