"""Runs the model for a scheduled batch: builds the inputs and attention metadata, runs the
forward pass into the paged cache, and samples the next token of each sequence that finished its
prompt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragfuse.kernels.relay import tile_tokens_for
from ragfuse.kernels.two_phase import TwoPhasePlan

from .attention import AttentionMetadata, RelayMetadata, set_attention_backend
from .checkpoint import Checkpoint
from .config import ModelConfig
from .cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, PrefillGraphs, graphs_enabled
from .fusion import FusionMode, FusionStats, Segment, SelectionPolicy, SystemPart, fuse_prefill
from .fusion.graphs import FusionGraphs
from .kv_cache import KVCache
from .models import KVHook, LlamaForCausalLM, build_model
from .sampling import sample
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .system_prompts import SystemPrompts
from .weights import load_checkpoint_weights


@dataclass
class DecodeInFlight:
    """A greedy decode step launched on the GPU whose tokens the host has not read yet."""

    seqs: list[Sequence]
    systems: list[int]
    greedy: torch.Tensor  # its tokens on the device [n]
    host: torch.Tensor  # pinned [n], filled by a copy that ``ready`` marks done
    ready: torch.cuda.Event
    slot: int  # which of the runner's two token buffers it holds

    def tokens(self) -> list[int]:
        self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        checkpoint: Checkpoint | None,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        attention_backend: str = "auto",
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.model: LlamaForCausalLM = _materialize(config, checkpoint, device, dtype, max_model_len)
        self.attention_backend_name = set_attention_backend(self.model, attention_backend, device)
        self.kv_cache: KVCache | None = None
        self.block_size = 0
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.fusion_graphs: FusionGraphs | None = None
        self.systems: SystemPrompts | None = None  # set by the engine: the relay system prompts
        # launch_decode's token buffers: device, pinned host, "copied" events; two of each
        self._token_bufs: tuple[torch.Tensor, torch.Tensor, list[torch.cuda.Event]] | None = None
        self.steps_ahead = 0  # decode steps launched before the previous one's tokens were read (tests, metrics)
        # draws of sampled requests without a seed of their own (set by the engine from EngineConfig.seed)
        self.rng: torch.Generator | None = None

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged cache after the weights, so its size can use the memory left."""
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.dtype, self.device)
        self.block_size = block_size
        # Graphs need a forward that never syncs with the host: the Triton backend's.
        if self.device.type == "cuda" and self.attention_backend_name == "triton" and graphs_enabled():
            self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, block_size, self.max_model_len, self.device)
            self.graphs.capture()
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv_cache.layers, block_size, self.max_model_len, self.device, self.graphs.pool
            )
            self.fusion_graphs = FusionGraphs(
                self.model, self.kv_cache.layers, block_size, self.max_model_len, self.device, self.graphs.pool
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hook: KVHook | None = None,
        keep: bool = False,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The model's forward over the paged cache, replayed from a CUDA graph where one fits.

        A graph's output buffer is reused by the next replay, so a caller that holds the result past
        the next forward passes ``keep`` and gets a copy. ``before_layer(i)`` is called before layer
        i is launched (a prefill of one sequence then replays one graph per layer).
        """
        assert self.kv_cache is not None, "allocate_cache first"
        if hook is None:
            hidden = self._replay(input_ids, positions, meta, before_layer)
            if hidden is not None:
                return hidden.clone() if keep else hidden
        if before_layer is None:
            return self.model(input_ids, positions, self.kv_cache.layers, meta, hook)
        hidden = residual = None
        for i in range(self.config.num_layers):
            before_layer(i)
            hidden, residual = self.model.forward_layer(
                i, input_ids, positions, self.kv_cache.layers, meta, hidden, residual, hook
            )
        assert hidden is not None
        return hidden

    def _replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None,
    ) -> torch.Tensor | None:
        """The forward by graph replay, or None where no captured graph fits."""
        if before_layer is not None:
            if self.prefill_graphs is not None and self.prefill_graphs.accepts(meta, per_layer=True):
                return self.prefill_graphs.run_layers(input_ids, positions, meta, before_layer)
            return None
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.accepts(meta):
                return graphs.run(input_ids, positions, meta)
        return None

    def _tokens_per_tile(self) -> int:
        return tile_tokens_for(self.config.num_heads // self.config.num_kv_heads)

    def capture_relay_graphs(self) -> None:
        """Capture the decode graphs of relay batches (once, when the first system prompt arrives)."""
        if self.graphs is not None and self.systems is not None and not self.graphs.relay_graphs:
            self.graphs.capture_relay(self._tokens_per_tile(), self.systems.tables, self.systems.lens)

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, hook: KVHook | None = None, two_phase: TwoPhasePlan | None = None
    ) -> list[int | None]:
        """Forward the batch; returns a sampled token per sequence, or None where its prompt is
        not yet fully computed (chunked prefill). ``two_phase``: the prefix tree's plan for a decode
        batch whose sequences share cache blocks."""
        systems = self.host_decode_systems(batch) if hook is None and two_phase is None else None
        if systems is not None:
            seqs = batch.seqs
            logits, greedy = self._host_step(seqs, systems)
            return list(sample(logits, [s.params for s in seqs], [s.generator for s in seqs], greedy, self.rng))
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        token_system: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(seq.position_offset + start, seq.position_offset + start + n))
            query_lens.append(n)
            seq_lens.append(start + n)  # own tokens only: a system prompt's are not in the pages
            token_system.extend([-1 if seq.system is None else seq.system] * n)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, [s.block_table for s in batch.seqs], self.block_size, self.device
        )
        if self.systems is not None and any(s.system is not None for s in batch.seqs):
            meta.relay = RelayMetadata.build(
                token_system, self._tokens_per_tile(),
                self.systems.tables, self.systems.lens, self.systems.max_len, self.device,
            )
        meta.two_phase = two_phase
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        graphed = hook is None and self.graphs is not None and self.graphs.accepts(meta)
        if graphed:  # one replay through the output head: a row per sequence, each its last token
            assert self.graphs is not None
            logits, greedy = self.graphs.run_logits(input_ids, pos, meta)
        else:
            hidden = self.forward(input_ids, pos, meta, hook)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        wants = [i for i, s in enumerate(batch.seqs) if s.num_uncomputed == 0]
        tokens: list[int | None] = [None] * len(batch.seqs)
        if not wants:
            return tokens
        if graphed:
            greedy_rows: torch.Tensor | None = greedy
            if len(wants) < len(batch.seqs):  # a chunk of one token that does not end its prompt
                rows = torch.tensor(wants, device=self.device)
                logits, greedy_rows = logits.index_select(0, rows), greedy.index_select(0, rows)
        else:
            last = torch.tensor([sum(query_lens[: i + 1]) - 1 for i in wants], device=self.device)
            logits, greedy_rows = self.model.compute_logits(hidden.index_select(0, last)), None
        picked = sample(
            logits, [batch.seqs[i].params for i in wants], [batch.seqs[i].generator for i in wants], greedy_rows,
            self.rng,
        )
        for i, tok in zip(wants, picked):
            tokens[i] = tok
        return tokens

    def host_decode_systems(self, batch: ScheduledBatch) -> list[int] | None:
        """Each sequence's system prompt (-1: none) when the decode graphs take this batch straight
        from host values, else None: one last token per sequence, every block table within the
        graphs' width, and any system prompts (relay) within what a relay graph's tiles hold. Relay
        batches went through ``AttentionMetadata`` and a dozen device copies before, ~1 ms more host
        work a step than plain decode's one copy."""
        graphs = self.graphs
        if (graphs is None or batch.is_prefill or len(batch.seqs) > MAX_GRAPH_BATCH
                or not all(s.num_uncomputed == 1 and len(s.block_table) <= graphs.max_blocks for s in batch.seqs)):
            return None
        systems = [-1 if s.system is None else s.system for s in batch.seqs]
        return systems if graphs.takes_from_host(systems) else None

    def _host_step(
        self, seqs: list[Sequence], systems: list[int], after: DecodeInFlight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph for one token of each sequence from host values; ``after``: a
        step still in flight that sampled these sequences' input tokens (they are read on the device)."""
        assert self.graphs is not None
        done = [s.num_computed_tokens for s in seqs]
        if after is None:
            ids, source = [s.token_at(i) for s, i in zip(seqs, done)], None
        else:
            row = {id(s): i for i, s in enumerate(after.seqs)}
            ids, source = [row[id(s)] for s in seqs], after.greedy
        out = self.graphs.run_host(
            ids, [s.position_offset + i for s, i in zip(seqs, done)], [i + 1 for i in done],
            [s.block_table for s in seqs], systems, gather_from=source,
        )
        for seq in seqs:
            seq.num_computed_tokens += 1
        return out

    @torch.inference_mode()
    def launch_decode(
        self, seqs: list[Sequence], systems: list[int], after: DecodeInFlight | None = None
    ) -> DecodeInFlight:
        """Launch a greedy decode step (sequences as ``host_decode_systems`` accepts them) and return
        before it ends: the engine does its host work for the step (outputs, the next step's inputs)
        while the GPU runs it. ``after``: the step in flight before this one, whose tokens are this
        step's inputs, taken on the device. Steps alternate between two sets of token buffers, so a
        step's tokens stay readable while the next one runs."""
        if self._token_bufs is None:
            self._token_bufs = (torch.zeros(2, MAX_GRAPH_BATCH, dtype=torch.long, device=self.device),
                                torch.zeros(2, MAX_GRAPH_BATCH, dtype=torch.long).pin_memory(),
                                [torch.cuda.Event(), torch.cuda.Event()])
        device_bufs, host_bufs, events = self._token_bufs
        slot = 1 - after.slot if after is not None else 0
        events[slot].synchronize()  # the step that used this slot two steps ago has been read
        _, greedy = self._host_step(seqs, systems, after)
        n = len(seqs)
        kept, host = device_bufs[slot, :n], host_bufs[slot, :n]
        kept.copy_(greedy)  # out of the graph pool: another replay may reuse the graph's buffer
        host.copy_(kept, non_blocking=True)
        events[slot].record()
        self.steps_ahead += after is not None
        return DecodeInFlight(seqs, systems, kept, host, events[slot], slot)

    @torch.inference_mode()
    def forward_fresh(
        self, token_lists: list[list[int]], block_tables: list[list[int]], hook: KVHook | None = None
    ) -> torch.Tensor:
        """Run each token list as a new sequence from position 0 (one batched pass) into the given
        cache blocks; returns the final hidden states of all tokens, packed [sum(len), hidden]."""
        assert self.kv_cache is not None, "allocate_cache first"
        lens = [len(t) for t in token_lists]
        meta = AttentionMetadata.build(lens, lens, block_tables, self.block_size, self.device)
        ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=self.device)
        return self.forward(ids, pos, meta, hook, keep=True)

    @torch.inference_mode()
    def forward_continuation(
        self, token_ids: list[int], start: int, block_table: list[int],
        before_layer: Callable[[int], None] | None = None, keep: bool = True,
    ) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start...`` of a sequence whose first ``start`` tokens are
        cached in ``block_table`` (or written there layer by layer by ``before_layer``, see
        ``forward``); returns their final hidden states (with ``keep=False`` possibly a graph's
        buffer, valid until the next forward)."""
        assert self.kv_cache is not None, "allocate_cache first"
        n = len(token_ids)
        meta = AttentionMetadata.build([n], [start + n], [block_table], self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + n, device=self.device)
        return self.forward(ids, pos, meta, keep=keep, before_layer=before_layer)

    def fused_prefill(
        self, block_table: list[int], segments: list[Segment], mode: FusionMode | str, policy: SelectionPolicy,
        system: int | None = None,
    ) -> tuple[torch.Tensor, FusionStats]:
        """Cache fusion into ``block_table``'s pages; returns the last token's logits and stats.
        ``system``: a registered system prompt the prompt follows (relay attention)."""
        assert self.kv_cache is not None, "allocate_cache first"
        part = None
        if system is not None:
            systems = self.systems
            assert systems is not None
            part = SystemPart(systems.get(system).num_tokens, lambda n: RelayMetadata.build(
                [system] * n, self._tokens_per_tile(), systems.tables, systems.lens, systems.max_len, self.device))
        return fuse_prefill(self.model, self.kv_cache.layers, block_table, segments, mode, policy, part,
                            self.fusion_graphs)

    def capture_kv(
        self, token_lists: list[list[int]], block_tables: list[list[int]], skip: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each token list's (K before RoPE, V) from its ``skip``-th token on, each [layers, tokens,
        kv_heads, head_dim]."""
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []

        def keep(layer: int, positions: torch.Tensor, k_raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            ks.append(k_raw)
            vs.append(v)

        self.forward_fresh(token_lists, block_tables, keep)
        lens = [len(t) for t in token_lists]
        k_all, v_all = torch.stack(ks), torch.stack(vs)
        return [(k[:, skip:].clone(), v[:, skip:].clone())
                for k, v in zip(k_all.split(lens, dim=1), v_all.split(lens, dim=1))]


def _materialize(
    config: ModelConfig, checkpoint: Checkpoint | None, device: torch.device, dtype: torch.dtype, max_len: int
) -> LlamaForCausalLM:
    """Build the model on ``device`` without a throw-away random init, then fill its weights.

    With no checkpoint the weights are random (normal, std 0.02): speed benchmarks use real shapes
    with random values, since timing does not depend on them.
    """
    with torch.device("meta"):
        model = build_model(config, max_len)
    # cast while still on "meta": memory is then allocated once, in ``dtype`` (float32 first would need
    # twice a 16-bit model's memory: a 34B model's 137 GB where its 69 GB fit an 80 GB GPU)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.model.rotary.build_tables(device)  # meta buffers hold no values; keep the tables float32
    if checkpoint is None:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        load_checkpoint_weights(model, checkpoint.path)
    return model.eval()
