"""LangChain's standard chat model suites (``langchain-tests``) against ``ChatRagfuse`` and the default
model on CPU. What the model cannot do is switched off through the suite's capability properties, each
with its reason; everything else runs."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ragfuse.connectors.langchain import ChatRagfuse, RagfuseRetriever
from tests.store_helpers import connector_store

PARAMS = {"device": "cpu"}


class _Capabilities:
    @property
    def chat_model_class(self) -> type[ChatRagfuse]:
        return ChatRagfuse

    @property
    def chat_model_params(self) -> dict:
        return dict(PARAMS)

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": 16}  # short answers keep the CPU run short

    @property
    def has_tool_calling(self) -> bool:
        return False  # the default model's chat template has no tool-call format, and we do not invent one

    @property
    def has_structured_output(self) -> bool:
        return False  # no tool calling and no constrained (JSON-schema) decoding in the engine

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per model is loaded in process; a per-call model would load another

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}  # reused stored KV


class TestChatRagfuseUnit(_Capabilities, ChatModelUnitTests):
    pass


class TestChatRagfuseIntegration(_Capabilities, ChatModelIntegrationTests):
    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A question with the store's documents: their stored KV is read, not computed."""
        store = connector_store()
        docs = RagfuseRetriever(store=store, k=2).invoke("Hollowpoint lighthouse")
        model = ChatRagfuse(store=store, recompute_ratio=0.2, max_tokens=16, **PARAMS)
        question = "When was the Hollowpoint lighthouse electrified?"
        if not stream:
            return model.invoke(question, documents=docs)
        full = None
        for chunk in model.stream(question, documents=docs):
            full = chunk if full is None else full + chunk
        assert full is not None
        return AIMessage(content=full.content, usage_metadata=full.usage_metadata,
                         response_metadata=full.response_metadata)

    def test_cache_read_counts_stored_tokens(self) -> None:
        """Not part of the suite: the cache_read figure is the stored tokens actually reused."""
        msg = self.invoke_with_cache_read_input()
        fusion = msg.response_metadata["ragfuse"]
        assert msg.usage_metadata["input_token_details"]["cache_read"] == fusion["reused_tokens"] > 0
        assert all(s["stored"] for s in fusion["sources"])


pytestmark = pytest.mark.timeout(1800)
