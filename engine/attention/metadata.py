"""What one forward pass's attention needs to know about the batch, built once per step.

Every layer reads the same metadata, so anything derived from it (per-sequence cache slots for the
torch backend) is computed lazily once and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
            from ragfuse.kernels.paged_attention import consecutive_slots, sequence_slots

            self._slots = []
            for i, n in enumerate(self.seq_lens.tolist()):
                run = consecutive_slots(self.block_tables[i].tolist(), n, self.block_size)
                self._slots.append(run if run is not None else sequence_slots(self.block_tables[i], n, self.block_size))
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

        Built on the host with a fixed number of numpy ops whatever the batch (no per-token Python
        loop: an 8K-token prefill would spend milliseconds in one), then sent in two copies: the
        slots, and the int32 tables, lengths and offsets packed into one tensor (views of it). As
        torch ops on host tensors with a copy per field it took ~0.75 ms (under torch.profiler) of
        a session turn's host work before its first layer could launch.
        """
        n = len(query_lens)
        width = max((len(t) for t in block_tables), default=1) or 1
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        ints = np.zeros(n * width + 2 * n + 1, dtype=np.int32)  # tables [n, width] | seq_lens [n] | cu [n + 1]
        tables = ints[: n * width].reshape(n, width)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        ints[n * width : n * width + n] = s_lens
        ints[n * width + n :] = cu
        seq_of_token = np.repeat(np.arange(n), q_lens)
        # absolute position of every new token: its sequence's first new position + its rank
        pos = (s_lens - q_lens)[seq_of_token] + np.arange(cu[-1]) - cu[:-1][seq_of_token]
        slots = tables[seq_of_token, pos // block_size].astype(np.int64) * block_size + pos % block_size
        packed = torch.from_numpy(ints).to(device, non_blocking=True)
        return cls(
            is_prefill=max(query_lens) > 1,
            slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
            block_tables=packed[: n * width].view(n, width),
            seq_lens=packed[n * width : n * width + n],
            cu_seqlens_q=packed[n * width + n :],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            has_prefix=any(q != s for q, s in zip(query_lens, seq_lens)),
        )
