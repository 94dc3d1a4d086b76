#!/usr/bin/env bash
# `pip install ARGS...` into the environment of the python $1, through uv where it can be had.
#
# uv resolves and installs the same packages as pip about ten times faster (the main venv's
# `-e ".[all]"`: 112 s with pip, 11 s with uv on the 2-core CI box), which is most of CI's set-up.
# uv does not read pip's configuration, so this machine's pip settings that say where packages lie
# (find-links, constraints, local indexes) are passed on. Where uv cannot be installed or fails,
# pip does the same install.
set -euo pipefail
py=$1
shift
pip_config=$("$py" -m pip config list 2>/dev/null || true)  # read once: pip takes ~0.5 s to start
pip_setting() {  # every value of one pip setting, from any of pip's configuration sources
  sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" <<<"$pip_config" | tr ' ' '\n' | sort -u
}
uv_args=(--index-strategy unsafe-best-match)  # pip's rule: the best version on any index, not the first index's
for links in $(pip_setting find-links); do
  if [ -e "$links" ]; then uv_args+=(--find-links "$links"); fi
done
for constraint in $(pip_setting constraint); do
  if [ -e "$constraint" ]; then uv_args+=(--constraint "$constraint"); fi
done
for index in $(pip_setting extra-index-url); do
  if [[ $index != file://* ]] || [ -e "${index#file://}" ]; then  # a missing local index is skipped, as pip does
    uv_args+=(--extra-index-url "$index")
  fi
done
if "$py" -m uv --version >/dev/null 2>&1 || "$py" -m pip install -q uv; then
  if "$py" -m uv pip install --python "$py" "${uv_args[@]}" "$@"; then
    exit 0
  fi
  echo "uv could not install $*; trying pip" >&2
fi
exec "$py" -m pip install "$@"
