"""ragfuse over HTTP: an OpenAI-compatible API plus RAG, documents and sessions (``ragfuse serve``).

Importing this package does not start anything: ``create_app`` builds the FastAPI app over a
``Backend`` (ragfuse's own engine by default, or vLLM with ragfuse's connector).
"""

from .app import create_app
from .backend import Backend, Delta, Sampling
from .settings import ServerSettings

__all__ = ["Backend", "Delta", "Sampling", "ServerSettings", "create_app"]
