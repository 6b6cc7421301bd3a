#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with the
# CPU build of PyTorch, and the pinned framework (nemo-automodel, --no-deps)
# whose sharder contract the compatibility test checks. Sourced by scripts/test
# and scripts/verify; safe to run again: it reinstalls only when pyproject.toml
# or the pins changed. CP_HARNESS_NO_FRAMEWORK=1 leaves the framework out (its
# tests then skip, saying how to install it). The framework's real models also need transformers and its
# dependencies: the pins of constraints/models.txt (the `models` extra), installed the same
# way (--no-deps) and left out the same way. mamba-ssm and causal-conv1d (constraints/mamba.txt, nemotron_v3_mamba's
# kernels' torch references) are sdists, built here without CUDA (their setup.py's FORCE / SKIP_CUDA switches),
# with --no-build-isolation (setup.py imports torch), only with a CPU torch; left out the same way too. torchtitan
# 0.3.0 and what its CP path imports (constraints/torchtitan.txt, examples/torchtitan) likewise. So is fla
# (constraints/fla.txt: flash-linear-attention / fla-core, --no-deps), whose CP code qwen3_5_moe's conv-halo check runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CP_HARNESS_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.cp-harness-stamp"
want="$(cat "$root/pyproject.toml" "$root/constraints/cpu.txt" "$root/constraints/test.txt" \
  "$root/constraints/framework.txt" "$root/constraints/models.txt" "$root/constraints/mamba.txt" \
  "$root/constraints/torchtitan.txt" "$root/constraints/fla.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  # The venv's own pip, installed by this Python's pip without compiling it (ensurepip compiles: 5 s -> 2.5 s);
  # a pip too old for --python gets the usual venv.
  if ! { "$python" -m venv --without-pip "$venv" &&
         "$python" -m pip --python "$venv/bin/python" install --quiet --disable-pip-version-check --no-compile pip; }; then
    "$python" -m venv --clear "$venv"
  fi
fi
# Byte code is cached, as Python does by default (some machines export PYTHONDONTWRITEBYTECODE=1, which made
# every process of the suite compile the project again): pip installs without compiling all of PyTorch's
# ~5,000 modules (--no-compile: the install took 60 s, now about 20 s on 2 cores), and each module is compiled
# once, on its first import (the warm-up below imports what every rank and test process needs).
unset PYTHONDONTWRITEBYTECODE
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing the project and its test dependencies (CPU PyTorch)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
    -c "$root/constraints/cpu.txt" -e "$root[test]"
  if [ -z "${CP_HARNESS_NO_FRAMEWORK:-}" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
      -r "$root/constraints/framework.txt"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
      -r "$root/constraints/models.txt"
    # torchtitan 0.3.0 (examples/torchtitan): pure-Python wheels, --no-deps like the framework
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
      -r "$root/constraints/torchtitan.txt"
    # CPU torch only: with a CUDA torch (the nightly's GPU job) the same versions come as CUDA builds from
    # constraints/gpu.txt, which pip would skip if this CPU build (no CUDA extension) were already installed.
    if "$venv/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
      MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
        --no-build-isolation -r "$root/constraints/mamba.txt"
      # fla (qwen3_5_moe's Gated DeltaNet convolution CP, stand-in fla_conv_cpu): pure-Python wheels, --no-deps
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
        -r "$root/constraints/fla.txt"
    fi
  fi
  "$venv/bin/python" -c "import torch, torch.distributed, torch.distributed.device_mesh, numpy, hypothesis, pytest, xdist
import cp_harness.checks, cp_harness.ranks.pool, cp_harness.verify, cp_impl, oracle"
  echo "$want" > "$stamp"
fi
export CP_HARNESS_PYTHON="$venv/bin/python"
