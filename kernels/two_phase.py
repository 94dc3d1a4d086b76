"""Two-phase decode attention over KV blocks shared by several sequences (ChunkAttention), in torch.

When sequences share a prompt prefix (the engine's prefix tree hands them the same cache blocks),
the paged decode kernel still reads the shared blocks once per sequence. Two-phase attention reads
them once per batch instead:

- chunk-first: for each run of blocks shared by a group of sequences (a *segment*), the group's
  queries, stacked into one matrix, attend to the segment: a matrix-matrix product per KV head,
  written out as partial attentions (output + log-sum-exp) per sequence;
- sequence-first: each sequence attends to its own blocks after its shared prefix, and folds in the
  partials of the segments above it by their log-sum-exp (online softmax), which is exact.

``build_two_phase_plan`` turns the batch's tree paths into the work list both phases follow (host
ints and small device tensors, built once while the sharing stays the same); ``two_phase_decode_ref``
is the plain-torch reference (CPU path, and the check for ``two_phase_triton.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .merge import merge_attention_ref
from .paged_attention import _sdpa_lse, attention_with_lse, sequence_slots

SPLIT_ALIGN = 64  # split lengths are whole key tiles of the Triton kernel


@dataclass
class TwoPhasePlan:
    """Work of a two-phase decode step, for a batch of ``num_seqs`` sequences.

    ``items`` rows are ``(lo, hi, key_start, key_end, slot)``: the sequences at sorted positions
    ``lo..hi-1`` (``order`` maps a sorted position to a batch row; sharing sequences are adjacent
    there) share keys ``key_start..key_end-1``, and write that partial to their partial slot
    ``slot``. Sequence ``s`` has ``num_parts[s]`` partials and its own keys start at
    ``shared_lens[s]``. Device tensors for the kernels, host lists for the reference.

    ``num_items``, ``max_item_seqs`` and ``max_parts`` size the kernels' launch grids and partial
    buffers. A built plan has them exact; a CUDA graph's plan (``padded``) has fixed capacities
    instead, and the rows past the real ones are inert (an item with ``lo == hi`` covers no query,
    a sequence with ``num_parts = 0`` folds in nothing), so one captured graph serves every plan
    that fits.
    """

    num_seqs: int
    items: torch.Tensor  # [num_items, 5] int32
    order: torch.Tensor  # [num_seqs] int32
    shared_lens: torch.Tensor  # [num_seqs] int32, by batch row
    num_parts: torch.Tensor  # [num_seqs] int32, by batch row
    host_items: list[tuple[int, int, int, int, int]]
    host_order: list[int]
    host_shared_lens: list[int]
    max_parts: int  # most partial slots of any sequence
    max_item_seqs: int  # most sequences of any item
    num_items: int  # item rows the chunk-first grid covers

    @classmethod
    def padded(cls, num_seqs: int, items: torch.Tensor, order: torch.Tensor, shared_lens: torch.Tensor,
               num_parts: torch.Tensor, max_parts: int) -> TwoPhasePlan:
        """A plan over fixed device buffers (a CUDA graph's inputs) of ``items.shape[0]`` item rows
        and ``max_parts`` partial slots, for any batch of up to ``num_seqs`` sequences; the caller
        fills the buffers with a built plan before each use (``load_into``). No host lists: the
        torch reference cannot run it."""
        return cls(num_seqs=num_seqs, items=items, order=order, shared_lens=shared_lens, num_parts=num_parts,
                   host_items=[], host_order=[], host_shared_lens=[], max_parts=max_parts,
                   max_item_seqs=num_seqs, num_items=items.shape[0])

    def load_into(self, padded: TwoPhasePlan) -> None:
        """Copy this plan into ``padded``'s buffers (on the device) and make the rest inert."""
        n, k = self.num_seqs, self.num_items
        if k > padded.num_items or self.max_parts > padded.max_parts or n > padded.num_seqs:
            raise ValueError(f"plan of {k} items, {self.max_parts} partials, {n} sequences exceeds the padded "
                             f"plan's {padded.num_items}, {padded.max_parts}, {padded.num_seqs}")
        padded.items[:k].copy_(self.items)
        padded.items[k:].zero_()
        padded.order[:n].copy_(self.order)  # positions past n are read by no item
        for dst, src in ((padded.shared_lens, self.shared_lens), (padded.num_parts, self.num_parts)):
            dst[:n].copy_(src)
            dst[n:].zero_()

    @property
    def shared_tokens(self) -> int:
        """Keys read by the chunk-first phase (once per batch instead of once per sequence)."""
        return sum(k1 - k0 for _, _, k0, k1, _ in self.host_items)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def chunk_first_tile(max_rows: int, head_dim: int) -> int:
    """Query rows per chunk-first program: all of a group's rows when they fit, at most 64 for
    head_dim 128 (128 rows x 128 dims of float32 accumulator would spill registers)."""
    return max(16, min(1 << max(0, max_rows - 1).bit_length(), 64 if head_dim > 64 else 128))


def default_split_tokens(
    total_shared: int, num_kv_heads: int, query_tiles: int, device: torch.device
) -> int | None:
    """Keys per chunk-first item so the grid (items x KV heads x query tiles) has about two
    programs per multiprocessor; None (no split) off CUDA. Fewer, longer items would leave SMs
    idle; more add partials, which the sequence-first phase folds in one after another."""
    if device.type != "cuda" or total_shared == 0:
        return None
    items = max(1, math.ceil(2 * _sm_count(device) / (num_kv_heads * query_tiles)))
    split = math.ceil(total_shared / items)
    return max(2 * SPLIT_ALIGN, -(-split // SPLIT_ALIGN) * SPLIT_ALIGN)


def build_two_phase_plan(
    paths: list[list[int]],
    block_size: int,
    num_kv_heads: int,
    device: torch.device,
    split_tokens: int | None = None,
    group: int = 1,
    head_dim: int = 128,
) -> TwoPhasePlan | None:
    """The plan for sequences whose cache starts with the tree blocks ``paths[s]``; None if no two
    of them share a block.

    Sorting the paths makes the sequences under any tree node contiguous; a segment is the longest
    run of blocks that a contiguous group of at least two sequences all share (their paths' common
    prefix: that of the group's first and last path, once sorted), and the group then splits by the
    next block. ``split_tokens`` cuts long segments into several items (default: by device, for
    ``group`` query heads per KV head of ``head_dim``).
    """
    n = len(paths)
    order = sorted(range(n), key=lambda s: paths[s])
    segments: list[tuple[int, int, int, int]] = []  # (lo, hi, first block, end block)

    def visit(lo: int, hi: int, depth: int) -> None:
        first, last = paths[order[lo]], paths[order[hi - 1]]
        end = depth
        while end < min(len(first), len(last)) and first[end] == last[end]:
            end += 1
        if end > depth:
            segments.append((lo, hi, depth, end))
        j = lo
        while j < hi:
            p = paths[order[j]]
            k = j + 1
            if len(p) > end:
                while k < hi and len(paths[order[k]]) > end and paths[order[k]][end] == p[end]:
                    k += 1
                if k - j >= 2:
                    visit(j, k, end)
            j = k

    groups_start = 0
    while groups_start < n:  # top level: groups by the first block (a forest)
        p = paths[order[groups_start]]
        k = groups_start + 1
        if p:
            while k < n and paths[order[k]] and paths[order[k]][0] == p[0]:
                k += 1
            if k - groups_start >= 2:
                visit(groups_start, k, 0)
        groups_start = k
    if not segments:
        return None
    total = sum((e - d) * block_size for _, _, d, e in segments)
    rows = max(hi - lo for lo, hi, _, _ in segments) * group
    tiles = -(-rows // chunk_first_tile(rows, head_dim))
    split = split_tokens or default_split_tokens(total, num_kv_heads, tiles, device)
    parts = [0] * n  # partial slots used so far, by sorted position (segments come parent first)
    shared = [0] * n
    items: list[tuple[int, int, int, int, int]] = []
    for lo, hi, d, e in segments:
        k0, k1 = d * block_size, e * block_size
        step = split or (k1 - k0)
        slot = parts[lo]
        for i, start in enumerate(range(k0, k1, step)):
            items.append((lo, hi, start, min(start + step, k1), slot + i))
        for j in range(lo, hi):
            parts[j] = slot + len(range(k0, k1, step))
            shared[j] = k1
    num_parts = [0] * n
    shared_lens = [0] * n
    for j, s in enumerate(order):
        num_parts[s] = parts[j]
        shared_lens[s] = shared[j]

    def dev(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)

    return TwoPhasePlan(
        num_seqs=n, items=dev(items), order=dev(order), shared_lens=dev(shared_lens), num_parts=dev(num_parts),
        host_items=items, host_order=order, host_shared_lens=shared_lens,
        max_parts=max(num_parts), max_item_seqs=max(hi - lo for lo, hi, *_ in items), num_items=len(items),
    )


def two_phase_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: TwoPhasePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``paged_decode_attention_ref`` (no sliding window): q [num_seqs, H, D] ->
    (out [num_seqs, H, D], lse [num_seqs, H] float32), computed in two phases over ``plan``."""
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    block_size = k_cache.shape[1]
    kf = k_cache.view(-1, kv_heads, dim)
    vf = v_cache.view(-1, kv_heads, dim)
    partials: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_seqs)]
    for lo, hi, k0, k1, _slot in plan.host_items:  # chunk-first: a group's queries against its keys
        rows = plan.host_order[lo:hi]
        idx = sequence_slots(block_tables[rows[0]], k1, block_size)[k0:]
        qg = q[rows].view(hi - lo, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
        out, lse = _sdpa_lse(qg, kf[idx].transpose(0, 1), vf[idx].transpose(0, 1), scale, None, False)
        out = out.view(kv_heads, hi - lo, group, dim).transpose(0, 1).reshape(hi - lo, heads, dim)
        lse = lse.view(kv_heads, hi - lo, group).transpose(0, 1).reshape(hi - lo, heads)
        for j, s in enumerate(rows):
            partials[s].append((out[j], lse[j]))
    out = torch.empty_like(q)
    lse = torch.empty((num_seqs, heads), dtype=torch.float32, device=q.device)
    for s, seq_len in enumerate(seq_lens.tolist()):  # sequence-first: own keys, then fold partials
        start = plan.host_shared_lens[s]
        idx = sequence_slots(block_tables[s], seq_len, block_size)[start:]
        o, m = attention_with_lse(q[s : s + 1], kf[idx], vf[idx], scale, seq_len - 1)
        for po, pl in partials[s]:
            o, m = merge_attention_ref(o, m, po[None], pl[None])
        out[s], lse[s] = o[0], m[0]
    return out, lse
