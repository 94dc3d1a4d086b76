"""Model and engine configuration.

The model config is read from a checkpoint's ``config.json`` so the engine owns the few fields it
needs instead of carrying transformers' config classes through every layer. transformers 5 writes
RoPE settings as ``rope_parameters``; older checkpoints use ``rope_theta`` + ``rope_scaling``: both
are accepted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .errors import ModelError
from .weights import stored_tensor_names

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# the max_position_embeddings of transformers' config classes, which a config.json without the key gets
# there: it bounds the context and is llama3 scaling's default original_max_position_embeddings
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings: the base ``theta`` and a frequency scaling (linear, Llama-3.1's llama3, YaRN, or
    dynamic NTK, which equals none within ``original_max_position``, the context the engine allows).

    ``attention_factor`` is YaRN's factor on cos and sin, 1 for the other types. It multiplies every
    q·k by its square and is applied there (``ModelConfig.attention_scale``), never in the rotation
    tables: stored K is moved by rotating it again, which must not scale it again."""

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def inv_frequencies(self, head_dim: int) -> torch.Tensor:
        """The rotation's inverse frequencies, float32 [head_dim / 2], for positions below
        ``original_max_position`` where the scaling is dynamic (there it leaves them unscaled)."""
        from ragfuse.kernels.rope import inv_frequencies

        kind = "default" if self.scaling_type == "dynamic" else self.scaling_type
        return inv_frequencies(
            head_dim, self.theta, kind, self.factor, self.low_freq_factor, self.high_freq_factor,
            self.original_max_position, beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # on the q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    # each layer's attention window (None: the whole context), as transformers gives it: Mistral's window on
    # every layer, Qwen2's on the layers its ``layer_types`` (or ``max_window_layers``) mark, Llama's on none
    layer_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]
    # the weights store an lm_head.weight although the config ties the head to the embedding: unless it
    # equals the embedding the model holds it as its own head (``LlamaForCausalLM._settle_tied_head``),
    # and loading holds it beside the embedding in any case (``from_dir`` finds it, ``num_params`` counts it)
    head_stored: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_window(self) -> int | None:
        """The window of the layers that have one; None where every layer sees the whole context."""
        return next((w for w in self.layer_windows if w is not None), None)

    @property
    def family(self) -> str:
        return self.architecture.removesuffix("ForCausalLM").lower()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def attention_scale(self) -> float:
        """The factor on q·k before the softmax: 1/sqrt(head_dim), times the square of YaRN's attention
        factor, which transformers puts on both q's and k's cos and sin (``RopeConfig``)."""
        return self.head_dim**-0.5 * self.rope.attention_factor**2

    def num_params(self) -> int:
        """Weights the model holds (embeddings, projections, MLPs; biases and norms are too few to count),
        the output head counted apart from the embedding wherever the weights store one."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        own_head = self.head_stored or not self.tie_word_embeddings
        embeddings = self.vocab_size * self.hidden_size * (2 if own_head else 1)
        return self.num_layers * layer + embeddings

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "the model config") -> ModelConfig:
        """The engine's view of a ``config.json``; ``source`` names it in errors. A missing required
        field or a value of the wrong kind is a ModelError naming the field, never a traceback."""
        if not isinstance(cfg, dict):
            raise ModelError(f"{source} is not a JSON object")
        try:
            return cls._from_fields(cfg, source)
        except KeyError as exc:
            raise ModelError(f"{source} lacks the required field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{source} has a field of the wrong kind: {exc}") from exc

    @classmethod
    def _from_fields(cls, cfg: dict[str, Any], source: str) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type", "")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
                model_type
            )
        if arch is None:
            raise ModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: ragfuse runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported activation {cfg.get('hidden_act')!r} (only SwiGLU/silu)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # the biases transformers' classes build: Llama's follow its two flags (attention_bias also on
        # o_proj), Qwen2 always has q/k/v biases and no other, Mistral none
        llama = arch == "LlamaForCausalLM"
        qkv_bias = bool(cfg.get("attention_bias", False)) if llama else arch == "Qwen2ForCausalLM"
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // max(heads, 1))  # heads < 1: refused just below
        _check_heads(heads, kv_heads, head_dim, source)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_config(cfg),
            max_position_embeddings=max_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=llama and qkv_bias,
            mlp_bias=llama and bool(cfg.get("mlp_bias", False)),
            layer_windows=_layer_windows(cfg, arch, layers, source),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of the checkpoint in ``path``, and where it ties the output head whether the
        weights store one anyway (``head_stored``: read from their index or header, no tensor loaded).
        An unreadable or malformed ``config.json`` is a ModelError naming it."""
        file = Path(path) / "config.json"
        try:
            cfg = json.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ModelError(f"cannot read {file}: {exc.strerror or exc}") from exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ModelError(f"{file} is not valid JSON: {exc}") from exc
        config = cls.from_dict(cfg, source=str(file))
        if config.tie_word_embeddings and "lm_head.weight" in stored_tensor_names(Path(path)):
            config = replace(config, head_stored=True)
        return config


