"""The engine's one attention entry point (``Attention``) and the metadata that describes a batch."""

from .layer import Attention, set_attention_backend, write_kv
from .metadata import AttentionMetadata, RelayMetadata

__all__ = ["Attention", "AttentionMetadata", "RelayMetadata", "set_attention_backend", "write_kv"]
