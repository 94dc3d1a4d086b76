"""Mistral: the Llama decoder with sliding-window attention, which ``ModelConfig.sliding_window``
carries into every ``Attention``; nothing else in the architecture differs."""

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