def _check_heads(heads: int, kv_heads: int, head_dim: int, source: str) -> None:
    """Refuse head layouts no Llama-family model has, which would otherwise run and give wrong
    logits: query heads not split evenly over the KV heads (the attention's grouping would then pair
    query heads with the wrong K/V; transformers refuses such a config too), or an odd head_dim,
    which rotate-half RoPE cannot pair up."""
    if heads < 1 or kv_heads < 1 or head_dim < 1:
        raise ModelError(f"{source}: head counts and head_dim must be positive (heads {heads}, "
                         f"num_key_value_heads {kv_heads}, head_dim {head_dim})")
    if heads % kv_heads:
        raise ModelError(f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                         f"({kv_heads})")
    if head_dim % 2:
        raise ModelError(f"{source}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of dimensions")


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers builds the architecture: Mistral's
    ``sliding_window`` on every layer; Qwen2's only with ``use_sliding_window``, on the layers that
    ``layer_types`` marks "sliding_attention" (by default those from ``max_window_layers`` on); Llama
    has none."""
    # MistralConfig's default window is 4096: a Mistral config.json without the key has one (an
    # explicit null has none)
    raw = cfg.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    window = int(raw) if raw else None
    if arch == "MistralForCausalLM":
        return (window,) * layers
    if arch != "Qwen2ForCausalLM" or window is None or not cfg.get("use_sliding_window", False):
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))  # transformers' Qwen2Config default
        return tuple(window if i >= first else None for i in range(layers))
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise ModelError(
            f"{source}: layer_types must list {layers} entries, each one of {', '.join(kinds)}: got {types!r}"
        )
    return tuple(window if t == "sliding_attention" else None for t in types)


def max_positions(cfg: dict[str, Any]) -> int:
    """``max_position_embeddings``, or where the config lacks it the default of its family's transformers
    config class (a fixed 4096 once gave a Llama config without the key other llama3-scaled logits than
    transformers' 2048, and capped a Mistral's context far below its 131072); 4096 for other families,
    whose configs (read for the vLLM connector) transformers always writes with the key."""
    if "max_position_embeddings" in cfg:
        return int(cfg["max_position_embeddings"])
    archs = cfg.get("architectures") or []
    family = next((a.removesuffix("ForCausalLM").lower() for a in archs if a in SUPPORTED_ARCHITECTURES),
                  cfg.get("model_type"))
    return _DEFAULT_MAX_POSITIONS.get(family, 4096) if isinstance(family, str) else 4096


def rope_config(cfg: dict[str, Any]) -> RopeConfig:
    """RoPE settings read as transformers reads them, so the engine rotates exactly as the reference.

    A non-empty legacy ``rope_scaling`` *replaces* ``rope_parameters`` (it does not merge into it: a
    config that transformers 5 saved with ``rope_parameters`` and that a user then gave a
    ``rope_scaling`` runs scaled there), and its theta falls back to the top-level ``rope_theta``,
    never to the replaced dict's. A scaling type missing a field transformers requires is refused
    rather than run with a guessed value; llama3's and yarn's ``original_max_position_embeddings``
    is read as there (``_original_max_position``), and a yarn ``factor`` given as null is derived from
    it as there. Dynamic NTK scaling changes the frequencies
    once a sequence outgrows ``max_position_embeddings``, which cached KV could not follow; the
    engine's context ends there, where it equals plain RoPE, so it runs as that."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelError(f"rope_scaling/rope_parameters must be a JSON object, got {params!r}")
    nested = sorted(key for key, value in params.items() if isinstance(value, dict))
    if nested:  # transformers 5's per-layer-type form: read flat, its theta and type would be lost
        raise ModelError(f"per-layer-type RoPE parameters ({', '.join(nested)}) are not supported: give one "
                         "rope_parameters object for every layer")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in _ROPE_REQUIRED:
        raise ModelError(f"unsupported rope scaling {kind!r} ({', '.join(_ROPE_REQUIRED)} are supported)")
    missing = [key for key in _ROPE_REQUIRED[kind]
               if key not in params or (params[key] is None and key not in _ROPE_NULLABLE.get(kind, ()))]
    if missing:
        raise ModelError(f"rope scaling {kind!r} lacks {', '.join(missing)}: cannot rotate as the model was trained")
    context = max_positions(cfg)
    # dynamic: equal to no scaling up to the context, where the engine's context ends
    original = _original_max_position(cfg, params, context) if kind in ("llama3", "yarn") else context
    # a yarn factor given as null transformers derives (DeepSeek-V3's configs rely on this): the context the
    # model runs at over the one it was trained at
    null_yarn = kind == "yarn" and params["factor"] is None
    factor = context / original if null_yarn else float(params.get("factor", 1.0))
    if not factor > 0:  # transformers runs it into NaN or infinite frequencies: refused here
        raise ModelError(f"rope scaling {kind!r} has factor {factor!r}: it must be a positive number")
    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers' defaults, for 0 and null too
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_yarn_attention_factor(params, factor) if kind == "yarn" else 1.0,
    )


