"""Fixtures the project's own tests share across folders.

``real_models``: one warm pool of 3 ranks for every real-model test module of the session (or xdist worker), whose
launcher imports every CPU model spec once before it forks (``PoolConfig.preload``): a pool start with the
framework's models imported costs 15-40 s on 2 cores, and each rank's first case of a model compiles its kernels.
The modules that use it carry ``pytest.mark.xdist_group("real_models")`` (``./scripts/test`` distributes with
``--dist loadgroup``), so one worker starts it once.
"""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CPU_SPECS = tuple(f"examples.automodel.models.{name}" for name in (
    "deepseek_v41", "deepseek_v4", "qwen3_8_flash_next", "glm5_next", "qwen3_5_moe", "gemma4_moe", "kimi_linear",
    "kimi_k3", "load_balanced_sdpa", "load_balanced_sdpa_alltoall"))  # the last two on the ring SDPA CPU stand-in

@pytest.fixture(scope="session")
def real_models():
    """A ``CaseRunner`` on the shared real-model pool (3 ranks, every CPU spec preloaded, fixtures importable)."""
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "TORCHDYNAMO_DISABLE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIXTURES), str(ROOT), saved["PYTHONPATH"]) if p)
    # The framework torch.compile's its MoE activations; each rank compiling them for each model and dtype cost
    # 10-20 s per model on 2 cores, for code that is not CP. The default command runs them eagerly (the same math);
    # scripts/real_clients and the nightly run them as the framework does.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    runner = CaseRunner(PoolConfig(world_size=3, impl="cp_impl", case_timeout=180.0, collective_timeout=90.0,
                                   preload=CPU_SPECS))
    try:
        runner.pool.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield runner
    finally:
        runner.close()
