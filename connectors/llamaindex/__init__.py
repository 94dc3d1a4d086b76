"""LlamaIndex integration: an LLM over the ragfuse engine, a retriever over a ragfuse store, and a response
synthesizer that fuses the retrieved nodes' stored KV (for ``RetrieverQueryEngine`` or ``as_query_engine``).

Switching an app is one line (``Settings.llm = RagfuseLLM(store=...)``); a node whose text is a stored
chunk brings its KV whichever index retrieved it, other text is prefilled.
"""

from .llm import RagfuseLLM
from .retriever import RagfuseRetriever
from .synthesizer import RagfuseSynthesizer, ragfuse_query_engine

__all__ = ["RagfuseLLM", "RagfuseRetriever", "RagfuseSynthesizer", "ragfuse_query_engine"]
