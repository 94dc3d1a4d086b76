"""What one forward pass's attention needs to know about the batch, built once per step.

Every layer reads the same metadata, so anything derived from it (per-sequence cache slots for the
torch backend) is computed lazily once and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    _slots: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def sequence_slots(self) -> list[torch.Tensor]:
        """Cache slots of every sequence's tokens, computed once per step for all layers."""
        if self._slots is None:
            from ragfuse.kernels.paged_attention import sequence_slots

            self._slots = [
                sequence_slots(self.block_tables[i], n, self.block_size)
                for i, n in enumerate(self.seq_lens.tolist())
            ]
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
        """Metadata for sequences whose last ``query_lens[s]`` of ``seq_lens[s]`` tokens are new."""
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        return cls(
            is_prefill=max(query_lens) > 1,
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=tables.to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )
