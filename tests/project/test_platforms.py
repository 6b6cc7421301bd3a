"""The suite holds on every CPU family: the golden, storage and oracle tests under other ATen kernel sets.

Machines differ in the last bits their float kernels produce (AVX2, AVX-512, ARM, the portable
``default`` kernels). ``ATEN_CPU_CAPABILITY`` makes PyTorch use another kernel set, so this one machine runs
the tests that read float results against stored ones as a machine of another family would: the golden
comparisons must pass within their budgets, and byte identity is asserted only where the golden manifest
records this very platform (docs/golden.md "What holds on which CPU").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/golden/test_golden.py", "tests/golden/test_golden_storage.py", "tests/oracle/test_oracle_layout.py",
         "tests/oracle/test_oracle_attention.py", "tests/oracle/test_oracle_convolution.py", "tests/oracle/test_oracle_loss.py",
         "tests/oracle/test_oracle_models.py"]


def _capabilities() -> list:
    """``default`` (the portable kernels, the farthest from any machine's own) in every run; ``avx2`` in the nightly
    job: on an AVX2 machine it is the native set, and each set costs a pytest session with a pool of its own (about
    9 s of the 2-core CPU; issue 36). Neither catches a defect fixture (``tests/project/test_nightly_scope.py``)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return ["default", pytest.param("avx2", marks=pytest.mark.nightly(reason="a second CPU kernel set"))]


@pytest.mark.slow
@pytest.mark.parametrize("capability", _capabilities() or [pytest.param("none", marks=pytest.mark.skip(
    reason="ATEN_CPU_CAPABILITY kernel sets other than the native one exist on x86-64 only"))])
def test_golden_and_oracle_tests_pass_under_another_kernel_set(capability, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CP_IMPL", "PYTEST_XDIST_WORKER")}
    env["ATEN_CPU_CAPABILITY"] = capability
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                             "--cp-world-sizes", "1,2,3,4,8", *TESTS], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout.splitlines()[-1], tail
    assert f"backend: gloo (CPU kernels: {capability})" in result.stdout, tail  # the kernels really changed
