#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the test suite. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "setup: ${SECONDS} s" >&2  # each phase's end, so a slow CI run shows where its time went
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check .
# the vLLM connector needs vLLM's own pins: its tests run in a second venv (scripts/test_vllm.sh), beside
# the main suite: one pytest process whose engine runs one torch thread, and a venv build that mostly
# waits on the disk, so the two cores have room for it (one after the other, ~4 more minutes on CI)
vllm_pid="" vllm_log=$(mktemp)
if [ "${RAGFUSE_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/test_vllm.sh > "$vllm_log" 2>&1 &
  vllm_pid=$!
fi
# two workers (one per core of the CI machine), each with one torch thread: the suite is mostly
# Python-bound model and server setup, which one process leaves a core idle through; whole files go
# to one worker so their module fixtures (models, engines) are built once
main_rc=0
OMP_NUM_THREADS=1 python -m pytest -q -ra --durations=25 --timeout=900 -n "${RAGFUSE_TEST_WORKERS:-2}" --dist loadfile "$@" \
  || main_rc=$?
echo "main suite done: ${SECONDS} s" >&2
vllm_rc=0
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid" || vllm_rc=$?
  echo "== vLLM connector suite (scripts/test_vllm.sh)"
  cat "$vllm_log"
  echo "vLLM connector suite done: ${SECONDS} s" >&2
fi
rm -f "$vllm_log"
[ "$main_rc" = 0 ] && [ "$vllm_rc" = 0 ]
