"""LangChain integration: a chat model that fuses stored chunks' KV, and a retriever over a ragfuse store.

Switching an app is one line (``llm = ChatRagfuse(store=...)``); retrieved documents keep their
chunk identity, so their stored KV is fused instead of prefilled (see ``chat_model``).
"""

from .chat_model import ChatRagfuse
from .retriever import RagfuseRetriever

__all__ = ["ChatRagfuse", "RagfuseRetriever"]
