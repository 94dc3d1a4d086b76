"""``RagfuseLLM``: a LlamaIndex LLM served by the ragfuse engine.

Chat messages are rendered with the model's own chat template; a plain ``complete`` prompt is one user
turn (``formatted=True``: the caller rendered it). With a store, the stored chunks a synthesizer
formatted into the prompt are found again by exact match, so their KV is fused; the rest is
prefilled. The fusion statistics ride in each response's ``additional_kwargs["ragfuse"]`` (on the
last one when streaming).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Annotated, Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import AfterValidator, Field

from ragfuse.app import serving_model, shared_engine, shared_pipeline
from ragfuse.chat_prompt import chat_parts
from ragfuse.engine import RequestOutput, SamplingParams
from ragfuse.passage import Passage
from ragfuse.pipeline import MODES, AskResult, RagPipeline, known_mode

from ..async_iter import iterate_in_thread

_CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop")  # what a call may set for itself


class RagfuseLLM(CustomLLM):
    """An LLM over the ragfuse engine; with ``store``, stored chunks in its prompts are fused."""

    model: str | None = Field(default=None, description="model alias or path; None: the store's (the default "
                                                       "model without a store)")
    store: str | None = Field(default=None, description="ragfuse store directory; None: no stored KV")
    device: str = "auto"
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    mode: Annotated[str, AfterValidator(known_mode)] = "fuse"  # fuse | reuse | prefix | full: how stored KV is used
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)  # None: the gate's r* for the model
    find_stored_chunks: bool = True  # look for stored chunks in prompt text

    @classmethod
    def class_name(cls) -> str:
        return "RagfuseLLM"

    def pipeline(self) -> RagPipeline:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} ({', '.join(MODES)})")
        return shared_pipeline(self.store, self.model, self.device, gate=self.recompute_ratio is None)

    @property
    def metadata(self) -> LLMMetadata:
        # the engine alone: LlamaIndex reads this as a synthesizer is made, and a pipeline would calibrate the gate
        return LLMMetadata(context_window=shared_engine(self.store, self.model, self.device).max_model_len,
                           num_output=self.max_tokens,
                           is_chat_model=True, model_name=serving_model(self.store, self.model))

    # ---- one request --------------------------------------------------------------------------

    def _stream(self, turns: list[tuple[str, list[str | Passage]]] | None, text: str | None,
                params: SamplingParams) -> Iterator[tuple[str, AskResult | None]]:
        """(text delta, None) as tokens come, then ("", result). The engine is loaded at the first read
        (on a worker thread for the async methods)."""
        pipe = self.pipeline()
        finder = pipe.finder if pipe.store is not None and self.find_stored_chunks else None
        if turns is not None:
            parts = chat_parts(pipe.engine.tokenizer, turns, finder)
        else:
            parts = finder.split(text or "") if finder is not None else [text or ""]
        yield from _deltas(pipe.stream_parts(parts, self.mode, self.recompute_ratio, params))

    def stream_answer(self, question: str, passages: list[Passage], **kwargs: Any) -> CompletionResponseGen:
        """ragfuse's RAG prompt over the caller's passages (what ``RagfuseSynthesizer`` asks), streamed as
        completions. It is an LLM call as LlamaIndex's callbacks and instrumentation know one (an ``LLM``
        event with the prompt and the last response, whose ``raw["usage"]`` has the exact token counts), so
        a query's LLM call is traced and counted as with LlamaIndex's own synthesizers."""
        return self._stream_answer(self.rag_prompt(question, passages), question, passages, **kwargs)

    async def astream_answer(self, question: str, passages: list[Passage], **kwargs: Any
                             ) -> CompletionResponseAsyncGen:
        """``stream_answer`` for async code: the engine (loaded on first use) runs on worker threads."""
        prompt = await asyncio.to_thread(self.rag_prompt, question, passages)
        return await self._astream_answer(prompt, question, passages, **kwargs)

    def rag_prompt(self, question: str, passages: list[Passage]) -> str:
        """The RAG prompt's text, for the callbacks' record: what the model reads, passages tokenized alone."""
        pipe = self.pipeline()
        tokens = pipe.builder.token_ids([pipe.builder.passage_tokens(p.text) for p in passages], question)
        return pipe.engine.tokenizer.decode(tokens)

    @llm_completion_callback()
    def _stream_answer(self, prompt: str, question: str, passages: list[Passage],
                       **kwargs: Any) -> CompletionResponseGen:
        return self._answer_completions(question, passages, kwargs)

    @llm_completion_callback()
    async def _astream_answer(self, prompt: str, question: str, passages: list[Passage],
                              **kwargs: Any) -> CompletionResponseAsyncGen:
        return _in_thread(self._answer_completions(question, passages, kwargs))

    def _answer_completions(self, question: str, passages: list[Passage],
                            kwargs: dict[str, Any]) -> CompletionResponseGen:
        return _completions_of(self._answer_deltas(question, passages, self._params(kwargs)))

    def _answer_deltas(self, question: str, passages: list[Passage],
                       params: SamplingParams) -> Iterator[tuple[str, AskResult | None]]:
        yield from _deltas(self.pipeline().stream_passages(question, passages, self.mode, self.recompute_ratio,
                                                           params))

    def _params(self, kwargs: dict[str, Any]) -> SamplingParams:
        """The call's sampling options; any other keyword is refused, never dropped: a caller's ``top_k``
        or ``max_new_tokens`` silently ignored would answer otherwise than asked."""
        unknown = set(kwargs) - set(_CALL_OPTIONS)
        if unknown:
            raise ValueError(f"RagfuseLLM does not take {', '.join(sorted(unknown))} "
                             f"(a call takes {', '.join(_CALL_OPTIONS)})")
        opts = {k: kwargs.get(k, getattr(self, k)) for k in ("max_tokens", "temperature", "top_p", "seed")}
        stop = kwargs.get("stop")  # a string, a list of them, or None (SamplingParams takes a string as one)
        return SamplingParams(**opts, stop=stop if isinstance(stop, str) else list(stop or []))

    # The request is checked when these are called, not at the stream's first read: a streaming call
    # with a bad option or message raises where it is made (``await llm.astream_chat(...)`` included),
    # as the non-streaming calls do, instead of handing back a stream that fails later.

    def _completions(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseGen:
        turns = None if formatted else [("user", [prompt])]
        return _completions_of(self._stream(turns, prompt if formatted else None, self._params(kwargs)))

    def _chats(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        turns: list[tuple[str, list[str | Passage]]] = [(_role(m), [_text(m)]) for m in messages]
        return _chats_of(_completions_of(self._stream(turns, None, self._params(kwargs))))

    # ---- LlamaIndex's API ---------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _last(self._completions(prompt, formatted, kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completions(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _last(self._chats(messages, kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chats(messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await _alast(_in_thread(self._completions(prompt, formatted, kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return _in_thread(self._completions(prompt, formatted, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await _alast(_in_thread(self._chats(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(self._chats(messages, kwargs))


# LlamaIndex's roles as chat templates know them: templates render a role's name verbatim (SmolLM's
# writes "<|im_start|>developer"), so a role the model was never trained on would reach it as text
_ROLES = {MessageRole.DEVELOPER: "system", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.FUNCTION: "tool"}


def _role(message: ChatMessage) -> str:
    return _ROLES.get(message.role, message.role.value)


def _text(message: ChatMessage) -> str:
    """The message's text. ``content`` keeps only its text blocks: an image or a document the model would
    silently never see is refused instead."""
    other = [b.block_type for b in message.blocks if b.block_type != "text"]
    if other:
        raise ValueError(f"RagfuseLLM takes text only, not {', '.join(repr(t) for t in other)} content")
    return message.content or ""


def _deltas(items: Iterator[RequestOutput | AskResult]) -> Iterator[tuple[str, AskResult | None]]:
    for item in items:
        if isinstance(item, AskResult):
            yield "", item
        elif item.delta_text:
            yield item.delta_text, None


def _completions_of(deltas: Iterator[tuple[str, AskResult | None]]) -> CompletionResponseGen:
    """The responses of a stream of deltas, each with the text so far."""
    text = ""
    for delta, result in deltas:
        text += delta
        yield _completion(text, delta, result)


def _chats_of(completions: CompletionResponseGen) -> ChatResponseGen:
    for c in completions:
        yield ChatResponse(message=ChatMessage(role="assistant", content=c.text), delta=c.delta,
                           raw=c.raw, additional_kwargs=c.additional_kwargs)


def _in_thread(responses: Iterator[Any]) -> AsyncIterator[Any]:
    """A checked request's responses for async code: the engine (loaded on first use) runs on a worker
    thread, so the caller's event loop keeps running while the model does."""
    return iterate_in_thread(lambda: responses)


def _completion(text: str, delta: str, result: AskResult | None) -> CompletionResponse:
    """A response; the last one also has the statistics, and its token counts in ``raw["usage"]``, where
    LlamaIndex's ``TokenCountingHandler`` reads a provider's (it estimates with tiktoken otherwise)."""
    if result is None:
        return CompletionResponse(text=text, delta=delta)
    out = len(result.token_ids)
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": out,
             "total_tokens": result.prompt_tokens + out}
    extra = {"ragfuse": result.stats(), "prompt_tokens": result.prompt_tokens, "completion_tokens": out}
    return CompletionResponse(text=text, delta=delta, raw={"usage": usage}, additional_kwargs=extra)


def _last(responses: Iterator[Any]) -> Any:
    """The last of the streamed responses: it holds the whole text and the statistics."""
    last = None
    for item in responses:
        last = item
    assert last is not None
    return last


async def _alast(responses: AsyncIterator[Any]) -> Any:
    last = None
    async for item in responses:
        last = item
    assert last is not None
    return last
