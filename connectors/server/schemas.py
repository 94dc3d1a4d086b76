"""Request bodies of the API, as pydantic models: they are the OpenAPI spec clients and fuzzers read,
and they reject malformed input (wrong types, out-of-range sampling values) before it reaches the engine."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticKnownError

from ragfuse.engine.sessions import SESSION_ID_PATTERN

SEED_MAX = 2**63 - 1
StopStr = Annotated[str, Field(min_length=1, max_length=256)]
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]  # the session store's own rule


class _Body(BaseModel):
    """Unknown fields are ignored, as OpenAI clients send options this server does not implement.
    Known ones are strict about JSON types, as OpenAI's API is: in pydantic's lax mode ``true`` would
    pass as the integer 1, ``"yes"`` as a boolean and ``"0.5"`` as a number, a client's mistake served
    as if it had asked for something (numbers still take integers: ``"temperature": 1`` is valid).
    Python's JSON reader takes ``NaN`` and ``Infinity``, which JSON has not: refused as not finite."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _unsupported(neutral: str) -> Any:
    return Field(None, description=f"not supported: refused unless left out or {neutral}")


class _Refusing(_Body):
    """A request body that refuses the OpenAI options this server cannot honour when they ask for
    something: ignoring ``tools`` or ``logprobs`` would hand back an answer the client did not ask for
    (no tool call, no log-probabilities) as if it were one. Harmless extras (``user``, ``metadata``)
    stay ignored. ``NEUTRAL`` maps each such option to the values that ask for nothing.

    Every such option a request asks for is named in one refusal (located at the first, in the
    request's order): refusing one at a time would have the client fix them over as many round trips."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: the model's own validation says so
        asked = [name for name, value in data.items()
                 if name in cls.NEUTRAL and not any(_same_json(value, n) for n in cls.NEUTRAL[name])]
        if not asked:
            return data
        options = asked[0] if len(asked) == 1 else f"{', '.join(asked[:-1])} and {asked[-1]}"
        error = PydanticCustomError("unsupported", "ragfuse does not support {options}: leave {them} out",
                                    {"options": options, "them": "it" if len(asked) == 1 else "them"})
        # raised as a ValidationError, which pydantic passes on as it is, so that the refusal is located
        # at an option (the error's ``param``), as one option's refusal is
        raise ValidationError.from_exception_data(cls.__name__, [
            InitErrorDetails(type=error, loc=(asked[0],), input=data[asked[0]])])


def _same_json(value: Any, neutral: Any) -> bool:
    """``value`` is ``neutral`` as JSON sees it: Python's ``==`` takes ``false`` for ``0`` and ``1.0``
    for ``1``, so ``"logprobs": 0`` or ``"best_of": true`` would pass as the option left alone."""
    return type(value) is type(neutral) and value == neutral


class SamplingFields(_Refusing):
    max_tokens: int | None = Field(None, ge=1, description="at most the server's --max-tokens")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: StopStr | Annotated[list[StopStr], Field(max_length=4)] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: Any = _unsupported("0")
    frequency_penalty: Any = _unsupported("0")
    logit_bias: Any = _unsupported("empty")
    NEUTRAL = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {})}

    @field_validator("temperature", "top_p", "n", "stream", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's spec makes these nullable, null meaning the default, and clients that fill every
        option send ``null`` for the ones left unset: a 400 for that would refuse a plain request."""
        return cls.model_fields[info.field_name or ""].default if value is None else value

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _only_when_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        """``stream_options`` (chat, completions) shape a stream: sent without ``stream: true`` it asks
        for usage in chunks that never come, which OpenAI's API refuses rather than ignores."""
        if value is not None and not info.data.get("stream", False):
            raise PydanticCustomError("stream_options", "stream_options is only allowed when stream is true")
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _encodable(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which cannot be UTF-8 encoded, so no
        tokenizer takes it: refused here with the error pydantic gives it in the constrained text fields
        (``prompt``, ``question``, ``stop``), which check this themselves; a plain ``str`` does not."""
        for text in [content] if isinstance(content, str) else [part.text for part in content]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise PydanticKnownError("string_unicode") from None
        return content


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream_options: StreamOptions | None = None
    session_id: SessionId | None = Field(
        None, description="ragfuse: continue this session (its stored KV reused; send the whole conversation)")
    relay: bool | None = Field(None, description="ragfuse: serve a leading system message by relay attention "
                                                 "(default: the server's setting)")
    add_generation_prompt: bool = Field(True, description="vLLM's: open a new assistant turn after the messages")
    continue_final_message: bool = Field(
        False, description="vLLM's: continue the final message, an assistant's, left open (send "
                           "add_generation_prompt false with it); the response holds only the continuation")
    tools: Any = _unsupported("empty")
    tool_choice: Any = _unsupported('"none"')
    functions: Any = _unsupported("empty")
    function_call: Any = _unsupported('"none"')
    logprobs: Any = _unsupported("false")
    top_logprobs: Any = _unsupported("0")
    response_format: Any = _unsupported('{"type": "text"}')
    modalities: Any = _unsupported('["text"]')
    audio: Any = _unsupported("null")
    web_search_options: Any = _unsupported("null")
    NEUTRAL = {**SamplingFields.NEUTRAL, "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "logprobs": (None, False), "top_logprobs": (None, 0),
               "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
               "web_search_options": (None,)}

    @field_validator("continue_final_message")
    @classmethod
    def _continuable(cls, value: bool, info: ValidationInfo) -> bool:
        """vLLM's rules, so that a request behaves alike on both servers: the final message is left open
        only where no new turn is opened after it (``add_generation_prompt`` defaults to true, and
        transformers refuses the two together), and only an assistant's message is continued."""
        if not value:
            return value
        if info.data.get("add_generation_prompt") is True:
            raise PydanticCustomError("continue_final_message", "continue_final_message and add_generation_prompt "
                                      "cannot both be true (add_generation_prompt defaults to true): send "
                                      "add_generation_prompt false to continue the final message")
        messages = info.data.get("messages")
        if messages and messages[-1].role != "assistant":
            raise PydanticCustomError("continue_final_message", "continue_final_message continues the final "
                                      "message, which must be the assistant's: the last message's role is {role}",
                                      {"role": messages[-1].role})
        return value


class CompletionRequest(SamplingFields):
    model: str
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    stream_options: StreamOptions | None = None
    logprobs: Any = _unsupported("null")
    echo: Any = _unsupported("false")
    best_of: Any = _unsupported("1")
    suffix: Any = _unsupported("empty")
    NEUTRAL = {**SamplingFields.NEUTRAL, "logprobs": (None,), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, "")}

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """OpenAI's ``prompt`` may be a batch (a list of strings or of token-id lists), which clients
        send for one prompt too (``["Hello"]``): a batch of one is that prompt. A longer one is refused
        as such, not blamed on its first item ("prompt.0: should be a valid integer")."""
        if not (isinstance(value, list) and value and all(isinstance(v, str | list) for v in value)):
            return value
        if len(value) > 1:
            raise PydanticCustomError("one_prompt", "ragfuse answers one prompt per request, got a batch of {count}",
                                      {"count": len(value)})
        return value[0]


class RagQueryRequest(SamplingFields):
    question: str = Field(min_length=1, max_length=8192)
    model: str | None = None
    top_k: int = Field(5, ge=1)
    mode: Literal["fuse", "full", "prefix", "reuse"] = "fuse"
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    session_id: SessionId | None = Field(None, description="ragfuse: the question is this session's next turn")
    relay: bool | None = Field(None, description="ragfuse: serve the instruction prefix by relay attention "
                                                 "(default: the server's setting)")


class DocumentText(_Body):
    name: str = Field(description="file name with a supported suffix, e.g. notes.md")
    text: str


class DocumentsRequest(_Body):
    documents: list[DocumentText] = Field(min_length=1, max_length=256)
