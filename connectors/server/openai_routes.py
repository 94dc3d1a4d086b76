"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .backend import ChatPrompt, Delta, TextPrompt
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .state import ServerState, new_id
from .streaming import collect, event_stream, first_item, sse


def message_text(m: ChatMessage) -> str:
    return m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)


def make_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    def model_card() -> dict[str, Any]:
        return {"id": state.backend.model_id, "object": "model", "created": state.started,
                "owned_by": f"ragfuse ({state.backend.name} backend)"}

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model:path}")  # a model id may hold slashes ("org/name", a checkpoint's path)
    async def get_model(model: str) -> dict[str, Any]:
        state.check_model(model)
        return model_card()

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        t0 = time.perf_counter()
        state.check_model(body.model)
        sampling = state.sampling(body, body.max_tokens)
        rid, created = new_id("cmpl"), int(time.time())
        generated = state.backend.generate(TextPrompt(body.prompt), sampling, rid)
        deltas = state.metrics.metered(generated, "completions", t0)

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            last: list[Delta] = []
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def render(d: Delta) -> list[str]:
                last[:] = [d]
                return [sse(chunk(d.text, d.finish_reason))] if d.text or d.finished else []

            def tail() -> list[str]:
                return [sse({**chunk("", None), "choices": [], "usage": last[0].usage()})] if include_usage else []

            first = await first_item(request, deltas)
            return StreamingResponse(event_stream(first, deltas, render, tail), media_type="text/event-stream")
        got = await collect(request, deltas)
        return {**chunk("".join(d.text for d in got), got[-1].finish_reason), "usage": got[-1].usage()}

    @router.post("/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        t0 = time.perf_counter()
        state.check_model(body.model)
        # OpenAI's newer name for max_tokens, which it wins over
        max_tokens, param = ((body.max_completion_tokens, "max_completion_tokens")
                             if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        sampling = state.sampling(body, max_tokens, param)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
                    for m in body.messages]
        rid, created = new_id("chatcmpl"), int(time.time())
        relay = state.settings.relay if body.relay is None else body.relay
        prompt = ChatPrompt(messages, body.session_id, relay, body.add_generation_prompt, body.continue_final_message)
        generated = state.backend.generate(prompt, sampling, rid)
        deltas = state.metrics.metered(generated, "chat", t0)

        def chunk(delta: dict[str, str], reason: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            last: list[Delta] = []
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def render(d: Delta) -> list[str]:
                lines = [] if last else [sse(chunk({"role": "assistant", "content": ""}, None))]
                last[:] = [d]
                if d.text:
                    lines.append(sse(chunk({"content": d.text}, None)))
                if d.finished:
                    lines.append(sse(chunk({}, d.finish_reason)))
                return lines

            def tail() -> list[str]:
                return [sse({**chunk({}, None), "choices": [], "usage": last[0].usage()})] if include_usage else []

            first = await first_item(request, deltas)
            return StreamingResponse(event_stream(first, deltas, render, tail), media_type="text/event-stream")
        got = await collect(request, deltas)
        answer = "".join(d.text for d in got)
        return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": None,
                             "finish_reason": got[-1].finish_reason}],
                "usage": got[-1].usage()}

    return router
