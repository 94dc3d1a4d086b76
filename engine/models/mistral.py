"""Mistral: the Llama decoder with sliding-window attention, which ``ModelConfig.layer_windows``
carries into every layer's ``Attention``; nothing else in the architecture differs."""

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
