#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with the
# CPU build of PyTorch, and the pinned framework (nemo-automodel, --no-deps)
# whose sharder contract the compatibility test checks. Sourced by scripts/test
# and scripts/verify; safe to run again: it reinstalls only when pyproject.toml
# or the pins changed. CP_HARNESS_NO_FRAMEWORK=1 leaves the framework out (its
# tests then skip, saying how to install it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CP_HARNESS_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.cp-harness-stamp"
want="$(cat "$root/pyproject.toml" "$root/constraints/cpu.txt" "$root/constraints/framework.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing the project and its test dependencies (CPU PyTorch)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$root/constraints/cpu.txt" -e "$root[test]"
  if [ -z "${CP_HARNESS_NO_FRAMEWORK:-}" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$root/constraints/framework.txt"
  fi
  echo "$want" > "$stamp"
fi
export CP_HARNESS_PYTHON="$venv/bin/python"
