"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from the output ids at each token (a token may change how its neighbours
decode), and the tail that could still turn into a stop string, or that ends in a half-decoded
character, is held back so a stream never shows text that a later stop would remove.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode ``token_ids`` (all output so far) and return the new text that is safe to show."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, len(self.text) - self.holdback)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                final = True
        self.text = text
        safe = len(text) if final else len(text) - self.holdback
        if not final and text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe <= self.emitted:
            return ""
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta
