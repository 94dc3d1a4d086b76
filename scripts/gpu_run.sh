#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine (the image's python3: torch, triton, transformers).
# Usage: bash scripts/gpu_run.sh PART [OUT]   PART: tests | engine | store | fusion | all | relay | relay-profile | tree | sessions
# Results land in OUT (default $OUT, else gpu-results): one folder per benchmark, plus logs.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${2:-${OUT:-gpu-results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
run() { echo "== $*"; "$@" 2>&1 | grep -v "it/s]" ; }
case "$part" in
  tests|all)
    # every GPU test whose module imports on the GPU machine (no langchain/fastapi/gguf there)
    run python3 scripts/gpu_tests.py "$out/gpu-tests.log" "${GPU_TEST_SHARDS:-10}" -- \
      tests/test_kernels.py tests/test_kernels_dispatch.py tests/test_cuda_graphs.py tests/test_fusion_gpu.py \
      tests/test_fusion_graphs.py tests/test_fusion_prefetch.py tests/test_relay.py tests/test_relay_engine.py \
      tests/test_two_phase.py tests/test_sessions_gpu.py tests/test_kvstore_tiers.py tests/test_swap_preemption.py \
      tests/test_staged_inputs.py tests/test_gemm_library.py | tail -60 ;;&
  engine|all)
    run python3 -m ragfuse.cli bench engine --device cuda --shape mistral-7b --out "$out/engine" | tail -12 ;;&
  store|all)
    run python3 -m ragfuse.cli bench store --device cuda --out "$out/store" | tail -12 ;;&
  relay)  # relay attention alone: its GPU tests (and the kernels/graphs it builds on), then its benchmark
    run timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_relay.py tests/test_relay_engine.py \
      tests/test_cuda_graphs.py tests/test_kernels.py -k "relay or system or graph or decode or merge or layer" \
      | tee "$out/gpu-tests.log" | tail -15
    run python3 -m ragfuse.cli bench relay --device cuda --out "$out/relay" | tail -40 ;;
  relay-profile)  # where relay decode's time goes (parts, floor, launch parameters), and per-step e2e times
    run python3 -m ragfuse.bench.relay_profile "$out/relay-profile.json" --sweep --e2e | tail -60 ;;
  tree)  # two-phase decode vs our paged kernel over a shared prefix, and the engine with the tree on/off
    run python3 -m ragfuse.cli bench tree --device cuda --e2e --out "$out/tree" | tail -40 ;;
  sessions)
    run python3 -m ragfuse.cli bench sessions --device cuda --parts ttft --out "$out/sessions" | tail -30 ;;
  fusion|all)
    run python3 -m ragfuse.cli bench fusion --device cuda --shape mistral-7b --shape "${FUSION_BIG_SHAPE:-yi-34b}" \
      --out "$out/fusion" | tail -30 ;;
esac
