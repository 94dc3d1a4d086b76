"""ragfuse inside vLLM: a v1 KV connector over ragfuse's tiered store, and a backend that runs vLLM with it.

Importing this package does not import vLLM (``ragfuse`` must work without it): ``VLLMBackend``
imports vLLM when one is built, ``connector`` at import (vLLM itself loads it by module path).
"""

from .backend import Generation, Prompt, VLLMBackend, import_vllm, kv_transfer_config, openai_server_command
from .plan import CHUNK, CONTEXT, Span, context_key, plan_spans
from .settings import ConnectorSettings

__all__ = ["CHUNK", "CONTEXT", "ConnectorSettings", "Generation", "Prompt", "Span", "VLLMBackend", "context_key",
           "import_vllm", "kv_transfer_config", "openai_server_command", "plan_spans"]
