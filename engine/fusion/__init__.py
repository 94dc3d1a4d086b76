"""Cache fusion (CacheBlend): a prompt made of stored chunks gets full prefill's answer while only
a chosen few of the chunks' tokens are recomputed."""

from .fusor import FusionMode, FusionStats, SystemPart, fuse_prefill
from .segments import LayerSource, Segment, TensorKV
from .selection import SelectionPolicy

__all__ = ["FusionMode", "FusionStats", "LayerSource", "Segment", "SelectionPolicy", "SystemPart", "TensorKV",
           "fuse_prefill"]
