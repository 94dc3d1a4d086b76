"""A chat prompt whose passages stay separate parts: what framework chat models hand the pipeline.

The model's chat template is rendered once around a placeholder per passage and split there, so each
passage's tokens are its own (tokenized alone, as ingest stored them) wherever the template puts
them. Plain text parts may still hold stored chunks that a framework flattened into them; a
``PassageFinder`` finds those again.
"""

from __future__ import annotations

import re
from typing import Any

from ragfuse.engine.chat_template import render_chat
from ragfuse.engine.errors import RequestError
from ragfuse.passage import Passage
from ragfuse.passage_finder import PassageFinder

_MARK = "\x00ragfuse-passage-{}\x00"
_MARK_RE = re.compile("\x00ragfuse-passage-(\\d+)\x00")
PART_SEPARATOR = "\n\n"  # between the parts of one message: passages are paragraphs of their own


def chat_parts(
    tokenizer: Any, messages: list[tuple[str, list[str | Passage]]], finder: PassageFinder | None = None
) -> list[str | Passage]:
    """``messages`` as (role, parts) rendered with the template and an assistant turn opened (``render_chat``:
    a template that refuses a system message gets its text at the start of the first user message)."""
    if not messages:
        raise RequestError("empty chat")
    passages: list[Passage] = []
    rendered_messages = []
    for role, parts in messages:
        texts = []
        for part in parts:
            if isinstance(part, Passage):
                texts.append(_MARK.format(len(passages)))
                passages.append(part)
            elif part:
                texts.append(part)
        rendered_messages.append({"role": role, "content": PART_SEPARATOR.join(texts)})
    text = render_chat(tokenizer, rendered_messages, tokenize=False)
    out: list[str | Passage] = []
    for i, piece in enumerate(_MARK_RE.split(text)):
        if i % 2:
            out.append(passages[int(piece)])
        elif piece:
            out.extend(finder.split(piece) if finder is not None else [piece])
    return out
