"""Real model shapes for benchmarks with random weights (timing does not depend on weight values)."""

from __future__ import annotations

from typing import Any

_BASE: dict[str, Any] = {"rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 2}

SHAPES: dict[str, dict[str, Any]] = {
    # a few MB: for smoke tests of the benchmarks' random-weight paths on a CPU
    "tiny-llama": {
        **_BASE, "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    },
    "mistral-7b": {
        **_BASE, "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
    },
    "llama-3.1-8b": {
        **_BASE, "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rope_theta": 500000.0,
    },
    "llama-2-7b": {
        **_BASE, "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    },
    "yi-34b": {
        **_BASE, "architectures": ["LlamaForCausalLM"], "vocab_size": 64000, "hidden_size": 7168,
        "intermediate_size": 20480, "num_hidden_layers": 60, "num_attention_heads": 56, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 5000000.0,
    },
}


def shape_config(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r} ({', '.join(SHAPES)})")
    return dict(SHAPES[name])
