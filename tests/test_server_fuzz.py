"""Fuzzing the server's OpenAPI spec with schemathesis against a live server: whatever a client
sends (valid or not per the spec), the answer is never a 5xx. Bounded: a few examples per route."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.server_helpers import KEY, MODEL, LiveServer

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 25


@pytest.fixture(scope="module")
def live(tmp_path_factory, engine):
    from ragfuse.connectors.server import ServerSettings, create_app
    from ragfuse.connectors.server.engine_backend import EngineBackend, open_store_pipeline

    pipeline = open_store_pipeline(str(tmp_path_factory.mktemp("store")), MODEL, engine=engine, gate=False)
    # a 4-token cap keeps every generated example cheap on CPU
    app = create_app(EngineBackend(pipeline, MODEL), ServerSettings(api_key=KEY, max_tokens=4, max_body_bytes=1 << 18))
    with LiveServer(app) as srv:
        doc = {"documents": [{"name": "fuzz.md", "text": "The fuzz server keeps one short document."}]}
        assert httpx.post(f"{srv.url}/v1/documents", json=doc, headers=AUTH, timeout=120).status_code == 200
        yield srv


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=AUTH)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(api_schema, live, mode):
    """Valid bodies (positive) and ones that break the spec (negative), per operation."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=live.url, headers=AUTH, checks=[not_a_server_error], timeout=120)

        try:
            check()
        except Unsatisfiable:  # nothing in this operation can be made invalid (no parameters, no body)
            assert mode is GenerationMode.NEGATIVE


def test_the_spec_names_every_route(live):
    spec = httpx.get(f"{live.url}/openapi.json", headers=AUTH).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/rag/query", "/v1/documents",
            "/v1/documents/{document_id}", "/v1/sessions", "/v1/sessions/{session_id}", "/health",
            "/metrics"} <= set(spec["paths"])
    assert MODEL  # the server under test serves the default model
