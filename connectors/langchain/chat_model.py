"""``ChatRagfuse``: a LangChain chat model served by the ragfuse engine, fusing stored chunks' KV.

Documents reach it as separate parts of the call, never as one anonymous string:
- ``documents=[...]`` (LangChain ``Document``s, e.g. from ``RagfuseRetriever``, or strings) on
  ``invoke``/``stream``: they open the last user message, one passage each;
- ``text-plain`` content blocks in a message: one passage each;
- with a store, chunks that a chain already flattened into a message's text (the standard
  "stuff documents" chain formats its documents into the prompt) are found again by exact match
  against the docstore, so the standard retrieval chain keeps its chunk identity too.

A passage whose KV is in the store is fused; any other text is prefilled. Usage
(``usage_metadata``, with ``input_token_details.cache_read`` = reused stored tokens) and the fusion
statistics (``response_metadata["ragfuse"]``) come with the last chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from typing import Annotated, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.chat_models import BaseChatModel, agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import AfterValidator, Field

from ragfuse.app import serving_model, shared_engine, shared_pipeline
from ragfuse.chat_prompt import chat_parts
from ragfuse.engine import SamplingParams
from ragfuse.pipeline import MODES, AskResult, Passage, RagPipeline, known_mode
from ragfuse.prompt import passage_token_ids

from ..async_iter import iterate_in_thread
from .documents import document_passage

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool",
          "developer": "system"}  # OpenAI's newer name for system; templates render role names verbatim
_CALL_OPTIONS = ("temperature", "max_tokens", "top_p", "seed", "mode", "recompute_ratio")


class ChatRagfuse(BaseChatModel):
    """A chat model over the ragfuse engine; with ``store``, stored chunks in its prompts are fused."""

    model: str | None = None  # None: the store's model (the default model without a store)
    store: str | None = None  # a store directory; None: no stored KV, every prompt is prefilled
    device: str = "auto"
    temperature: float = Field(default=0.0, ge=0.0)
    max_tokens: int = Field(default=256, ge=1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    mode: Annotated[str, AfterValidator(known_mode)] = "fuse"  # fuse | reuse | prefix | full: how stored KV is used
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)  # None: the gate's r* for the model
    find_stored_chunks: bool = True  # look for stored chunks in flattened message text
    streaming: bool = False

    @property
    def _llm_type(self) -> str:
        return "ragfuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Everything that changes the answer. LangChain's LLM cache keys entries by these (with the
        call's own options): a field left out here lets two differently configured models (say
        ``max_tokens=8`` and ``max_tokens=256``) share cache entries and hand each other's answers back."""
        return {"model": self.model, "store": self.store, "device": self.device, "mode": self.mode,
                "recompute_ratio": self.recompute_ratio, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "seed": self.seed, "stop": self.stop,
                "find_stored_chunks": self.find_stored_chunks}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop or self.stop, **kwargs)
        params["ls_provider"] = "ragfuse"
        params["ls_model_name"] = kwargs.get("model") or serving_model(self.store, self.model)  # a call's own first
        return params

    # ---- counting tokens ----------------------------------------------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        """The model's own tokens. LangChain's fallback counts with GPT-2's tokenizer, fetched from the
        Hub: another model's counts, and offline none at all (every text counted as 0 tokens)."""
        return self._token_ids(text, None)

    def _token_ids(self, text: str, tokenizer: Any | None) -> list[int]:
        """``get_token_ids`` with the tokenizer already looked up (``None``: look it up), so a count over
        many message parts reads the store's config once."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        if tokenizer is None:
            tokenizer = self._tokenizer()
        return list(tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The prompt's tokens as the model reads them, the chat template included (what ``trim_messages``
        with this model as its counter needs; the same count as the answer's ``usage_metadata["input_tokens"]``
        for plain text). LangChain's default counts a "Human: ..." transcript instead."""
        if tools:
            raise ValueError("ChatRagfuse does not take tools")
        tokenizer = self._tokenizer()
        parts = chat_parts(tokenizer, [(_role(m), _message_parts(m)) for m in messages])
        return sum(len(self._token_ids(p, tokenizer)) if isinstance(p, str)
                   else len(passage_token_ids(tokenizer, p.text)) for p in parts)

    def _tokenizer(self) -> Any:
        """The model's tokenizer from the shared engine: counting tokens needs no pipeline, whose accuracy gate
        (no ratio set) would calibrate r* first, minutes on a CPU."""
        return shared_engine(self.store, self.model, self.device).tokenizer

    # ---- building the request ---------------------------------------------------------------

    def _pipeline(self) -> RagPipeline:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} ({', '.join(MODES)})")
        return shared_pipeline(self.store, self.model, self.device, gate=self.recompute_ratio is None)

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[RagPipeline, list[str | Passage], SamplingParams, str, float | None]:
        model, served = kwargs.pop("model", None), serving_model(self.store, self.model)
        if model is not None and model != served:
            raise ValueError(f"this ChatRagfuse serves {served!r}; make another for {model!r}")
        documents: Sequence[Document | str | Passage] = kwargs.pop("documents", None) or ()
        kwargs.pop("stream", None)  # LangChain's switch between _stream and _generate, acted on already
        unknown = set(kwargs) - set(_CALL_OPTIONS)
        if unknown:
            raise ValueError(f"ChatRagfuse does not take {', '.join(sorted(unknown))}")
        opts = {k: kwargs.get(k, getattr(self, k)) for k in _CALL_OPTIONS}
        pipe = self._pipeline()
        turns = [(_role(m), _message_parts(m)) for m in messages]
        if documents:
            _add_documents(turns, [document_passage(d) for d in documents])
        finder = pipe.finder if pipe.store is not None and self.find_stored_chunks else None
        parts = chat_parts(pipe.engine.tokenizer, turns, finder)
        stop = stop if stop is not None else self.stop  # callers pass one string too (SamplingParams takes it as one)
        params = SamplingParams(max_tokens=opts["max_tokens"], temperature=opts["temperature"], top_p=opts["top_p"],
                                seed=opts["seed"], stop=stop if isinstance(stop, str) else list(stop or []))
        return pipe, parts, params, opts["mode"], opts["recompute_ratio"]

    # ---- generating -------------------------------------------------------------------------

    def _stream(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        pipe, parts, params, mode, ratio = self._request(messages, stop, kwargs)
        for item in pipe.stream_parts(parts, mode, ratio, params):
            if isinstance(item, AskResult):
                yield self._last_chunk(item)
            elif item.delta_text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=item.delta_text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(item.delta_text, chunk=chunk)
                yield chunk

    async def _astream(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # closing this stream closes the worker's (aborting the engine request) before it returns
        async with aclosing(iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs))) as chunks:
            async for chunk in chunks:
                if run_manager is not None and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    def _last_chunk(self, result: AskResult) -> ChatGenerationChunk:
        out = len(result.token_ids)
        usage = UsageMetadata(input_tokens=result.prompt_tokens, output_tokens=out,
                              total_tokens=result.prompt_tokens + out,
                              input_token_details={"cache_read": result.reused_tokens})
        message = AIMessageChunk(
            content="", usage_metadata=usage, chunk_position="last",
            response_metadata={"model_name": serving_model(self.store, self.model), "model_provider": "ragfuse",
                               "finish_reason": result.finish_reason, "ragfuse": result.stats()},
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):  # a free-form role: the OpenAI names chat templates do not know mapped
        return _ROLES.get(message.role, message.role)
    if message.type not in _ROLES:
        raise ValueError(f"ChatRagfuse cannot take a {message.type!r} message")
    return _ROLES[message.type]


def _message_parts(message: BaseMessage) -> list[str | Passage]:
    """A message's text, with its ``text-plain`` blocks as passages (their ``extras`` may name a chunk)."""
    if isinstance(message.content, str):
        return [message.content]
    parts: list[str | Passage] = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            if not isinstance(block.get("text"), str):
                raise ValueError("a text content block needs its text (a string under 'text')")
            parts.append(block["text"])
        elif block.get("type") == "text-plain":
            extras = block.get("extras") or {}
            parts.append(document_passage(Document(page_content=block.get("text", ""),
                                                   metadata={"source": block.get("title", ""), **extras})))
        else:
            raise ValueError(f"ChatRagfuse takes text only, not {block.get('type')!r} content")
    return parts


def _add_documents(turns: list[tuple[str, list[str | Passage]]], passages: list[Passage]) -> None:
    """Documents open the last user message (before its question), as RAG prompts put them. A
    blank question is refused: the model would answer the documents with whatever it makes up."""
    for role, parts in reversed(turns):
        if role == "user":
            if not any(isinstance(p, str) and p.strip() for p in parts):
                raise ValueError("documents= need a question: the last user message is empty")
            parts[:0] = passages
            return
    raise ValueError("documents= need a question: there is no user message")
