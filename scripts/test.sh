#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the test suite. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
python -m pytest -q -ra --timeout=900 "$@"
# the vLLM connector needs vLLM's own pins: its tests run in a second venv (scripts/test_vllm.sh)
[ "${RAGFUSE_SKIP_VLLM:-0}" = 1 ] || bash scripts/test_vllm.sh
