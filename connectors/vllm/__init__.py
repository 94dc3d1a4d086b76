"""ragfuse inside vLLM: a v1 KV connector over ragfuse's tiered store, and a backend that runs vLLM with it.

Importing this package does not import vLLM (``ragfuse`` must work without it); ``backend`` imports
vLLM when a backend is built, ``connector`` at import (vLLM loads it by module path).
"""

from .plan import CHUNK, CONTEXT, Span, context_key, plan_spans
from .settings import ConnectorSettings

__all__ = ["CHUNK", "CONTEXT", "ConnectorSettings", "Span", "context_key", "plan_spans"]
