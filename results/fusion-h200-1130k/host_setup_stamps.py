"""Scratch: host time stamps inside fuse_prefill (graphed fuse@15%, CPU tier, Mistral-7B shape) up to the
first layer's replay, medians over passes; and the same pass's GPU start (first kernel) vs entry."""
import json
import statistics
import sys
import types

sys.path.insert(0, "results/fusion-h200-1130h")
from capcost import cpu_tier_prompt  # noqa: E402

from ragfuse.engine import model_runner  # noqa: E402
from ragfuse.engine.fusion import SelectionPolicy, fusor  # noqa: E402

ANCHORS = [
    ("layout", "num_stored, num_fusable, num_active = len(lay.stored)"),
    ("prepare", "# layer 0's stored KV is on its way"),
    ("loader_made", "graph_from = num_layers if cap is None"),
    ("loader_entered", "block_size = kv_layers[0][0].shape[1]"),
    ("host_arrays", "host: dict[str, np.ndarray] = {}"),
    ("to_device", "dev = _to_device(device, host) if host else {}"),
    ("sent", "bounds_all, fusable = dev[\"bounds\"], dev[\"fusable\"]"),
    ("embedded", "residual: torch.Tensor | None = None"),
    ("first_get", "loader.get(li, ahead=False)  # the compute stream waits"),
    ("first_replay_issued", "loader.ahead(li)\n                counts.append"),
]
with open(fusor.__file__) as f:
    src = f.read()
for name, anchor in ANCHORS:
    i = src.index(anchor)
    line_start = src.rindex("\n", 0, i) + 1
    indent = src[line_start:i]
    src = src[:line_start] + f"{indent}_S.append(('{name}', time.perf_counter()))\n" + src[line_start:]
src = src.replace("    t_start = time.perf_counter()\n", "    t_start = time.perf_counter()\n    _S.clear()\n"
                  "    _S.append(('entry', t_start))\n", 1)
mod = types.ModuleType("ragfuse.engine.fusion.fusor_stamped")
mod.__package__ = "ragfuse.engine.fusion"
mod.__dict__["_S"] = []
sys.modules[mod.__name__] = mod
exec(compile(src, fusor.__file__, "exec"), mod.__dict__)
model_runner.fuse_prefill = mod.fuse_prefill

prompt = cpu_tier_prompt("mistral-7b")
pol = SelectionPolicy.default()
for _ in range(3):
    prompt.run("cpu", "fuse", pol)
rows = []
for _ in range(25):
    st = prompt.run("cpu", "fuse", pol)
    s = mod._S
    seen = {}
    for n, t in s:
        seen.setdefault(n, t)  # first occurrence (the first layer's)
    rows.append({n: (t - s[0][1]) * 1e3 for n, t in seen.items()} | {"total": st.total_s * 1e3})
keys = list(rows[0])
print(json.dumps({k: round(statistics.median(r[k] for r in rows), 3) for k in keys}))