# the fields each supported scaling needs, which transformers refuses a config without
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",),
}
# required fields that transformers accepts as null (the key must still be there): it derives them
_ROPE_NULLABLE: dict[str, tuple[str, ...]] = {"yarn": ("factor",)}
_ORIGINAL_KEY = "original_max_position_embeddings"


def _original_max_position(cfg: dict[str, Any], params: dict[str, Any], max_position: int) -> int:
    """The context llama3 and yarn scaling were trained at, from where transformers takes it: a
    top-level ``original_max_position_embeddings`` (Phi-3 keeps it there) over the scaling's own,
    else ``max_position_embeddings``. A null or non-positive one is refused: transformers fails on
    it (a division by None or by zero) rather than running it."""
    if _ORIGINAL_KEY in cfg:
        where, value = "the config", cfg[_ORIGINAL_KEY]
    else:
        where, value = "the rope scaling", params.get(_ORIGINAL_KEY, max_position)
    if value is None or float(value) <= 0:
        raise ModelError(f"{_ORIGINAL_KEY} in {where} must be a positive number of positions, got {value!r}")
    return int(value)


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's factor on cos and sin: the config's ``attention_factor``, else 0.1 ln(factor) + 1 (the
    paper's), or where both ``mscale`` and ``mscale_all_dim`` are set (DeepSeek's form) the ratio of
    that expression taken with each as the factor on the log."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    scale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return mscale(float(scale)) / mscale(float(all_dim)) if scale and all_dim else mscale(1.0)


@dataclass
class EngineConfig:
    """How the engine runs a model: device, memory and batching limits."""

    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str | None = None  # None: float32 on CPU (no fast bf16 there), bfloat16 on CUDA
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    # host memory for the KV of preempted fused and session requests (``swap.py``), which a recompute
    # would change; None: 4 GiB (pinned) on CUDA, the KV cache's size on CPU; 0: recompute them
    swap_space_bytes: int | None = None
    # share of free GPU memory the KV cache may take; RAGFUSE_GPU_MEMORY_UTILIZATION sets the default for
    # processes that share one GPU (parallel test shards, several servers)
    gpu_memory_utilization: float = field(
        default_factory=lambda: float(os.environ.get("RAGFUSE_GPU_MEMORY_UTILIZATION", "0.9")))
    attention_backend: str = "auto"
    seed: int = 0
    prefix_tree: bool = True  # share the KV blocks of common prompt prefixes (prefix_tree.py)
    # launch the next greedy decode step before reading the current one's tokens (CUDA graphs), so the
    # host's work between steps (outputs, scheduling, inputs) runs while the GPU computes
    overlap_decode: bool = True

    def __post_init__(self) -> None:
        """Reject limits the engine cannot run with: max_num_seqs 0 schedules nothing (generate waits
        forever), block_size 0 or a negative max_model_len fail deep inside with raw errors."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"{name} must be a positive integer, got {value!r}")
        if self.swap_space_bytes is not None and (
                not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0):
            raise ModelError(f"swap_space_bytes must be a non-negative integer, got {self.swap_space_bytes!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ModelError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ModelError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelError("device cuda was asked for but no CUDA device is available")
        if self.device not in ("cpu",) and not self.device.startswith("cuda"):
            raise ModelError(f"unknown device {self.device!r} (auto, cpu or cuda)")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in table:
            raise ModelError(f"unknown dtype {self.dtype!r} ({', '.join(table)})")
        return table[self.dtype]
