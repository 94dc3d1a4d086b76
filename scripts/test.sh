#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the test suite. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
python -m pytest -q -ra --timeout=900 "$@"
