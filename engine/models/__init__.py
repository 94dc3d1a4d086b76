"""One model file per family; ``build_model`` picks the class from the checkpoint's architecture."""

from __future__ import annotations

from ..config import ModelConfig
from .llama import KVHook, LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def build_model(config: ModelConfig, max_positions: int | None = None) -> LlamaForCausalLM:
    return MODEL_CLASSES[config.architecture](config, max_positions)


__all__ = ["KVHook", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "build_model"]
