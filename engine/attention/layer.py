"""``Attention``: the single place where a layer's queries meet the paged KV cache.

It writes the step's new K/V into the cache, then runs the backend chosen for the model: the Triton
kernels on CUDA, the torch references elsewhere (or when forced, see ``engine.ops``). Backends
return the output and its log-sum-exp so later paths (relay system prompts, split KV, fusion) can
merge partial attentions exactly.

The Triton path reads nothing back to the host, so a decode step through it can be captured in a
CUDA graph; the torch path does (per-sequence loops over ``seq_lens``) and must not be captured.
"""

from __future__ import annotations

import torch
from torch import nn

from ragfuse.kernels.merge import merge_attention_ref
from ragfuse.kernels.paged_attention import (
    paged_attention_at_positions_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from ragfuse.kernels.relay import system_attention_ref
from ragfuse.kernels.two_phase import two_phase_decode_ref

from ..ops import HAVE_TRITON, resolve_backend
from .metadata import AttentionMetadata, RelayMetadata

if HAVE_TRITON:
    from ragfuse.kernels.merge_triton import merge_attention_triton
    from ragfuse.kernels.paged_attention_triton import (
        paged_decode_attention_triton,
        paged_prefill_attention_triton,
        write_kv_triton,
    )
    from ragfuse.kernels.relay_triton import relay_decode_attention_triton, system_attention_triton
    from ragfuse.kernels.two_phase_triton import two_phase_decode_triton


CUDNN_MIN_TOKENS = 2048  # measured: Triton wins at 512, cuDNN at 4K and 8K (crossover not pinned)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' K/V [tokens, kv_heads, head_dim] at their cache slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def cudnn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one fresh sequence (no cached prefix) through torch's cuDNN kernel, which
    returns the lse. Its keys are exactly this step's K/V, read straight from the projections.

    K/V keep their own (fewer) heads: cuDNN's graph takes grouped-query attention as it is, so the
    copy that expanded them to the query heads is gone. On H100 cuDNN beats the Triton prefill kernel
    from a few thousand tokens on and loses below; kernels/NOTES.md has the numbers.
    """
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, True, scale=scale)[:2]
    return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0]).transpose(0, 1)


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
        scale: float | None = None,
    ) -> None:
        """``scale``: the factor on q·k, by default 1/sqrt(head_dim); a model whose RoPE scales cos and
        sin (YaRN) passes that factor's square folded in (``ModelConfig.attention_scale``)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.backend = "auto"  # "auto" (by device, per call), "triton" or "torch"; see set_attention_backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k/v [T, KVH, D] for the step's new tokens -> (out [T, H, D], lse [T, H]).

        With ``meta.relay`` the sequences' own tokens (in their pages) follow a registered system
        prompt (in the registry's blocks): RelayAttention, the system part for all queries at once
        and the context part per sequence, merged exactly by lse.
        """
        k_cache, v_cache = kv_cache
        relay = meta.relay
        if relay is not None and self.sliding_window is not None:
            raise ValueError("relay attention needs a model without a sliding window")
        backend = self.backend if self.backend != "auto" else resolve_backend("auto", q.device)
        # decode over prefix-tree blocks shared by several sequences: read them once per batch
        two_phase = meta.two_phase if not meta.is_prefill and self.sliding_window is None else None
        if backend == "triton":
            write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
            if two_phase is not None:  # the context part; a relay system part is merged below
                ctx = two_phase_decode_triton(
                    q, k_cache, v_cache, meta.block_tables, meta.seq_lens, two_phase, self.scale
                )
            elif not meta.is_prefill:
                if relay is not None:  # context and system partials reduced in one fused pass
                    return relay_decode_attention_triton(
                        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, relay.sys_tables, relay.sys_lens,
                        relay.tile_tokens, relay.tile_system, self.scale, meta.max_seq_len, relay.max_sys_len,
                        sys_splits=relay.num_splits,
                    )
                return paged_decode_attention_triton(
                    q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, self.sliding_window,
                    max_seq_len=meta.max_seq_len,
                )
            elif self._cudnn_fits(q, meta):
                ctx = cudnn_prefill(q, k, v, self.scale)
            else:
                ctx = paged_prefill_attention_triton(
                    q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale,
                    self.sliding_window, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                )
            if relay is None:
                return ctx
            sys = system_attention_triton(q, k_cache, v_cache, relay.sys_tables, relay.sys_lens, relay.tile_tokens,
                                          relay.tile_system, self.scale, relay.max_sys_len, relay.num_splits)
            return merge_attention_triton(*sys, *ctx)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        slots = meta.sequence_slots() if q.device.type == "cpu" else None
        if two_phase is not None:
            ctx = two_phase_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, two_phase, self.scale)
        elif meta.is_prefill:
            ctx = paged_prefill_attention_ref(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                self.scale, self.sliding_window, slots,
            )
        else:
            ctx = paged_decode_attention_ref(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, self.sliding_window, slots
            )
        if relay is None:
            return ctx
        sys = system_attention_ref(q, k_cache, v_cache, relay.sys_tables, relay.sys_lens, relay.token_system,
                                   self.scale)
        return merge_attention_ref(*sys, *ctx)

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
              slots: torch.Tensor) -> None:
        """Write K/V [T, KVH, D] at ``slots`` outside a forward (cache fusion fills the cache itself):
        one Triton launch on the Triton backend instead of two ``index_copy_``."""
        backend = self.backend if self.backend != "auto" else resolve_backend("auto", k.device)
        (write_kv_triton if backend == "triton" else write_kv)(k, v, *kv_cache, slots)

    def attend(
        self,
        q: torch.Tensor,
        q_positions: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor,
        seq_len: int,
        slots: torch.Tensor | slice | None = None,
        bounds: torch.Tensor | None = None,
        relay: RelayMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's queries over its first ``seq_len`` cached tokens (K/V already written),
        and with ``relay`` over the registered system prompt its tokens follow (all of it visible
        to every query), merged exactly by log-sum-exp.

        ``q_positions`` (ascending) puts the queries at scattered positions with an exact causal
        mask each, as cache fusion's selective recompute needs; None means the last ``len(q)``
        positions. ``block_table`` is [1, blocks] int32. ``bounds`` = int32 ``[0, len(q), seq_len]``
        on the device: a caller running many layers builds it once, since creating it here would
        copy from the host, and wait for the device, at every layer.
        """
        k_cache, v_cache = kv_cache
        if relay is not None and self.sliding_window is not None:
            raise ValueError("relay attention needs a model without a sliding window")
        backend = self.backend if self.backend != "auto" else resolve_backend("auto", q.device)
        if backend == "triton":
            n = q.shape[0]
            if bounds is None:
                bounds = torch.tensor([0, n, seq_len], dtype=torch.int32, device=q.device)
            cu, lens = bounds[:2], bounds[2:]
            ctx = paged_prefill_attention_triton(
                q, k_cache, v_cache, block_table, lens, cu, self.scale, self.sliding_window,
                max_query_len=n, q_positions=q_positions, max_seq_len=seq_len,
            )
            if relay is None:
                return ctx
            sys = system_attention_triton(q, k_cache, v_cache, relay.sys_tables, relay.sys_lens, relay.tile_tokens,
                                          relay.tile_system, self.scale, relay.max_sys_len, relay.num_splits)
            return merge_attention_triton(*sys, *ctx)
        ctx = paged_attention_at_positions_ref(
            q, q_positions, k_cache, v_cache, block_table[0], seq_len, self.scale, self.sliding_window, slots
        )
        if relay is None:
            return ctx
        sys = system_attention_ref(q, k_cache, v_cache, relay.sys_tables, relay.sys_lens, relay.token_system,
                                   self.scale)
        return merge_attention_ref(*sys, *ctx)

    def _cudnn_fits(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """One long fresh 16-bit sequence whose window (if any) cuts nothing: from host values only."""
        window_cuts = self.sliding_window is not None and meta.max_query_len > self.sliding_window
        return (
            meta.num_seqs == 1 and not meta.has_prefix and not window_cuts
            and meta.max_query_len >= CUDNN_MIN_TOKENS
            and q.dtype in (torch.float16, torch.bfloat16) and self.head_dim in (64, 128)
        )


def set_attention_backend(model: nn.Module, requested: str, device: torch.device) -> str:
    """Resolve ``requested`` (EngineConfig.attention_backend) for ``device`` and set it on every
    ``Attention`` of ``model``; returns the backend in use ("triton" or "torch")."""
    backend = resolve_backend(requested, device)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    return backend
