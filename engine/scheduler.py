"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step is either a prefill step (prompts, in chunks of at most ``max_num_batched_tokens`` tokens
in all, so a long prompt does not need one huge activation) or a decode step (one token for every
running sequence). New requests join as soon as blocks are free; finished ones leave at once. When
the cache runs out during decode, the newest sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed later; a sequence whose KV a prefill would not
give back as it was (fused or session KV, not ``cacheable``) is swapped to host memory instead and
copied back when it resumes (``swap.py``). A sequence that finds no room while
nothing else runs (it outgrew the whole cache, or what registered system prompts leave of it) can
never get any: it is finished with reason ``"length"`` instead (``starved``), else it would wait forever.

With a prefix tree, a request about to start takes the cached blocks of its longest known prefix
and prefills only the rest, and every block a step fills joins the tree as it is scheduled.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .block_manager import BlockManager
from .errors import RequestError
from .prefix_tree import PrefixTree
from .sequence import Sequence, Status
from .swap import SwapSpace

log = logging.getLogger("ragfuse.engine")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, tree: PrefixTree | None = None,
        reclaim: Callable[[int], bool] | None = None, swap: SwapSpace | None = None,
    ) -> None:
        self.blocks = blocks
        self.swap = swap
        self.tree = tree
        # frees blocks held for later use (idle on-demand system prompts) until the given count is free;
        # asked before a sequence is left waiting or preempted for want of blocks
        self.reclaim = reclaim
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # finished for want of room that nothing running could ever free; the engine reports them
        self.starved: list[Sequence] = []

    def add(self, seq: Sequence, reserved: int = 0) -> None:
        """Queue ``seq``; refused if its prompt cannot fit in the cache (``check_fits``)."""
        self.check_fits(seq.num_tokens, reserved)
        self.waiting.append(seq)

    def check_fits(self, num_tokens: int, reserved: int = 0) -> None:
        """Refuse a prompt of ``num_tokens`` that the cache could never hold beside the ``reserved``
        blocks that stay taken while it runs (the relay system prompt it follows): waiting for room
        would wait forever."""
        need = -(-num_tokens // self.blocks.block_size)
        if need + reserved > self.blocks.num_blocks:
            beside = f" beside its system prompt's {reserved} blocks" if reserved else ""
            raise RequestError(f"prompt of {num_tokens} tokens ({need} blocks) does not fit in the KV cache "
                               f"of {self.blocks.num_blocks} blocks{beside}")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def preempted_waiting(self) -> bool:
        """Whether a sequence preempted for want of blocks waits to resume."""
        return any(s.num_preemptions for s in self.waiting)

    def schedule(self) -> ScheduledBatch | None:
        while True:
            ran_alone = not self.running
            batch = self._schedule_prefill() or self._schedule_decode()
            if batch is not None or not self.has_work:
                return batch
            if self.swap is not None and self.swap.await_arrivals():  # only swapped-in sequences could run
                continue
            if ran_alone:  # the next request cannot start in a cache that nothing running holds
                self._starve(self.waiting[0])
            elif len(self.running) == 1:  # stuck mid-prefill alone: nothing else would free blocks for it
                self._starve(self.running[0])
            elif self.running:  # every running sequence is stuck mid-prefill without blocks: free the newest
                self._preempt(self.running[-1])

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        # sequences partway through a chunked prefill come first, then newcomers
        candidates = [s for s in self.running if s.num_uncomputed > 1]
        for seq in candidates:
            if budget <= 0:
                break
            n = min(seq.num_uncomputed, budget)
            if not self._room(seq, seq.num_computed_tokens + n):
                continue
            self._grow(seq, seq.num_computed_tokens + n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.swapped(seq):  # back to running as it was; its next token comes with a decode step
                if not self._room(seq, seq.num_tokens):
                    break
                self.waiting.popleft()
                self._swap_in(seq)
                continue
            matched = self.tree is not None and seq.tree_open and not seq.block_table
            if matched:
                self.tree.match(seq)
            n = min(seq.num_uncomputed, budget)
            if not self._room(seq, seq.num_computed_tokens + n):
                if matched:
                    self.tree.unmatch(seq)
                break
            self.waiting.popleft()
            self._grow(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1 or not self.arrived(seq):
                continue  # preempted to make room, still in a chunked prefill, or its pages still coming back
            while not self._room(seq, seq.num_tokens):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:  # alone and still no room: it never will have
                    self._starve(seq)
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self._grow(seq, seq.num_tokens)
                scheduled.append(seq)
        return ScheduledBatch(scheduled, [1] * len(scheduled), False) if scheduled else None

    def _room(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can grow to ``num_tokens`` tokens, reclaiming held blocks if it must."""
        need = self.blocks.blocks_needed(seq.block_table, num_tokens)
        return need <= self.blocks.num_free or (self.reclaim is not None and self.reclaim(need))

    def grow_ahead(self, seqs: list[Sequence]) -> bool:
        """Blocks for one more token of each sequence than it has computed, all or none: for a decode
        step launched before the step before it has reported its tokens (``LLMEngine.step``). Full
        blocks join the prefix tree at the sequence's next regular scheduling, once their tokens are
        known on the host."""
        need = sum(self.blocks.blocks_needed(s.block_table, s.num_computed_tokens + 1) for s in seqs)
        if need > self.blocks.num_free:
            return False
        for seq in seqs:
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + 1)
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for the sequence's first ``num_tokens`` tokens, which this step computes; the full
        ones join the prefix tree."""
        self.blocks.grow(seq.block_table, num_tokens)
        if self.tree is not None:
            self.tree.insert(seq, num_tokens)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        if self.tree is not None:
            self.tree.forget(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first for recompute (or, not ``cacheable``, swapped out to
        resume as it was), keeping the leading blocks it shares outside the prefix tree: those are a
        registered system prompt's (a request behind it without relay), which the registry holds
        anyway, so giving them back frees nothing. Dropping them made the recompute prefill the system
        prompt again into blocks of its own: more blocks than the request needed while it ran, so under
        pressure it could be starved (finished "length" early) where the same request unpreempted
        completes. Tree blocks are released: a match finds them again."""
        self.running.remove(seq)
        self.settle(seq)
        kept = self._shared_prefix(seq)
        own = seq.block_table[len(kept):]
        computed = own[:self.blocks.blocks_needed(kept, seq.num_computed_tokens)]
        swap = None if seq.cacheable else self.swap  # only KV a prefill would not give back is kept
        swapped = swap is not None and swap.swap_out(seq.request_id, computed)
        if swap is not None and not swapped:
            log.warning("request %s preempted with its fused or session KV (%d tokens), which the swap space "
                        "(%d of %d bytes in use) cannot take: it is recomputed by prefill, so its answer may "
                        "differ from an unpreempted run (raise EngineConfig.swap_space_bytes)",
                        seq.request_id, seq.num_computed_tokens, swap.used_bytes, swap.budget_bytes)
        seq.block_table = own
        self._release(seq)
        seq.block_table = kept
        if swapped:
            seq.num_swaps += 1
        else:
            seq.num_computed_tokens = len(kept) * self.blocks.block_size
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def settle(self, seq: Sequence) -> None:
        """Make the compute stream wait for ``seq``'s pages where a copy back is still on its way:
        before they are read or given away outside a scheduled step."""
        if self.swap is not None:
            self.swap.await_arrivals(seq.request_id)

    def arrived(self, seq: Sequence) -> bool:
        """Whether ``seq``'s pages are in the cache (a swapped-in sequence's copy back has landed)."""
        return self.swap is None or self.swap.arrived(seq.request_id)

    def swapped(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits with its KV in host memory (``_preempt``)."""
        return self.swap is not None and self.swap.holds(seq.request_id)

    def _swap_in(self, seq: Sequence) -> None:
        """Give a swapped sequence fresh blocks for all its tokens, copy its KV back, and run it."""
        assert self.swap is not None
        kept = len(seq.block_table)
        self.blocks.grow(seq.block_table, seq.num_tokens)
        computed = self.blocks.blocks_needed(seq.block_table[:kept], seq.num_computed_tokens)
        self.swap.swap_in(seq.request_id, seq.block_table[kept:kept + computed])
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        """The leading computed full blocks of ``seq`` that someone besides it holds and the prefix tree
        does not cache (its system prompt's shared blocks): their K/V are exact for its first tokens."""
        blocks = self.blocks
        full = seq.num_computed_tokens // blocks.block_size
        kept: list[int] = []
        for b in seq.block_table[:full]:
            if blocks.cached[b] or blocks.ref_counts[b] < 2:
                break
            kept.append(b)
        return kept

    def _starve(self, seq: Sequence) -> None:
        """Finish a sequence the cache can never hold (its tokens so far are its output)."""
        self.finish(seq, "length")
        self.starved.append(seq)

    def take_starved(self) -> list[Sequence]:
        """The sequences finished by ``_starve`` since the last call, for the engine to report."""
        starved, self.starved = self.starved, []
        return starved

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` done and give its blocks back (also used to abort); a no-op once it is done."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.swap is not None:
            self.swap.drop(seq.request_id)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
