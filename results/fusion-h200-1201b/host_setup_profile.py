"""Where the host's time goes before a fused pass's first layer (fuse@15%, CPU tier, random-weight SHAPE,
6 x 512 + 32 tokens): cProfile switched on at ``fuse_prefill``'s entry and off at the loader's first ``get``
(right before layer 0 is replayed), over 40 passes after 5 unprofiled ones. Prints the functions by own time
and by cumulative time. Usage: host_setup_profile.py [SHAPE]"""
from __future__ import annotations

import cProfile
import pstats
import sys

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine import model_runner  # noqa: E402
from ragfuse.engine.fusion import SelectionPolicy, fusor  # noqa: E402
from ragfuse.engine.fusion.prefetch import LayerPrefetcher  # noqa: E402

prof = cProfile.Profile()
on = [False]


class StopAtFirstGet(LayerPrefetcher):
    def get(self, layer, ahead=True):
        if on[0]:
            prof.disable()
            on[0] = False
        return super().get(layer, ahead)


shipped = model_runner.fuse_prefill


def profiled(*args, **kwargs):
    on[0] = True
    prof.enable()
    return shipped(*args, **kwargs)


prompt = cpu_tier_prompt(sys.argv[1] if len(sys.argv) > 1 else "mistral-7b")
pol = SelectionPolicy.default()
for _ in range(5):
    prompt.run("cpu", "fuse", pol)
fusor.LayerPrefetcher = StopAtFirstGet
model_runner.fuse_prefill = profiled
for _ in range(40):
    prompt.run("cpu", "fuse", pol)
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(40)
stats.sort_stats("cumulative").print_stats(40)
