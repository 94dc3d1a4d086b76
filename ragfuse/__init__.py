"""ragfuse: RAG middleware with a KV-cache fusion engine.

Heavy modules (torch, transformers) load on first use, so ``import ragfuse`` and the CLI's
``--help`` stay fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
_LAZY = {
    "LLM": "ragfuse.engine",
    "LLMEngine": "ragfuse.engine",
    "EngineConfig": "ragfuse.engine",
    "SamplingParams": "ragfuse.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragfuse' has no attribute {name!r}")
