"""Llama family decoder (Llama 2/3/3.1, SmolLM2), written as an explicit loop over layers.

The loop is explicit so callers can reach into it: ``KVHook`` sees each layer's new K (before and
after RoPE) and V and may replace them before they enter the cache, which is how chunk KV is
captured for storage and how stored KV is supplied back. Parameter names follow the HF checkpoints,
except that q/k/v and gate/up are packed into one matmul each (``load_weights`` packs them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from ..attention import Attention, AttentionMetadata
from ..config import ModelConfig
from ..layers import Linear, RMSNorm, RotaryEmbedding, SwiGLUMLP


class KVHook(Protocol):
    """Called once per layer with the step's new tokens' K and V before they are cached.

    ``k_raw`` is K before RoPE (position independent); ``k`` is K rotated to ``positions``. Return
    ``None`` to keep them, or a replacement ``(k, v)`` (rotated K) to cache and attend to instead.
    """

    def __call__(
        self, layer: int, positions: torch.Tensor, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class LlamaAttentionBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.rotary = rotary
        self.attn = Attention(config.num_heads, config.num_kv_heads, config.head_dim, config.layer_windows[layer_idx],
                              scale=config.attention_scale)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] (before RoPE), v [T, KVH, D]."""
        q, k, v = self.qkv_proj(hidden).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        hook: KVHook | None = None,
    ) -> torch.Tensor:
        q, k_raw, v = self.project(hidden)
        q, k = self.rotary.rotate_qk(q, k_raw, positions)
        if hook is not None:
            replaced = hook(self.layer_idx, positions, k_raw, k, v)
            if replaced is not None:
                k, v = replaced
        out, _lse = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttentionBlock(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        hook: KVHook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual stream): the residual add is fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, hook)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaBackbone(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # built on the meta device and filled from the checkpoint (``model_runner._materialize``): no
        # init, whose normal_ on meta imported torch._dynamo (with the rotary tables' math there, 0.4-0.5
        # s of a 4.4 s default-model load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, self.rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our packed parameter, which shard of it)
    packed = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config, max_positions or config.max_position_embeddings)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head where the checkpoint ties them (again after
        ``to_empty``, which gives every parameter its own storage)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        hook: KVHook | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's new tokens; their K/V land in ``kv_caches``."""
        hidden = residual = None
        for i in range(len(self.model.layers)):
            hidden, residual = self.forward_layer(i, input_ids, positions, kv_caches, meta, hidden, residual, hook)
        assert hidden is not None
        return hidden

    def forward_layer(
        self,
        index: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        hook: KVHook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` of the forward, the embedding before the first and the final norm after the
        last included, so a caller can put work between layers (a session's history written into the
        cache just before the layer reads it) or capture one CUDA graph per layer. Takes and returns
        (hidden, residual); after the last layer ``hidden`` is the final hidden states."""
        if index == 0:
            hidden = self.model.embed_tokens(input_ids)
        assert hidden is not None
        hidden, residual = self.model.layers[index](positions, hidden, residual, kv_caches[index], meta, hook)
        if index == len(self.model.layers) - 1:
            hidden, _ = self.model.norm(hidden, residual)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def shard_sizes(self, packed_name: str) -> list[int]:
        c = self.config
        if packed_name == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def _settle_tied_head(self, head: torch.Tensor, filled: set[str]) -> None:
        """Place the ``lm_head.weight`` of a checkpoint whose config ties it to the embedding, as
        transformers' ``from_pretrained`` does: where the embedding is missing, the stored head is both;
        where both are stored with different values, the config is wrong about the checkpoint and they
        stay untied, each its own (tying them anyway serves the embedding as the output head: other
        logits than the reference's)."""
        embed = self.model.embed_tokens.weight
        if head.shape != embed.shape:
            raise KeyError(f"checkpoint tensor lm_head.weight has shape {tuple(head.shape)} but the config makes "
                           f"it {tuple(embed.shape)}")
        if "model.embed_tokens.weight" not in filled:
            embed.copy_(head)
            filled.add("model.embed_tokens.weight")
        elif not torch.equal(head.to(device=embed.device, dtype=embed.dtype), embed):
            self.lm_head.weight = nn.Parameter(head.to(device=embed.device, dtype=embed.dtype, copy=True))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, packing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        tied_head: torch.Tensor | None = None  # lm_head.weight stored by a checkpoint whose config ties it
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                tied_head = tensor  # settled once the embedding is read, wherever its shard comes
                continue
            target, shard = name, None
            for frag, (packed_name, idx) in self.packed.items():
                if f".{frag}." in name:
                    target, shard = name.replace(frag, packed_name), idx
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} has no place in {type(self).__name__}")
            param = params[target]
            if shard is not None:
                sizes = self.shard_sizes(target.split(".")[-2])
                param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            # exact shapes only: ``copy_`` would broadcast a smaller tensor silently, and a mismatch
            # (a config whose head counts, head_dim or vocab disagree with the weights) would surface
            # as a bare size error that names neither the tensor nor the config field
            if tensor.shape != param.shape:
                raise KeyError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)} but the config makes it "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
            filled.add(target if shard is None else f"{target}#{shard}")
        expected = set()
        for pname in params:
            module = pname.split(".")[-2]
            if module in ("qkv_proj", "gate_up_proj"):
                n = len(self.shard_sizes(module))
                expected.update(f"{pname}#{i}" for i in range(n))
            else:
                expected.add(pname)
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
            if tied_head is not None:
                self._settle_tied_head(tied_head, filled)
        missing = sorted(expected - filled)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
