"""Qwen2: the Llama decoder with a bias on the q/k/v projections (``ModelConfig.attention_bias``
defaults to True for this architecture); its packed loader fills the bias shards like the weights."""

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
