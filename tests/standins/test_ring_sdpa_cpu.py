"""The ring SDPA stand-in (``cp_harness.standins.ring_sdpa_cpu``) against the kernel's reference semantics.

On 1, 2 and 3 gloo ranks (``ring_sdpa_ranks.py``, one process per rank): torch's own ``context_parallel`` ring with
the CPU flash op as its per-step kernel, against float64 math SDPA on the whole sequence (output, natural-log LSE,
dQ/dK/dV), causal (torch's head-tail load balancer) and not (no load balancer: torch's ring requires causal for
it), MHA and GQA (torch's ring takes K/V with fewer heads: the template rotates them as they are), float32, float64,
bfloat16. The bound is the one-device CPU kernel's own error in the same dtype (x 4) plus 8 float32 ULP: torch's
merger and gradient accumulation work in float32 (``_cp_options.convert_to_f32``), so a float64 ring is only
float32-accurate; that property is pinned, and shown to be torch's merge: with ``convert_to_f32`` off, float64 is
float64-accurate. In one process: the stand-in is installed only inside ``install()`` and leaves no handler behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from cp_harness import standins
from cp_harness.standins import ring_sdpa_cpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
RANKS = pathlib.Path(__file__).with_name("ring_sdpa_ranks.py")
C = 4.0
F32_FLOOR = 8 * torch.finfo(torch.float32).eps  # torch's ring merges and accumulates in float32


def _variant(dtype: str, causal: bool, heads: int = 2, kv_heads: int = 2, seq: int = 12, seed: int = 0) -> dict:
    return {"dtype": dtype, "causal": causal, "heads": heads, "kv_heads": kv_heads, "seq": seq, "seed": seed}


VARIANTS = [
    _variant("float32", True, seed=0), _variant("float64", True, seed=2), _variant("bfloat16", True, seed=4),
    _variant("float32", False, seed=6), _variant("bfloat16", False, seed=8),
    _variant("float32", True, heads=4, seed=1),  # GQA: 4 query heads, 2 key/value heads
    _variant("bfloat16", True, heads=4, seed=3),
    _variant("float64", True, heads=4, seed=5),
]


def _run(worlds: tuple[int, ...], variants: list[dict], tmp_path) -> dict[int, list[dict]]:
    """Every world's ranks at once, forked by one launcher after one import (gloo); rank 0 of each writes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(RANKS), "--variants", json.dumps(variants), "--worlds",
                           ",".join(map(str, worlds)), "--out-dir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return {world: json.loads((tmp_path / f"{world}.json").read_text()) for world in worlds}


NO_F32_MERGE = {**_variant("float64", True, seed=2), "convert_to_f32": False}  # torch's merge in float64
REFUSALS = [{"refusal": "placement"}, {"refusal": "uneven"}]


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> dict[int, list[dict]]:
    """Every variant at CP 1, 2, 3 (all six ranks forked after one import: the imports were most of the time)."""
    return _run((1, 2, 3), VARIANTS + [NO_F32_MERGE] + REFUSALS, tmp_path_factory.mktemp("ring"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torchs_ring_with_the_cpu_kernel_computes_sdpa(world, ring_results):
    results = ring_results[world]
    assert [r["variant"] for r in results] == VARIANTS + [NO_F32_MERGE] + REFUSALS
    results = results[:len(VARIANTS)]
    for result in results:
        for name, error in result["cp"].items():
            bound = C * result["one_device"][name] + F32_FLOOR
            assert error <= bound, (result["variant"], name, error, bound)
        assert result["handlers_after"] == [], result  # torch's exit and the stand-in's left no handler
        assert result["used"] == ["ring_sdpa_cpu"], result  # the ring ran through the stand-in
    float64 = [r for r in results if r["variant"]["dtype"] == "float64"]
    if world > 1:  # torch's float32 merge: a float64 ring is float32-accurate only (at one rank nothing merges)
        assert all(max(r["cp"].values()) > 1e6 * torch.finfo(torch.float64).eps for r in float64), float64


@pytest.mark.parametrize("world", [2, 3])
def test_the_float64_rounding_is_torchs_float32_merge(world, ring_results):
    """With torch's ``convert_to_f32`` off, the same float64 ring is float64-accurate: the stand-in's kernel
    calls are float64 throughout, the float32-level error comes from torch's merge."""
    result = ring_results[world][len(VARIANTS)]
    assert result["variant"] == NO_F32_MERGE and result["used"] == ["ring_sdpa_cpu"]
    eps = torch.finfo(torch.float64).eps
    for name, error in result["cp"].items():
        assert error <= C * result["one_device"][name] + 8 * eps, (name, error)


@pytest.mark.parametrize("world", [2, 3])
def test_inputs_outside_torchs_ring_layout_are_refused_not_resharded(world, ring_results):
    """The stand-in invents no sharding strategy: K replicated, or a sequence not split evenly, raise."""
    placement, uneven = ring_results[world][-2:]
    assert placement["error"] and "takes Shard(2) DTensors" in placement["error"] and "Replicate" in placement["error"]
    assert uneven["error"] and "evenly sharded" in uneven["error"], uneven


def test_installed_only_inside_install_and_removed_on_exit():
    assert ring_sdpa_cpu.handlers() == {}
    with standins.entered(("ring_sdpa_cpu",), "cpu") as entered:
        assert entered.descriptions == {"ring_sdpa_cpu": "CPU, stand-in: ring SDPA per-step kernel = "
                                                         "aten._scaled_dot_product_flash_attention_for_cpu"}
        assert set(ring_sdpa_cpu.handlers()) == {ring_sdpa_cpu.FORWARD, ring_sdpa_cpu.BACKWARD}
        assert entered.used() == {}  # installed, never called: not reported as used
    assert ring_sdpa_cpu.handlers() == {}
    with pytest.raises(RuntimeError, match="boom"), ring_sdpa_cpu.install():
        raise RuntimeError("boom")
    assert ring_sdpa_cpu.handlers() == {}  # removed on an exception too


def test_not_entered_on_another_device_and_unknown_names_fail():
    with standins.entered(("ring_sdpa_cpu",), "cuda") as entered:
        assert entered.descriptions == {} and ring_sdpa_cpu.handlers() == {}
    with pytest.raises(KeyError, match="ring_sdpa_cpu"), standins.entered(("no_such_standin",), "cpu"):
        pass


def test_entered_twice_or_inside_a_cp_context_refuses():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    with ring_sdpa_cpu.install():
        with pytest.raises(RuntimeError, match="already installed"), ring_sdpa_cpu.install():
            pass
    custom_ops = torch_cp.custom_ops
    custom_ops[ring_sdpa_cpu.FORWARD] = object()  # as if torch handled the op itself
    try:
        with pytest.raises(RuntimeError, match="not needed"), ring_sdpa_cpu.install():
            pass
    finally:
        custom_ops.pop(ring_sdpa_cpu.FORWARD)
    saved = DTensor._op_dispatcher._custom_op_handlers
    DTensor._op_dispatcher._custom_op_handlers = {**torch_cp.existing_custom_ops, **torch_cp.custom_ops}
    try:
        with pytest.raises(RuntimeError, match="inside a context_parallel"), ring_sdpa_cpu.install():
            pass
    finally:
        DTensor._op_dispatcher._custom_op_handlers = saved
    assert ring_sdpa_cpu.handlers() == {}
