#!/usr/bin/env bash
# Set up megatron-glm5 on a fresh machine: find Python 3.12, make .venv, install the project editable.
#   bash scripts/setup.sh               # core + dev + tilelang extras (TileLang imports and compiles on CPU)
#   bash scripts/setup.sh --no-tilelang # without TileLang (its kernels only run on a GPU anyway)
# Only the package registries need to be reachable. Re-running it is cheap: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="dev,tilelang"
for arg in "$@"; do
  case "$arg" in
    --no-tilelang) extras="dev" ;;
    *) echo "setup.sh: unknown option '$arg' (known: --no-tilelang)" >&2; exit 2 ;;
  esac
done

find_python() {
  # megatron-core >= 0.17 requires Python 3.12. A pyenv shim named python3.12 may exist but refuse
  # to run, so every candidate is tried, not only looked up.
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=(python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/3.12*/bin/python; do candidates+=("$p"); done
  fi
  for p in /usr/bin/python3.12 /usr/local/bin/python3.12; do candidates+=("$p"); done
  for p in "${candidates[@]}"; do
    if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$p"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "setup.sh: no working Python 3.12 found (tried python3.12, pyenv 3.12.*, /usr/bin); set PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "setup.sh: creating .venv with $py"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".[${extras}]"
# The outside oracle of the Megatron-layout tests (tests/test_bridge_megatron_layout.py reads NVIDIA Megatron-Bridge's
# GLM-5 table from its source, without importing it): --no-deps, none of its GPU stack is needed for that (an extra
# cannot say --no-deps, hence here and not in setup.py's dev extra).
.venv/bin/python -m pip install -q --no-deps "megatron-bridge==0.6.2"
# the installed distributions' versions: megatron.core.__version__ appends the git hash of the enclosing checkout
.venv/bin/python -c "import megatron.core, transformers, megatron_glm5, bridge; from importlib.metadata import version as v; print('megatron-glm5 ready: megatron-core', v('megatron-core'), '| transformers', v('transformers'))"
