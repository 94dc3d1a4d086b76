"""ragfuse's inference engine for Llama-family models: paged KV cache, continuous batching, and an
explicit layer loop that the cache-reuse paths reach into.

The errors load with the package; the rest (torch, transformers) on first use, so that what only
needs the errors (the CLI parsing its arguments, the store's directory checks) starts in a blink.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CacheFullError, EngineStopped, ModelError, RagfuseError, RequestError

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` loads them
    from .async_engine import AsyncEngine
    from .config import EngineConfig, ModelConfig
    from .llm import LLM
    from .llm_engine import LLMEngine, RequestOutput
    from .sampling import SamplingParams

_LAZY = {  # public name -> the submodule defining it
    "AsyncEngine": "async_engine", "EngineConfig": "config", "ModelConfig": "config", "LLM": "llm",
    "LLMEngine": "llm_engine", "RequestOutput": "llm_engine", "SamplingParams": "sampling",
}

__all__ = [
    "LLM", "AsyncEngine", "CacheFullError", "EngineConfig", "EngineStopped", "LLMEngine", "ModelConfig", "ModelError",
    "RagfuseError", "RequestError", "RequestOutput", "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value
