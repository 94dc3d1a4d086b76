"""Qwen2: the Llama decoder with a bias on the q/k/v projections (``ModelConfig.attention_bias``
is True for this architecture; its packed loader fills the bias shards like the weights) and, where
the config asks, a sliding window on some layers (``ModelConfig.layer_windows``)."""

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
