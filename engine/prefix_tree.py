"""A prefix tree (forest) of full KV blocks, so requests share the prompt prefixes they have in common.

ChunkAttention's idea on the engine's paged blocks: each node is one full cache block, keyed under
its parent by the ``block_size`` token ids it holds. A block's K/V depend only on the tokens up to
its end, so a path from a root spells a token prefix and its nodes hold that prefix's exact KV.
A new request walks its prompt down the tree, takes the matched blocks (one more reference each)
and prefills only the rest; as sequences compute further full blocks, those join the tree.

The tree keeps one reference of its own on every node's block (``BlockManager.cache_block``), so
finished requests leave their blocks cached. Blocks only the tree holds are reclaimable: when the
pool runs short the least recently used leaves are evicted first (a node nobody uses has no used
descendant, since a sequence holds every block of its path).

Decode batches whose sequences share nodes run two-phase attention; the plan of that attention
(``TwoPhasePlan``) depends only on which nodes the batch's sequences share, so it is built on the
device once and reused until the batch or the tree's sharing changes.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from ragfuse.kernels.two_phase import TwoPhasePlan, build_two_phase_plan

from .block_manager import BlockManager
from .sequence import Sequence


@dataclass(eq=False)
class Node:
    block: int
    tokens: tuple[int, ...]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixTree:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.root = Node(-1, (), None)  # prompts that start at position 0
        # prompts behind a registered system prompt: their KV depends on it, so each system has its own tree
        self._system_roots: dict[int, Node] = {}
        self.nodes: dict[int, Node] = {}  # by block id
        self._clock = itertools.count(1)
        self._lru: list[tuple[int, int]] = []  # (last_used, block) of candidate leaves; stale ones skipped
        self.version = 0  # bumped whenever which sequences share which nodes may have changed
        self.num_evicted = 0
        self._plan_key: tuple | None = None
        self._plan: TwoPhasePlan | None = None
        blocks.cache = self

    def __len__(self) -> int:
        return len(self.nodes)

    # ---- requests ---------------------------------------------------------------------------

    def match(self, seq: Sequence) -> int:
        """Give a sequence with nothing cached yet the tree blocks of its longest cached prefix.

        At least one token is left to compute, so the prefill still yields the next token's
        logits. Returns the number of tokens reused.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        bs = self.block_size
        ids = seq.token_ids
        node, path = self._root(seq), []
        now = next(self._clock)
        for i in range((len(ids) - 1) // bs):
            child = node.children.get(tuple(ids[i * bs : (i + 1) * bs]))
            if child is None:
                break
            child.last_used = now
            path.append(child.block)
            node = child
        if path:
            seq.block_table = self.blocks.share(path)
            seq.num_computed_tokens = len(path) * bs
            self.version += 1
        seq.tree_depth = len(path)
        seq.num_cached_tokens = len(path) * bs
        return len(path) * bs

    def _root(self, seq: Sequence) -> Node:
        if seq.system is None:
            return self.root
        return self._system_roots.setdefault(seq.system, Node(-1, (), None))

    def unmatch(self, seq: Sequence) -> None:
        """Undo ``match`` for a sequence that could not be scheduled after all."""
        self.blocks.release(seq.block_table)
        seq.num_computed_tokens = seq.tree_depth = seq.num_cached_tokens = 0

    def insert(self, seq: Sequence, num_tokens: int) -> None:
        """Add the sequence's full blocks among its first ``num_tokens`` tokens to the tree.

        Called when those tokens are scheduled: their K/V are written by that step's forward before
        any layer's attention reads them, so a sequence scheduled later in the same step may already
        share them. A block whose tokens another node already holds stays private (two requests
        computed the same prefix at once), and so does everything after it in that sequence.
        """
        if not seq.tree_open:
            return
        bs = self.block_size
        full = num_tokens // bs
        if full <= seq.tree_depth:
            return
        ids = seq.token_ids
        now = next(self._clock)
        parent = self.nodes[seq.block_table[seq.tree_depth - 1]] if seq.tree_depth else self._root(seq)
        for i in range(seq.tree_depth, full):
            key = tuple(ids[i * bs : (i + 1) * bs])
            if key in parent.children:
                seq.tree_open = False
                return
            block = seq.block_table[i]
            node = Node(block, key, parent, last_used=now)
            parent.children[key] = node
            self.nodes[block] = node
            self.blocks.cache_block(block)
            seq.tree_depth = i + 1
            parent = node

    def forget(self, seq: Sequence) -> None:
        """The sequence gave its blocks back (finished or preempted): its tree path is gone."""
        if seq.tree_depth:
            self.version += 1
        seq.tree_depth = 0
        seq.tree_open = seq.cacheable

    # ---- eviction (BlockCache) -------------------------------------------------------------

    def on_unused(self, block: int) -> None:
        node = self.nodes[block]
        if not node.children:
            heapq.heappush(self._lru, (node.last_used, block))
            if len(self._lru) > 2 * len(self.nodes):
                self._compact_lru()

    def _compact_lru(self) -> None:
        """Rebuild the eviction heap from the leaves that are candidates now. Stale entries are only
        skipped when ``evict`` pops them, and a cache that never runs short never evicts: every
        request that reused a cached prefix left one more entry behind, so a long-running server's
        heap grew with its request count. Rebuilt once it doubles the tree, it stays within that bound
        at amortised O(1) per push."""
        ref_counts = self.blocks.ref_counts
        self._lru = [(n.last_used, b) for b, n in self.nodes.items() if not n.children and ref_counts[b] == 1]
        heapq.heapify(self._lru)

    def evict(self, n: int) -> None:
        """Free ``n`` blocks that only the tree holds, least recently used leaves first."""
        freed = 0
        while freed < n:
            if not self._lru:
                raise RuntimeError(f"prefix tree asked for {n} blocks but holds only {freed} unused leaves")
            used, block = heapq.heappop(self._lru)
            node = self.nodes.get(block)
            if node is None or node.children or node.last_used != used or self.blocks.ref_counts[block] != 1:
                continue  # stale entry: evicted, became a parent, touched again, or in use
            self._remove(node)
            freed += 1

    def drop_system(self, system: int) -> None:
        """A released system prompt's id may be given to another prompt, whose KV differs: the
        tree behind it goes with it (its requests have finished, so only the tree holds its blocks)."""
        root = self._system_roots.pop(system, None)
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            del self.nodes[node.block]
            self.blocks.uncache_block(node.block)
            self.num_evicted += 1
        self.version += 1

    def clear(self) -> None:
        """Evict every block nobody uses (all of them once no request runs)."""
        self.evict(self.blocks.num_reclaimable)

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens]
        del self.nodes[node.block]
        self.blocks.uncache_block(node.block)
        self.num_evicted += 1
        if parent.parent is not None and not parent.children and self.blocks.ref_counts[parent.block] == 1:
            heapq.heappush(self._lru, (parent.last_used, parent.block))

    # ---- decode attention plan --------------------------------------------------------------

    def decode_plan(
        self, seqs: list[Sequence], num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> TwoPhasePlan | None:
        """The two-phase attention plan for a decode batch, or None when its sequences share no
        block. Cached: rebuilt only when the batch or the tree's sharing changed."""
        key = (self.version, tuple(id(s) for s in seqs))
        if key != self._plan_key:
            paths = [s.block_table[: s.tree_depth] for s in seqs]
            self._plan = build_two_phase_plan(
                paths, self.block_size, num_kv_heads, device, group=num_heads // num_kv_heads, head_dim=head_dim
            )
            self._plan_key = key
        return self._plan
