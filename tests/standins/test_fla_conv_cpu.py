"""The fla convolution stand-ins (``cp_harness.standins.fla_conv_cpu``) and fla's convolution CP on CPU.

fla's own Triton conv kernels, run by Triton's CPU interpreter in a subprocess, against the stand-in (forward, and the
backward where the interpreter runs it). In one process: ``conv_fwd`` / ``conv_bwd`` against the Triton kernels'
definition written out as a loop in float64
(``y[t] = act(sum_j w[:, j] x[t - W + 1 + j] + b) + r[t]``, positions before a sequence's start read the last
``W - 1`` columns of its ``initial_state`` row; ``cu_seqlens`` restarts at every document), their gradients
(``dh0``'s column 0 is never read), the refusals, installing and removing. On 1, 2 and 3 gloo ranks
(``fla_conv_ranks.py``, one process per rank): the framework's ``CPAwareGatedDeltaNet._conv1d_with_cp`` with fla's
``build_cp_context`` and fla's halo exchange, judged against the framework's one-device convolution with the
real-model check's bounds, plain rows and packed documents that cross rank boundaries, and Kimi Linear's KDA short
convolution the way ``KimiDeltaAttention._kda_core`` calls it (fla's ``ShortConvolution`` with the framework's
``build_fla_cp_context``, against its one-device ``cu_seqlens`` path); the gradient-only defect
``conv_halo_backward_not_sent`` fails the gate on ``dx`` only (naming the positions) while the output passes; and
gloo's refusal of fla's stacked all-gather without the gloo stand-in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from cp_harness import standins
from cp_harness.standins import fla_conv_cpu

# Found, not imported: importing fla (and the transformers it imports) costs each pytest worker 5 s of CPU at
# collection, and only the worker that runs this module's tests needs it.
if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention is not installed (constraints/fla.txt)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
RANKS = pathlib.Path(__file__).with_name("fla_conv_ranks.py")
W = 4


def definition(x, weight, bias=None, residual=None, initial_state=None, activation=None, cu_seqlens=None):
    """The kernel's contract as a loop, float64: ``x`` ``[B, T, D]``, ``weight`` ``[D, W]``, ``initial_state``
    ``[N, D, W]`` (sequence ``n``: row ``n``, or document ``n`` of the one row with ``cu_seqlens``)."""
    x, weight = x.double(), weight.double()
    B, T, D = x.shape
    width = weight.shape[1]
    spans = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [
        (0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]  # fmt: skip
    y = torch.zeros_like(x)
    for n, (row, start, end) in enumerate(spans):
        for t in range(end - start):
            acc = torch.zeros(D, dtype=torch.float64)
            for j in range(width):
                pos = t - (width - 1) + j
                if pos >= 0:
                    acc += weight[:, j] * x[row, start + pos]
                elif initial_state is not None:
                    acc += weight[:, j] * initial_state[n, :, width + pos].double()
            if bias is not None:
                acc += bias.double()
            if activation in ("silu", "swish"):
                acc = acc * torch.sigmoid(acc)
            if residual is not None:
                acc += residual[row, start + t].double()
            y[row, start + t] = acc
    return y


def _inputs(dtype, rows=2, T=9, D=5, seed=0, n_states=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, T, D, generator=g).to(dtype)
    weight = torch.randn(D, W, generator=g).to(dtype)
    bias = torch.randn(D, generator=g).to(dtype)
    residual = torch.randn(rows, T, D, generator=g).to(dtype)
    h0 = torch.randn(n_states or rows, D, W, generator=g).to(dtype)
    dy = torch.randn(rows, T, D, generator=g).to(dtype)
    return x, weight, bias, residual, h0, dy


CASES = [
    dict(activation="silu", with_state=True, with_residual=False, cu=None),
    dict(activation=None, with_state=False, with_residual=True, cu=None),
    dict(activation="swish", with_state=True, with_residual=True, cu=[0, 2, 3, 9]),
    dict(activation="silu", with_state=False, with_residual=False, cu=[0, 9]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['activation']}-state{c['with_state']}-cu{c['cu']}")
def test_forward_is_the_kernels_definition(case):
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    rows = 1 if cu is not None else 2
    x, weight, bias, residual, h0, _ = _inputs(torch.float32, rows=rows, n_states=None if cu is None else len(cu) - 1)
    h0 = h0 if case["with_state"] else None
    residual = residual if case["with_residual"] else None
    y, final = fla_conv_cpu.conv_fwd(x, weight, bias, residual, h0, activation=case["activation"], cu_seqlens=cu)
    ref = definition(x, weight, bias, residual, h0, case["activation"], cu)
    assert final is None and y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['activation']}-state{c['with_state']}-cu{c['cu']}")
def test_backward_is_the_definitions_gradient(case):
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    rows = 1 if cu is not None else 2
    x, weight, bias, residual, h0, dy = _inputs(torch.float32, rows=rows, seed=3,
                                                n_states=None if cu is None else len(cu) - 1)  # fmt: skip
    h0 = h0 if case["with_state"] else None
    residual = residual if case["with_residual"] else None
    dx, dw, db, dr, dh0 = fla_conv_cpu.conv_bwd(x, dy, None, weight, bias, residual, h0, case["activation"], cu)
    leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    state = None if h0 is None else h0.double().requires_grad_()
    ref = definition(*leaves, residual, state, case["activation"], cu)
    wanted = leaves + ([state] if state is not None else [])
    grads = torch.autograd.grad(ref, wanted, dy.double())
    for got, want in zip((dx, dw, db) + ((dh0,) if state is not None else ()), grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (dr is dy) == (residual is not None)
    if state is None:
        assert dh0 is None
    else:
        assert dh0.shape == h0.shape and torch.count_nonzero(dh0[:, :, 0]) == 0  # column 0 is never read
        assert torch.count_nonzero(dh0[:, :, 1:]) > 0


def test_bfloat16_keeps_the_dtype_and_accumulates_in_float32():
    x, weight, bias, _, h0, dy = _inputs(torch.bfloat16, seed=5)
    y, _ = fla_conv_cpu.conv_fwd(x, weight, bias, None, h0, activation="silu")
    ref = definition(x, weight, bias, None, h0, "silu")
    assert y.dtype == torch.bfloat16
    assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 2 * torch.finfo(torch.bfloat16).eps
    dx, dw, db, _, dh0 = fla_conv_cpu.conv_bwd(x, dy, None, weight, bias, None, h0, "silu")
    assert (dx.dtype, dw.dtype, db.dtype, dh0.dtype) == (torch.bfloat16,) * 4


def test_what_the_cp_path_never_passes_is_refused():
    x, weight, bias, _, h0, dy = _inputs(torch.float32)
    with pytest.raises(NotImplementedError, match="final state"):
        fla_conv_cpu.conv_fwd(x, weight, bias, None, h0, output_final_state=True)
    with pytest.raises(NotImplementedError, match="final state"):
        fla_conv_cpu.conv_bwd(x, dy, torch.zeros_like(h0), weight, bias, None, h0)
    with pytest.raises(NotImplementedError, match="activation"):
        fla_conv_cpu.conv_fwd(x, weight, bias, None, None, activation="relu")


def test_fla_sees_the_stand_in_only_while_installed_and_its_own_conv_matches_the_definition():
    import fla.modules.causal_conv1d as conv
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.ops.cp.comm as comm

    own = (conv.causal_conv1d_fwd, conv.causal_conv1d_bwd, conv_ops.causal_conv1d_fwd, comm.dist)
    x, weight, bias, _, _, dy = _inputs(torch.float32, seed=7)
    with standins.entered(("fla_conv_cpu", "fla_gloo_allgather"), "cpu") as record:
        assert conv.causal_conv1d_fwd is fla_conv_cpu.conv_fwd and conv_ops.causal_conv1d_bwd is fla_conv_cpu.conv_bwd
        assert comm.dist is not torch.distributed and comm.dist.get_rank is torch.distributed.get_rank
        leaf = x.clone().requires_grad_()
        y, _ = conv.causal_conv1d(leaf, weight, bias, activation="silu")  # fla's own non-CP autograd Function
        y.backward(dy)
        used = record.used()
        with pytest.raises(RuntimeError, match="entered twice"):
            with fla_conv_cpu.install():
                pass
    ref_leaf = x.double().requires_grad_()
    ref = definition(ref_leaf, weight, bias, activation="silu")
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-5, atol=1e-5)
    assert used == {"fla_conv_cpu": fla_conv_cpu.FLA_CONV_CPU.description}  # no gather ran: not reported
    assert (conv.causal_conv1d_fwd, conv.causal_conv1d_bwd, conv_ops.causal_conv1d_fwd, comm.dist) == own


INTERPRETED = pathlib.Path(__file__).with_name("fla_conv_interpreted.py")


def test_the_stand_in_computes_what_flas_own_kernel_source_computes_under_tritons_interpreter():
    """fla's Triton conv kernels themselves, executed by Triton's CPU interpreter (``TRITON_INTERPRET=1``), against
    ``conv_fwd`` / ``conv_bwd``: the forward with and without an initial state, documents, residual; the backward
    where the interpreter runs it (fla's separate ``compute_dh0_kernel``, reached with an initial state, fails in
    triton 3.9.0's interpreter: ``mask has unsupported dtype``). Float32, relative to the largest value."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    done = subprocess.run([sys.executable, str(INTERPRETED)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    bound = 16 * torch.finfo(torch.float32).eps
    for name, result in results.items():
        assert result["y"] <= bound, (name, result)
        for grad in ("dx", "dw", "db", "dr", "dh0"):
            assert result.get(grad, 0.0) <= bound, (name, result)
        if "bwd_error" in result:  # only where fla's dh0 kernel runs: with an initial state
            assert "state" in name and "mask has unsupported dtype" in result["bwd_error"], (name, result)
        else:
            assert {"dx", "dw", "db"} <= set(result), (name, result)
    assert {n for n, r in results.items() if "bwd_error" not in r} == {"rows_bias_silu", "docs_swish"}


def _run(worlds: tuple[int, ...], variants: list[dict], tmp_path) -> dict[int, list[dict]]:
    """Every world's ranks at once, forked by one launcher after one import (gloo); rank 0 of each writes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(RANKS), "--variants", json.dumps(variants), "--worlds",
                           ",".join(map(str, worlds)), "--out-dir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {world: json.loads((tmp_path / f"{world}.json").read_text()) for world in worlds}


# Packed documents: at CP 2 (rank boundary 12) the third crosses it with 2 tokens before it; at CP 3 (8, 16) the
# second and the fourth cross. The second packed layout puts a document boundary on CP 2's rank boundary.
PACKED = [0, 3, 10, 13, 24]
PACKED_ON_BOUNDARY = [0, 5, 6, 12, 15, 24]
KIMI_DOCS = [[1] * 5 + [2] * 9 + [3] * 7 + [0] * 3, [1] * 24]
VARIANTS = [
    {"dtype": "float32", "rows": 2, "seq": 24, "seed": 0},
    {"dtype": "bfloat16", "rows": 2, "seq": 24, "seed": 2},
    {"dtype": "float32", "rows": 1, "seq": 24, "seed": 4, "cu": PACKED},
    {"dtype": "float32", "rows": 1, "seq": 24, "seed": 6, "cu": PACKED_ON_BOUNDARY},
    {"dtype": "float32", "rows": 1, "seq": 24, "seed": 4, "cu": PACKED, "defect": "conv_halo_backward_not_sent"},
    {"dtype": "float32", "rows": 2, "seq": 24, "seed": 0, "defect": "conv_halo_backward_not_sent"},
    {"gloo_plain": True},
    # Kimi Linear's KDA short convolution (the framework's KimiPackedContext / build_fla_cp_context, fla's
    # ShortConvolution): two rows, the first with three documents and right padding, the second one document
    {"kimi": True, "dtype": "float32", "seed": 8, "doc_ids": KIMI_DOCS},
    {"kimi": True, "dtype": "bfloat16", "seed": 9, "doc_ids": KIMI_DOCS},
    {"kimi": True, "dtype": "float32", "seed": 8, "doc_ids": KIMI_DOCS, "defect": "conv_halo_backward_not_sent"},
]
JUDGED = VARIANTS[:4] + VARIANTS[7:9]
JUDGED_AT = [0, 1, 2, 3, 7, 8]
# the positions the defect corrupts: the last W - 1 tokens (as many as the document has there) before each rank
# boundary a document crosses
DEFECT_POSITIONS = {
    (2, 4): [10, 11], (3, 4): [5, 6, 7, 13, 14, 15],
    (2, 5): list(range(12 - (W - 1), 12)), (3, 5): [5, 6, 7, 13, 14, 15],
    (2, 9): [9, 10, 11], (3, 9): [5, 6, 7, 13, 14, 15],  # the union over both rows
}  # fmt: skip


@pytest.fixture(scope="module")
def conv_results(tmp_path_factory) -> dict[int, list[dict]]:
    """Every variant at CP 1, 2, 3 (all six ranks forked after one import)."""
    return _run((1, 2, 3), VARIANTS, tmp_path_factory.mktemp("fla_conv"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fla_conv_cp_matches_the_framework_one_device_conv(world, conv_results):
    for variant, result in zip(JUDGED, [conv_results[world][i] for i in JUDGED_AT]):
        assert all(v["ok"] for v in result["verdicts"].values()), (variant, result)
        assert result["dx_wrong_at"] == []
        # CP 1 exchanges nothing but still runs fla's CP function (its send / receive all-gather on one rank)
        assert result["standins"] == ["fla_conv_cpu", "fla_gloo_allgather"], result


@pytest.mark.parametrize("world", [2, 3])
def test_the_gate_fails_on_the_halo_backward_defect_naming_dx_and_the_forward_passes(world, conv_results):
    for index in (4, 5, 9):
        result = conv_results[world][index]
        failed = sorted(name for name, v in result["verdicts"].items() if not v["ok"])
        assert failed == ["dx"], result  # output (a forward-only run's judgment) and dweight pass
        assert result["dx_wrong_at"] == DEFECT_POSITIONS[(world, index)], result


def test_the_defect_changes_nothing_on_one_rank(conv_results):
    for index in (4, 5, 9):
        assert all(v["ok"] for v in conv_results[1][index]["verdicts"].values())


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_refuses_flas_stacked_all_gather_without_the_stand_in(world, conv_results):
    assert "ProcessGroupGloo::allgather: invalid tensor size" in conv_results[world][6]["gloo_plain"]
