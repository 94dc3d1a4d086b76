"""``LLM``: the Python API over the engine (batch ``generate``, ``stream``, ``chat``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tqdm.auto import tqdm

from .config import EngineConfig
from .errors import RequestError
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams
from .step_router import StepRouter


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
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts: give one, or one each")
        return self._collect(lambda: (self.engine.add_request(p, sp, system=system, relay=relay)
                                      for p, sp in zip(prompts, plist)), progress)

    @property
    def router(self) -> StepRouter:
        """The engine's one ``StepRouter``: this front end's requests and any others' (a pipeline, another
        ``LLM``, an open stream) share its steps."""
        return StepRouter.of(self.engine)

    def _collect(self, add: Callable[[], Iterable[str]], progress: bool = False) -> list[RequestOutput]:
        """Add requests (``add`` yields their ids) and step until every one has finished; results in
        their order. All or none: a request refused (a bad prompt among good ones) aborts the ones
        added before it, which would otherwise run on untracked, holding cache blocks."""
        with self.router.lock:
            ids: list[str] = []
            try:
                ids.extend(add())
            except BaseException:
                for rid in ids:
                    self.engine.abort(rid)
                raise
            for rid in ids:
                self.router.track(rid)
        with tqdm(total=len(ids), desc="generate", disable=not progress) as bar:
            outs = self.router.collect(ids, on_finished=lambda _: bar.update(1))
        with self.router.lock:
            self.engine.close_turns()  # session turns among them: their answers' last tokens, then saved
        return outs

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, system: int | None = None
    ) -> Iterator[RequestOutput]:
        """Yield an output each time the request gets tokens; the last one has ``finished``. A
        consumer that stops early frees the request's blocks; other calls may run meanwhile."""
        with self.router.lock:
            rid = self.engine.add_request(prompt, params, system=system)
            self.router.track(rid)
        yield from self.router.outputs(rid)

    def chat_ids(self, messages: list[dict[str, str]], system: str | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> list[int]:
        """The chat's prompt ids: a new assistant turn opened after it (``add_generation_prompt``), or
        its last message left open for the model to continue (``continue_final_message``, "assistant
        prefill"; then ``add_generation_prompt`` must be False, as in transformers and vLLM)."""
        return self._render(messages, system, add_generation_prompt, continue_final_message)

    def render(self, messages: list[dict[str, str]], system: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> RenderedChat:
        """The chat rendered once (``chat_ids``), kept with what it was rendered from: a caller that
        counts a chat before queuing it (the server refuses a prompt past the context and sizes the
        answer first) queues it with ``add_rendered_chat``, so the template runs once per request."""
        return RenderedChat(self, messages, system,
                            self.chat_ids(messages, system, add_generation_prompt, continue_final_message))

    def relay_chat_ids(self, messages: list[dict[str, str]], system: str) -> tuple[int | None, list[int]]:
        """(registered system prompt id, the chat's remaining token ids): the chat template renders
        the system message as a prefix, which is registered once (``engine.relay_prompts``: bounded,
        least recently used released) and served by relay attention.

        Returns (None, all ids) where relay cannot apply: a model with a sliding window, a template
        whose rendering of the system message alone is not a token prefix of the chat, or every
        registered prompt busy at the bound.
        """
        return self._relay_split(self.chat_ids(messages, system), system)

    def _relay_split(self, ids: list[int], system: str) -> tuple[int | None, list[int]]:
        head = self.engine.chat_token_ids([{"role": "system", "content": system}], add_generation_prompt=False)
        if not self.engine.supports_relay or len(head) >= len(ids) or ids[: len(head)] != head:
            return None, ids
        sid = self.engine.relay_prompts.acquire(head)
        return (None, ids) if sid is None else (sid, ids[len(head) :])

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None, system: str | None = None,
        session_id: str | None = None, relay: bool = False, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> RequestOutput:
        """Answer the conversation ``messages``. With ``session_id`` the conversation's KV is kept
        between calls (``enable_sessions``): send the whole conversation each turn, as with any
        chat API; only what is new since the stored KV is prefilled. ``metrics`` says how much was
        reused, from where, and how much of the loading was hidden. With ``relay`` a leading system
        prompt is served by relay attention (see ``add_chat_request``). ``continue_final_message``
        (with ``add_generation_prompt=False``) continues the last, assistant's, message: its text is
        then only the continuation (see ``chat_ids``)."""
        # a session turn reusing stored KV takes its cache blocks at once: with the cache full it waits
        # for room as the requests running beside it (other callers' streams, turns) finish
        return self._collect(lambda: [self.engine.when_room(
            lambda: self.add_chat_request(messages, params, system, session_id, relay,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message))])[0]

    def add_chat_request(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None, system: str | None = None,
        session_id: str | None = None, relay: bool = False, request_id: str | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
    ) -> str:
        """Queue a chat without stepping the engine (for a caller whose own loop steps it, like the
        server's); returns the request id. ``relay``: a system prompt (``system``, or the chat's
        leading system message) is registered once and followed by relay attention. A session turn
        never uses relay: the session's stored KV holds the system prompt with the rest of the
        history, and the whole of it is one stored prefix, loaded as such.

        ``add_generation_prompt``/``continue_final_message``: as in ``chat_ids``. A continued message
        needs nothing more of relay (the system prompt is still checked to be a token prefix of the
        prompt) or of a session: the stored KV is matched by common prefix, so the next turn, which
        renders the continued message closed, reuses everything up to where the template closes it."""
        chat = self.render(messages, system, add_generation_prompt, continue_final_message)
        return self.add_rendered_chat(chat, params, session_id, relay, request_id)

    def add_rendered_chat(self, chat: RenderedChat, params: SamplingParams | None = None,
                          session_id: str | None = None, relay: bool = False, request_id: str | None = None) -> str:
        """``add_chat_request`` for a chat ``render`` gave, for a caller that counted it first (the
        server): its ids and session counts are used rather than rendered again."""
        if session_id is not None:
            if self.engine.sessions is None:
                self.enable_sessions()
            return self.engine.add_session_request(session_id, chat.ids, params, new_tokens=chat.new_tokens,
                                                   keep_first=chat.kept_tokens, request_id=request_id)
        messages, system = chat.messages, chat.system
        leading = system if system is not None else messages[0]["content"] if messages[0]["role"] == "system" else None
        sid, ids = None, chat.ids
        if relay and leading is not None:
            sid, ids = self._relay_split(ids, leading)
        return self.engine.add_request(ids, params, request_id, system=sid)

    def chat_sessions(
        self, turns: list[tuple[str, list[dict[str, str]]]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Serve turns of several sessions in order, as a job queue: while one runs, the sessions of
        the turns queued behind it are prefetched from disk into memory (the scheduler-aware
        look-ahead window; ``SessionStore.hint``)."""
        if self.engine.sessions is None:
            self.enable_sessions()
        outs = []
        for i, (session_id, messages) in enumerate(turns):
            self.engine.sessions.hint([sid for sid, _ in turns[i + 1 :]])
            outs.append(self.chat(messages, params, session_id=session_id))
        return outs

    def enable_sessions(
        self, root: str | None = None, cpu_bytes: int = 4 << 30, disk_bytes: int = 32 << 30,
        policy: str = "scheduler", ttl_s: float | None = None,
    ) -> None:
        """Keep sessions in host memory (and on disk under ``root``, if given)."""
        from .sessions import SessionStore

        e = self.engine
        e.enable_sessions(SessionStore(root, e.fingerprint, e.dtype, cpu_bytes, disk_bytes, policy, ttl_s))

    def last_message_tokens(self, messages: list[dict[str, str]], system: str | None, ids: list[int]) -> int:
        """Tokens of the chat's last message with what the template puts after it (the generation
        prompt), of ``ids``, the chat's prompt ids as ``chat_ids`` rendered them: a session turn's new
        tokens, which no cut of the session's history shortens. A turn whose last message fills the
        context by itself can therefore never run; ``RenderedChat.turn_floor``, which adds the header the
        engine keeps before it, is the count a caller refuses a turn by before the engine takes it."""
        from .sessions.history import common_prefix

        if len([m for m in messages if m["role"] != "system"]) < 2:
            return len(ids)
        before = self._render(messages[:-1], system, generation_prompt=False)
        return len(ids) - common_prefix(ids, before)

    def _system_tokens(self, messages: list[dict[str, str]], system: str | None) -> int:
        """Tokens before the first user message's text (system prompt and template header): the
        part an overflowing conversation always keeps."""
        from .sessions.history import common_prefix

        sys_msgs = [m for m in messages if m["role"] == "system"][:1]
        a = self._render([*sys_msgs, {"role": "user", "content": "a"}], system, generation_prompt=False)
        b = self._render([*sys_msgs, {"role": "user", "content": "b"}], system, generation_prompt=False)
        return max(common_prefix(a, b), 1)

    def _render(self, messages: list[dict[str, str]], system: str | None, generation_prompt: bool,
                continue_final_message: bool = False) -> list[int]:
        if system is not None:
            messages = [{"role": "system", "content": system}, *[m for m in messages if m["role"] != "system"]]
        return self.engine.chat_token_ids(messages, generation_prompt, continue_final_message)


@dataclass(frozen=True, eq=False)
class RenderedChat:
    """A chat's prompt ids as ``LLM.render`` rendered them, with the messages they came from and
    what a session turn counts of them (each worked out on first use, then kept): the counts a
    caller checks a turn by and the ones the engine plans it by are then one and the same."""

    llm: LLM
    messages: list[dict[str, str]]
    system: str | None
    ids: list[int]

    @cached_property
    def new_tokens(self) -> int:
        """A session turn's new tokens (``LLM.last_message_tokens``)."""
        return self.llm.last_message_tokens(self.messages, self.system, self.ids)

    @cached_property
    def kept_tokens(self) -> int:
        """The header a session turn always keeps: system prompt and template header before the first
        user message's text."""
        return self.llm._system_tokens(self.messages, self.system)

    @property
    def turn_floor(self) -> int:
        """The fewest prompt tokens a session turn of this chat can be cut to (``sessions.history.turn_floor``):
        its new message and the header the engine always keeps. A caller that refuses a turn, or caps its
        answer, by this count before the engine takes it agrees with the engine's own planning."""
        from .sessions.history import turn_floor

        return turn_floor(len(self.ids), self.new_tokens, self.kept_tokens)
