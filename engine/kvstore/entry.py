"""Stored KV entries: their keys, their in-memory form and the checksums that guard them.

What is stored is K *before RoPE* (as ``LLMEngine.compute_kv`` returns it) and V. K before RoPE
does not depend on where the chunk sat when it was computed, so one entry serves the chunk at any
offset: the reader rotates it to its new positions with the RoPE kernel, once, on the way into
attention. Storing K already rotated to position 0 would work too (RoPE composes), but would cost a
second rotation on every read for nothing.

Layout: one tensor per layer, ``[2, tokens, kv_heads, head_dim]`` (K then V), so a reader can fetch
layer ``i`` alone and overlap that with the compute of layer ``i - 1``. Every layer carries its own
xxh3 checksum, so a reader can verify layer by layer; the entry's checksum hashes all of its metadata
(key, shape, dtype and the layers' checksums) and travels inside it, so a damaged shape field is
caught before any layer is read instead of steering the reads (too few layers, wrong offsets).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from ..errors import RagfuseError


class KVStoreError(RagfuseError):
    """A KV store that cannot do what was asked (full disk, unreachable server, bad config)."""


class CorruptEntryError(KVStoreError):
    """An entry whose bytes do not match its checksum: it is dropped, never served."""


class UnreadableEntryError(KVStoreError):
    """An entry that could not be read (an I/O error, its tier unreachable): recomputed for this
    request, and left in its tier, which may serve it again once it recovers. ``key``: the entry."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
}
DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise KVStoreError(f"KV dtype {dtype} cannot be stored (float32, bfloat16 or float16)")
    return DTYPE_NAMES[dtype]


