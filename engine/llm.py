"""``LLM``: the Python API over the engine (batch ``generate``, ``stream``, ``chat``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams


class LLM:
    """Offline generation with continuous batching.

    >>> llm = LLM()                                  # the embedded default model, offline
    >>> llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8)).text
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine that is already loaded (one model in memory, several front ends)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
        system: int | None = None,
        relay: bool = True,
    ) -> list[RequestOutput]:
        """Generate for all prompts together (they share batches); results in prompt order.

        With ``system`` (an id from ``engine.register_system``) every prompt continues that system
        prompt, through relay attention unless ``relay`` is False (then the prompt's blocks are shared).
        """
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp, system=system, relay=relay) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not progress)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, system: int | None = None
    ) -> Iterator[RequestOutput]:
        """Yield an output each time the request gets tokens; the last one has ``finished``."""
        rid = self.engine.add_request(prompt, params, system=system)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)  # a consumer that stops early frees the request's blocks

    def chat_ids(self, messages: list[dict[str, str]], system: str | None = None) -> list[int]:
        if system is not None:
            messages = [{"role": "system", "content": system}, *[m for m in messages if m["role"] != "system"]]
        return self.engine.chat_token_ids(messages)

    def relay_chat_ids(self, messages: list[dict[str, str]], system: str) -> tuple[int | None, list[int]]:
        """(registered system prompt id, the chat's remaining token ids): the chat template renders
        the system message as a prefix, which is registered once and served by relay attention.

        Returns (None, all ids) where relay cannot apply: a model with a sliding window, or a
        template whose rendering of the system message alone is not a token prefix of the chat.
        """
        full = self.chat_ids(messages, system)
        head = self.engine.chat_token_ids([{"role": "system", "content": system}], add_generation_prompt=False)
        if not self.engine.supports_relay or len(head) >= len(full) or full[: len(head)] != head:
            return None, full
        return self.engine.register_system(head), full[len(head) :]

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None, system: str | None = None
    ) -> RequestOutput:
        return self.generate([self.chat_ids(messages, system)], params)[0]
