"""A request's state inside the engine: its tokens, cache blocks, progress and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from .sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    num_swaps: int = 0  # preemptions that kept the KV in host memory (``swap.py``) instead of dropping it
    system: int | None = None  # registered system prompt this request follows (relay attention)
    system_computed: bool = False  # that prompt's KV was computed for this request (``SystemPrompt.fresh``)
    position_offset: int = 0  # the system prompt's length: own token i sits at position offset + i
    # prefix tree (prefix_tree.py): the first ``tree_depth`` blocks of ``block_table`` are tree nodes;
    # ``tree_open`` while later full blocks may still join the tree; fused prompts (approximate KV)
    # are not ``cacheable``; ``num_cached_tokens`` of the prompt were reused instead of computed
    tree_depth: int = 0
    cacheable: bool = True
    tree_open: bool = True
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.params.seed is not None and not self.params.greedy:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """Token ``i`` of ``token_ids`` without building that list (a decode step reads one per sequence)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
