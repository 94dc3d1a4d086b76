"""Request bodies of the API, as pydantic models: they are the OpenAPI spec clients and fuzzers read,
and they reject malformed input (wrong types, out-of-range sampling values) before it reaches the engine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticKnownError

SEED_MAX = 2**63 - 1
StopStr = Annotated[str, Field(min_length=1, max_length=256)]
SessionId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]


class _Body(BaseModel):
    # unknown fields are ignored, as OpenAI clients send options this server does not implement
    model_config = ConfigDict(extra="ignore")


class SamplingFields(_Body):
    max_tokens: int | None = Field(None, ge=1, description="at most the server's --max-tokens")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: StopStr | Annotated[list[StopStr], Field(max_length=4)] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="one choice per request")


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


class CompletionRequest(SamplingFields):
    model: str
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    stream_options: StreamOptions | None = None


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
