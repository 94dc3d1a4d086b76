"""ragfuse's own routes: ``/v1/rag/query`` (retrieve, fuse, answer), ``/v1/documents``, ``/v1/sessions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from .backend import Delta, RagAnswer, RagOptions
from .errors import APIError
from .library import document_id
from .schemas import DocumentsRequest, RagQueryRequest
from .state import ServerState, new_id
from .streaming import collect, event_stream, first_item, sse

MAX_UPLOAD_FILES = 64
TIMING = ("retrieve_s", "ttft_s", "total_s", "load_s", "load_hidden", "recompute_s")
FUSION = ("mode", "recompute_ratio", "prompt_tokens", "reused_tokens", "recomputed_tokens", "tiers", "decision",
          "relay_system_tokens")


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` inlined, for a request body declared by hand."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    return resolve(schema)


UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": inline_schema(DocumentsRequest)},
    "multipart/form-data": {"schema": {"type": "object", "required": ["files"], "properties": {
        "files": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
}}}


def client_source(source: dict[str, Any]) -> dict[str, Any]:
    """A retrieved chunk as clients see it: its file by name and by the id ``/v1/documents`` lists
    (which deletes it), never by its path on the server, which the document routes keep to themselves."""
    return {**source, "source": Path(source["source"]).name, "document_id": document_id(source["source"])}


def make_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["ragfuse"])

    @router.post("/rag/query", response_model=None)
    async def rag_query(body: RagQueryRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        """Retrieve the question's chunks, fuse their stored KV, answer; with the sources and where
        the time went (retrieval, KV load, recompute, first token)."""
        t0 = time.perf_counter()
        state.check_model(body.model)
        if body.top_k > state.settings.max_top_k:
            raise APIError(400, f"top_k must be at most {state.settings.max_top_k}", param="top_k")
        sampling = state.sampling(body, body.max_tokens)
        options = RagOptions(body.top_k, body.mode, body.recompute_ratio, body.session_id,
                             state.settings.relay if body.relay is None else body.relay)
        rid, created = new_id("rag"), int(time.time())
        first_at: list[float] = []

        async def items() -> AsyncIterator[Delta | RagAnswer]:
            answer = state.backend.rag(body.question, options, sampling, rid)
            async with aclosing(answer):
                async for item in answer:
                    if isinstance(item, Delta) and not first_at:
                        first_at.append(time.perf_counter())
                    yield item

        answers = state.metrics.metered(items(), "rag", t0)

        def report(ans: RagAnswer, last: Delta) -> dict[str, Any]:
            r = ans.report
            state.metrics.record_kv(ans.kv_tiers)
            return {"id": rid, "object": "rag.answer", "created": created, "model": state.backend.model_id,
                    "answer": r["answer"], "finish_reason": r["finish_reason"],
                    "sources": [client_source(s) for s in r["sources"]],
                    "timing": {**{k: r[k] for k in TIMING}, "server_ttft_s": first_at[0] - t0},
                    "fusion": {k: r[k] for k in FUSION}, "kv_tiers": ans.kv_tiers, "usage": last.usage(),
                    "session": r.get("session"), "notes": r["notes"]}

        if body.stream:
            seen: list[Delta] = []

            def render(item: Delta | RagAnswer) -> list[str]:
                if isinstance(item, RagAnswer):
                    return [sse(report(item, seen[-1]))]
                seen[:] = [item]
                return [sse({"id": rid, "object": "rag.answer.delta", "delta": item.text})] if item.text else []

            first = await first_item(request, answers)
            return StreamingResponse(event_stream(first, answers, render, list), media_type="text/event-stream")
        got = await collect(request, answers)
        deltas = [g for g in got if isinstance(g, Delta)]
        answer = got[-1]
        assert isinstance(answer, RagAnswer)
        return report(answer, deltas[-1])

    @router.get("/documents")
    async def list_documents() -> dict[str, Any]:
        return {"object": "list", "data": await state.backend.list_documents()}

    @router.post("/documents", openapi_extra=UPLOAD_BODY)
    async def add_documents(request: Request) -> dict[str, Any]:
        """Ingest uploaded content: multipart files, or JSON ``{"documents": [{"name", "text"}]}``.
        Names are plain file names (the suffix picks the reader); nothing is read from server paths."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "multipart/form-data":
            files = await _multipart(request)
        elif kind == "application/json":
            try:
                parsed = DocumentsRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from None
            files = [(d.name, d.text.encode()) for d in parsed.documents]
        else:
            raise APIError(415, "send the documents as multipart/form-data (files) or application/json")
        return await state.backend.add_documents(files)

    @router.delete("/documents/{document_id}")
    async def delete_document(document_id: str) -> dict[str, Any]:
        if not await state.backend.delete_document(document_id):
            raise APIError(404, f"no document with id {document_id[:80]!r}", param="document_id")
        return {"id": document_id, "object": "document.deleted", "deleted": True}

    @router.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        """Sessions whose KV is stored (chats and RAG queries that named a ``session_id``), most
        recently used first: tokens so far, the tier holding them, last access."""
        return {"object": "list", "data": await state.backend.list_sessions()}

    @router.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        """Drop the session's stored KV (memory and disk); its id starts afresh next time."""
        if not await state.backend.delete_session(session_id):
            raise APIError(404, f"no session with id {session_id[:80]!r}", param="session_id")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return router


async def _multipart(request: Request) -> list[tuple[str, bytes]]:
    try:
        form = await request.form(max_files=MAX_UPLOAD_FILES, max_fields=MAX_UPLOAD_FILES)
    except Exception as exc:  # malformed multipart, too many parts
        raise APIError(400, f"unreadable multipart body: {exc}") from None
    files = []
    for _, value in form.multi_items():
        if isinstance(value, UploadFile):
            files.append((value.filename or "", await value.read()))
    await form.close()
    if not files:
        raise APIError(400, "the multipart body has no files", param="files")
    return files
