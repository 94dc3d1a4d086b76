"""ragfuse's inference engine for Llama-family models: paged KV cache, continuous batching, and an
explicit layer loop that the cache-reuse paths reach into."""

from .async_engine import AsyncEngine
from .config import EngineConfig, ModelConfig
from .errors import ModelError, RagfuseError, RequestError
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams

__all__ = [
    "LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "ModelConfig", "ModelError", "RagfuseError", "RequestError",
    "RequestOutput", "SamplingParams",
]
