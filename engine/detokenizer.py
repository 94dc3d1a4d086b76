"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from the output ids at each token (a token may change how its neighbours
decode), and only its settled part is shown: the text that later tokens cannot change, less the tail
that could still grow into a stop string, so a stream never shows text that a later token replaces or
a later stop removes. What is not settled:

- a trailing run of U+FFFD: an incomplete UTF-8 character decodes as U+FFFD (one for the character
  with byte-level BPE, one per byte with byte-fallback tokenizers) until its last byte arrives;
- with byte-fallback tokenizers (Llama 2, Mistral: ``<0xE4>`` byte tokens), the text of the trailing run
  of byte tokens: the run is decoded as one byte string, and if it ends up invalid UTF-8 every byte of
  it, already complete characters included, decodes as U+FFFD.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.settled = 0  # length of self.text's settled part
        self.emitted = 0
        self.stopped = False
        self._byte_token: dict[int, bool] = {}

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode ``token_ids`` (all output so far) and return the new text that is safe to show."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if self.stop:
            # the previous text held no stop string and its settled part is unchanged, so a new one
            # ends after that part: search from where the longest could start
            start = max(0, self.settled - self.holdback)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                final = True
        self.text = text
        self.settled = len(text) if final else self._settled_length(token_ids, text)
        safe = self.settled if final else self.settled - self.holdback
        if safe <= self.emitted:
            return ""
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta

    def _settled_length(self, token_ids: list[int], text: str) -> int:
        """Length of the prefix of ``text`` (the decode of ``token_ids``) that later tokens cannot change."""
        settled = len(text.rstrip(REPLACEMENT))
        run = len(token_ids)
        while run and self._is_byte_token(token_ids[run - 1]):
            run -= 1
        if run < len(token_ids):
            settled = min(settled, len(self.tokenizer.decode(token_ids[:run], skip_special_tokens=True)))
        return settled

    def _is_byte_token(self, token_id: int) -> bool:
        """Whether ``token_id`` is a byte-fallback token such as ``<0xE4>``."""
        known = self._byte_token.get(token_id)
        if known is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            known = self._byte_token[token_id] = isinstance(piece, str) and BYTE_TOKEN.fullmatch(piece) is not None
        return known
