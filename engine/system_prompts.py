"""Registered system prompts (RelayAttention): each one's KV computed once and stored once.

An application registers its system prompt (instructions, few-shot examples, a knowledge document);
several may be registered at once (multi-application hosting). Its K/V are computed once into
cache blocks the registry owns: no request's block table holds them, so they are neither copied
per request nor read per request. A request behind a system prompt of ``s`` tokens keeps only its
own tokens in its pages, at positions ``s, s+1, ...``; attention adds the system part for all of a
batch's queries at once (``kernels.relay``).

The block tables and lengths live in fixed device tensors, changed only when a prompt is
registered or released, so captured decode graphs read them without rebuilding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import RequestError


@dataclass
class SystemPrompt:
    slot: int  # row of the registry's device tables; the id requests refer to
    token_ids: list[int]
    block_table: list[int]
    # registered on demand for the request about to follow it (``RelayPrompts.acquire``): that request
    # reports the system tokens as computed for it, not as cached; the flag goes with it
    fresh: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SystemPrompts:
    def __init__(self, capacity: int, max_len: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.tables = torch.zeros(capacity, -(-max_len // block_size), dtype=torch.int32, device=device)
        self.lens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._prompts: dict[int, SystemPrompt] = {}
        self._by_tokens: dict[tuple[int, ...], int] = {}

    @property
    def capacity(self) -> int:
        return int(self.lens.shape[0])

    @property
    def max_len(self) -> int:
        """Tokens of the longest registered prompt (a host bound for kernel split counts)."""
        return max((p.num_tokens for p in self._prompts.values()), default=0)

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def free_count(self) -> int:
        return self.capacity - len(self._prompts)

    def find(self, token_ids: list[int]) -> int | None:
        """The id of an already registered prompt with exactly these tokens."""
        return self._by_tokens.get(tuple(token_ids))

    def get(self, system_id: int) -> SystemPrompt:
        if system_id not in self._prompts:
            raise RequestError(f"no system prompt is registered as {system_id}")
        return self._prompts[system_id]

    def free_slot(self) -> int:
        free = next((i for i in range(self.capacity) if i not in self._prompts), None)
        if free is None:
            raise RequestError(f"{self.capacity} system prompts are registered already: release one first")
        return free

    def add(self, slot: int, token_ids: list[int], block_table: list[int]) -> SystemPrompt:
        """Record a prompt whose K/V are already computed into ``block_table``."""
        if len(block_table) > self.tables.shape[1]:
            raise RequestError(f"system prompt of {len(token_ids)} tokens exceeds the model's context")
        prompt = SystemPrompt(slot, list(token_ids), block_table)
        row = torch.zeros(self.tables.shape[1], dtype=torch.int32)
        row[: len(block_table)] = torch.tensor(block_table, dtype=torch.int32)
        self.tables[slot].copy_(row)
        self.lens[slot] = len(token_ids)
        self._prompts[slot] = prompt
        self._by_tokens[tuple(token_ids)] = slot
        return prompt

    def remove(self, system_id: int) -> SystemPrompt:
        """Forget a prompt (its length becomes 0, so stale references read nothing); the caller
        frees its blocks."""
        prompt = self.get(system_id)
        self.lens[system_id] = 0
        del self._prompts[system_id]
        del self._by_tokens[tuple(prompt.token_ids)]
        return prompt
