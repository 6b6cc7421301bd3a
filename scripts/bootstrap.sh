#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with the
# CPU build of PyTorch. Sourced by scripts/test and scripts/verify; safe to
# run again: it reinstalls only when pyproject.toml or the pins changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CP_HARNESS_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.cp-harness-stamp"
want="$(cat "$root/pyproject.toml" "$root/constraints/cpu.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing the project and its test dependencies (CPU PyTorch)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$root/constraints/cpu.txt" -e "$root[test]"
  echo "$want" > "$stamp"
fi
export CP_HARNESS_PYTHON="$venv/bin/python"
