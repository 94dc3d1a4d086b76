#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the test suite. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "setup: ${SECONDS} s" >&2  # each phase's end, so a slow CI run shows where its time went
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# this machine (and CI) sets PYTHONDONTWRITEBYTECODE=1 and uv installs no .pyc files, so every Python
# process compiled torch's and transformers' sources again: ~7 s of a 12 s model load, paid by each
# test worker and each of the suite's CLI and server subprocesses. Written once here, then read.
unset PYTHONDONTWRITEBYTECODE
ruff check .
# two workers (one per core of the CI machine), each with one torch thread: the suite is mostly
# Python-bound model and server setup, which one process leaves a core idle through; whole files go
# to one worker so their module fixtures (models, engines) are built once
# $RAGFUSE_TEST_PARTS > 1 runs the test files in that many parts, each in fresh worker processes, as a
# bound on what one worker can accumulate. CI ran two parts while a worker that had run half the suite
# reached 11-15 GB on the 24 GiB box (every engine a test made stayed alive until debe826, and each held a
# 1 GiB KV cache written whole until 865c573). One part now peaks at ~8.3 GB for the whole box, and saves
# the second part's worker start-up and idle tail. Arguments, if any, run as given, in one go.
main_rc=0
run_pytest() {
  OMP_NUM_THREADS=1 python -m pytest -q -ra --durations=25 --timeout=900 -n "${RAGFUSE_TEST_WORKERS:-2}" \
    --dist loadfile "$@" || main_rc=$?
}
if [ $# -gt 0 ]; then
  run_pytest "$@"
else
  mapfile -t files < <(ls tests/test_*.py)
  parts=${RAGFUSE_TEST_PARTS:-1}
  for (( i = 0; i < parts; i++ )); do
    # every parts-th file from the i-th: slow files cluster by name (test_interrupted_jobs, the server
    # audits), and halves by name left one part ~2 minutes longer than the other
    part=()
    for (( j = i; j < ${#files[@]}; j += parts )); do part+=("${files[j]}"); done
    [ "$i" != 0 ] || part+=(tests/vllm)  # skips itself here: vLLM lives in its own venv (below)
    [ ${#part[@]} -gt 0 ] || continue
    run_pytest "${part[@]}"
    echo "main suite, part $((i + 1)) of ${parts} done: ${SECONDS} s" >&2
  done
fi
echo "main suite done: ${SECONDS} s" >&2
# the vLLM connector needs vLLM's own pins: its tests run in a second venv (scripts/test_vllm.sh), after
# the main suite (beside it, vLLM's engine and two workers came close to the CI box's 24 GiB)
# its venv is built then too: unpacking it beside the main suite (GBs written) is the likely cause of
# a server test's 18 s stall (an upload's stored-KV fsyncs wait behind that writeback)
vllm_rc=0
if [ "${RAGFUSE_SKIP_VLLM:-0}" != 1 ]; then
  echo "== vLLM connector suite (scripts/test_vllm.sh)"
  bash scripts/test_vllm.sh || vllm_rc=$?
  echo "vLLM connector suite done: ${SECONDS} s" >&2
fi
[ "$main_rc" = 0 ] && [ "$vllm_rc" = 0 ]
