"""What one forward pass's attention needs to know about the batch, built once per step.

Every layer reads the same metadata, so anything derived from it (per-sequence cache slots for the
torch backend) is computed lazily once and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragfuse.kernels.two_phase import TwoPhasePlan


@dataclass
class RelayMetadata:
    """The system-prompt part of a relay batch: which system prompt each new token sits behind.

    The system K/V live once in the paged cache, in blocks owned by the engine's system-prompt
    registry (``sys_tables``/``sys_lens`` are its device tensors, whose addresses never change, so
    CUDA graphs can read them). The Triton kernel takes the tokens cut into tiles of one system each.
    """

    token_system: list[int]  # host: each new token's system prompt (-1: none), for the torch path
    tile_tokens: torch.Tensor  # [tiles * tokens_per_tile] int32, -1 padded (see kernels.relay.system_tiles)
    tile_system: torch.Tensor  # [tiles] int32
    sys_tables: torch.Tensor  # [max_systems, max_blocks] int32
    sys_lens: torch.Tensor  # [max_systems] int32
    max_sys_len: int  # host bound on system lengths (sizes the split count only)
    num_splits: int | None = None  # shares of the system keys; None: chosen from the tiles (graphs fix it)

    @classmethod
    def build(
        cls, token_system: list[int], tokens_per_tile: int, sys_tables: torch.Tensor, sys_lens: torch.Tensor,
        max_sys_len: int, device: torch.device,
    ) -> RelayMetadata:
        from ragfuse.kernels.relay import system_tiles

        tokens, systems = system_tiles(token_system, tokens_per_tile)
        return cls(
            token_system=token_system,
            tile_tokens=torch.tensor(tokens, dtype=torch.int32).to(device, non_blocking=True),
            tile_system=torch.tensor(systems, dtype=torch.int32).to(device, non_blocking=True),
            sys_tables=sys_tables,
            sys_lens=sys_lens,
            max_sys_len=max_sys_len,
        )


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache per sequence after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: packed offsets of the new tokens
    max_query_len: int
    max_seq_len: int
    block_size: int
    has_prefix: bool = True  # some sequence attends to tokens cached before this step
    relay: RelayMetadata | None = None  # set when some sequence sits behind a registered system prompt
    two_phase: TwoPhasePlan | None = None  # decode over prefix-tree blocks shared by several sequences
    _slots: list[torch.Tensor | slice] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def sequence_slots(self) -> list[torch.Tensor | slice]:
        """Cache slots of every sequence's tokens, computed once per step for all layers.

        A sequence whose blocks are consecutive (the usual case: blocks are handed out in order)
        gets a ``slice``, so the torch backend reads its K/V as a view instead of gathering a copy.
        """
        if self._slots is None:
            from ragfuse.kernels.paged_attention import sequence_slots

            self._slots = []
            for i, n in enumerate(self.seq_lens.tolist()):
                n_blocks = -(-n // self.block_size)
                table = self.block_tables[i, :n_blocks].tolist()
                if table == list(range(table[0], table[0] + n_blocks)):
                    start = table[0] * self.block_size
                    self._slots.append(slice(start, start + n))
                else:
                    self._slots.append(sequence_slots(self.block_tables[i], n, self.block_size))
        return self._slots

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for sequences whose last ``query_lens[s]`` of ``seq_lens[s]`` tokens are new.

        Built on the host with a fixed number of tensor ops whatever the batch (no per-token Python
        loop: an 8K-token prefill would spend milliseconds in one), then copied to ``device``.
        """
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu[1:])
        # absolute position of every new token: its sequence's first new position + its rank
        pos = (s_lens - q_lens)[seq_of_token] + torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
        slots = tables[seq_of_token, pos // block_size].long() * block_size + pos % block_size
        return cls(
            is_prefill=max(query_lens) > 1,
            slot_mapping=slots.to(device, non_blocking=True),
            block_tables=tables.to(device, non_blocking=True),
            seq_lens=s_lens.to(torch.int32).to(device, non_blocking=True),
            cu_seqlens_q=cu.to(torch.int32).to(device, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            has_prefix=any(q != s for q, s in zip(query_lens, seq_lens)),
        )