def kv_key(fingerprint: str, dtype: torch.dtype, token_ids: Sequence[int], context: Sequence[int] = ()) -> str:
    """Key of a chunk's KV: model identity, dtype, the hash of its token ids and of the ``context``
    tokens it was computed after (none: computed as a sequence start).

    Token ids, not text, because the same text tokenizes differently under another tokenizer, and
    the KV only depends on the ids. Position is deliberately not part of the key (see module doc);
    the tokens before the chunk are, since its KV depends on them. A key without context is the
    same as before contexts existed, so stores ingested then keep their entries.
    """
    h = hashlib.blake2b(digest_size=20)
    h.update(fingerprint.encode())
    h.update(b"\0" + dtype_name(dtype).encode() + b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if context:
        h.update(b"\0after\0" + struct.pack(f"<{len(context)}q", *context))
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (bf16 has no numpy dtype: go via uint8)."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def layer_checksum(layer: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(tensor_bytes(layer))


@dataclass(frozen=True)
class EntryMeta:
    """What a tier needs to know about an entry without reading its tensors."""

    key: str
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_checksums: tuple[str, ...]

    @property
    def checksum(self) -> str:
        """The hash of every field: one damaged digit of a shape field fails it, as a damaged layer
        fails its own checksum."""
        fields = (self.key, self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim,
                  dtype_name(self.dtype), *self.layer_checksums)
        return xxhash.xxh3_64_hexdigest("\0".join(map(str, fields)).encode())

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def layer_nbytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_tokens * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def to_json(self) -> dict:
        return {
            "key": self.key, "num_layers": self.num_layers, "num_tokens": self.num_tokens,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "dtype": dtype_name(self.dtype),
            "layer_checksums": list(self.layer_checksums), "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, d: dict) -> EntryMeta:
        """The metadata ``to_json`` wrote, verified: a field that does not read, a layer count that
        is not the number of layer checksums, or a checksum that is not the fields' (damage, or an
        entry written before the checksum covered the metadata) is ``CorruptEntryError``."""
        try:
            meta = cls(
                key=d["key"], num_layers=int(d["num_layers"]), num_tokens=int(d["num_tokens"]),
                num_kv_heads=int(d["num_kv_heads"]), head_dim=int(d["head_dim"]), dtype=DTYPES[d["dtype"]],
                layer_checksums=tuple(d["layer_checksums"]),
            )
            checksum = d["checksum"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptEntryError(f"entry metadata unreadable: {exc}") from exc
        if len(meta.layer_checksums) != meta.num_layers:
            raise CorruptEntryError(f"entry {meta.key}: {meta.num_layers} layers but "
                                    f"{len(meta.layer_checksums)} layer checksums")
        if checksum != meta.checksum:
            raise CorruptEntryError(f"entry {meta.key}: metadata fails its checksum")
        return meta

    def verify_layer(self, i: int, layer: torch.Tensor) -> None:
        """Raise ``CorruptEntryError`` unless ``layer`` (on CPU) matches layer ``i``'s checksum."""
        if tuple(layer.shape) != self.layer_shape or layer.dtype != self.dtype:
            raise CorruptEntryError(
                f"entry {self.key}: layer {i} has shape {tuple(layer.shape)}, expected {self.layer_shape}"
            )
        if layer_checksum(layer) != self.layer_checksums[i]:
            raise CorruptEntryError(f"entry {self.key}: layer {i} fails its checksum")


@dataclass(frozen=True)
class KVShape:
    """What a reader's model holds per token: layers, KV heads, head size, dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def mismatch(self, meta: EntryMeta, num_tokens: int | None = None) -> str | None:
        """Why ``meta`` is not this model's KV of ``num_tokens`` tokens (None: it is). A key names
        the model, dtype and tokens, so an entry under it of another shape is damaged, and reading
        it would index past its layers or misplace its rows."""
        want = (self.num_layers, self.num_kv_heads, self.head_dim, dtype_name(self.dtype))
        got = (meta.num_layers, meta.num_kv_heads, meta.head_dim, dtype_name(meta.dtype))
        if got != want:
            return f"has layers, KV heads, head size, dtype {got}; the model's are {want}"
        if num_tokens is not None and meta.num_tokens != num_tokens:
            return f"holds {meta.num_tokens} tokens for a text of {num_tokens}"
        return None


class StoredKV:
    """One chunk's KV, in memory: per-layer tensors ``[2, tokens, kv_heads, head_dim]`` (K before RoPE, V).

    Layers are separate tensors so a tier can hand them over one at a time, and a memory pool can
    hold them on any device.
    """

    def __init__(self, meta: EntryMeta, layers: list[torch.Tensor]) -> None:
        if len(layers) != meta.num_layers:
            raise KVStoreError(f"entry {meta.key}: {len(layers)} layers given, metadata says {meta.num_layers}")
        self.meta = meta
        self.layers = layers

    @classmethod
    def from_kv(cls, key: str, k: torch.Tensor, v: torch.Tensor) -> StoredKV:
        """Build an entry from ``compute_kv``'s K and V, each ``[layers, tokens, kv_heads, head_dim]``."""
        if k.shape != v.shape or k.dim() != 4:
            raise KVStoreError(f"K {tuple(k.shape)} and V {tuple(v.shape)} must both be [layers, tokens, heads, dim]")
        kv = torch.stack((k, v), dim=1).detach().to("cpu").contiguous()  # [layers, 2, tokens, heads, dim]
        layers = list(kv.unbind(0))
        meta = EntryMeta(
            key=key, num_layers=k.shape[0], num_tokens=k.shape[1], num_kv_heads=k.shape[2], head_dim=k.shape[3],
            dtype=k.dtype, layer_checksums=tuple(layer_checksum(t) for t in layers),
        )
        return cls(meta, layers)

    @property
    def key(self) -> str:
        return self.meta.key

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K (before RoPE) and V, each ``[tokens, kv_heads, head_dim]``."""
        t = self.layers[i]
        return t[0], t[1]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers as ``compute_kv`` shapes them: K and V ``[layers, tokens, kv_heads, head_dim]``."""
        stacked = torch.stack(self.layers)
        return stacked[:, 0], stacked[:, 1]

    def to(self, device: torch.device | str, pin: bool = False) -> StoredKV:
        """A copy on ``device`` (``pin``: page-locked host memory, for fast async copies to a GPU)."""
        device = torch.device(device)
        if device.type == "cpu":
            layers = [t.to("cpu") for t in self.layers]
            if pin:
                layers = [t.pin_memory() for t in layers]
        else:
            layers = [t.to(device, non_blocking=True) for t in self.layers]
        return StoredKV(self.meta, layers)
