"""Cache fusion (CacheBlend): a prompt made of stored chunks gets full prefill's answer while only
a chosen few of the chunks' tokens are recomputed."""

from .fusor import FusionMode, FusionStats, fuse_prefill
from .segments import LayerSource, Segment, TensorKV
from .selection import SelectionPolicy

__all__ = ["FusionMode", "FusionStats", "LayerSource", "Segment", "SelectionPolicy", "TensorKV", "fuse_prefill"]
