"""The stand-in ``mamba_kernels_cpu`` (one process, float64 unless said): mamba_ssm's / causal_conv1d's kernel
entry points, routed to the packages' torch references, against computations written out here (a causal
depthwise convolution by ``F.conv1d``, the Mamba2 recurrence as a loop over time, a per-group gated RMSNorm):
outputs and gradients. Also: the one-device call (RMSNorm and output projection fused) equals the CP mixer's
decomposition (scan with the gate, then ``rmsnorm_fn`` per group, then the projection), which the package's own
``mamba_split_conv1d_scan_ref`` alone does not give (it normalizes over the whole width); the mixer's head split
(``MambaContextParallel``'s slices) is exact; what the references do not take is refused; the stand-in is off
outside its context (the packages are not importable then: their CUDA extensions are not built), is not entered on
another device, refuses to enter twice; a CUDA extension reached raises. Skipped without the CPU install of
``constraints/mamba.txt``. Bound: 64 float32 ULP of the largest magnitude: the references compute in float32
whatever the input dtype (``selective_scan_ref``, ``rms_norm_ref``, ``ssd_chunk_scan_combined_ref`` upcast to
``float``), so a float64 input is float32-accurate there; ``causal_conv1d_ref`` keeps float64 (1e-12)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is None or importlib.util.find_spec("causal_conv1d") is None,
    reason="needs mamba-ssm and causal-conv1d (constraints/mamba.txt, installed by scripts/bootstrap.sh)",
)

from cp_harness import standins  # noqa: E402
from cp_harness.standins import mamba_kernels_cpu  # noqa: E402

D64 = torch.float64
HEADS, HEADDIM, GROUPS, STATE, WIDTH = 4, 3, 2, 5, 4


def _kernels():
    ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    norm = importlib.import_module("mamba_ssm.ops.triton.layernorm_gated")
    conv = importlib.import_module("causal_conv1d")
    return ssd, norm, conv


def _conv(x, weight, bias):
    """Causal depthwise convolution with SiLU, written out: ``x`` [B, S, C], ``weight`` [C, W]."""
    width = weight.shape[1]
    out = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out).transpose(1, 2)


def _recurrence(x, dt, A, B, C, D):
    """The Mamba2 SSM as a loop over time: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D
    x_t``; ``x`` [B, S, H, P], ``dt`` [B, S, H] (after softplus), ``B``/``C`` [B, S, G, N], ``A``/``D`` [H]."""
    batch, seq, heads, headdim = x.shape
    per = heads // B.shape[2]
    B, C = B.repeat_interleave(per, dim=2), C.repeat_interleave(per, dim=2)
    h = x.new_zeros(batch, heads, headdim, B.shape[-1])
    ys = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1) + D[None, :, None] * x[:, t])
    return torch.stack(ys, dim=1)


def _gated_rmsnorm(x, weight, z, eps, group_size):
    """RMSNorm(x * silu(z)) per group of ``group_size`` channels, times ``weight``."""
    y = x * F.silu(z)
    g = y.unflatten(-1, (-1, group_size))
    return (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight


def _inputs(seq=11, batch=2, seed=0, dtype=D64):
    generator = torch.Generator().manual_seed(seed)
    dim = HEADS * HEADDIM
    conv_dim = dim + 2 * GROUPS * STATE

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=D64) * scale).to(dtype).requires_grad_()

    return {
        "zxbcdt": draw(batch, seq, dim + conv_dim + HEADS),
        "conv1d_weight": draw(conv_dim, WIDTH, scale=0.5),
        "conv1d_bias": draw(conv_dim, scale=0.1),
        "dt_bias": draw(HEADS, scale=0.5),
        "A": (-torch.rand(HEADS, generator=generator, dtype=D64) - 0.5).to(dtype).requires_grad_(),
        "D": draw(HEADS),
        "rmsnorm_weight": draw(dim),
        "outproj_weight": draw(7, dim, scale=0.3),
    }


def _independent(t, eps=1e-5):
    """The fused kernel's function (one-device mixer), from the pieces written out above."""
    dim = HEADS * HEADDIM
    z, xbc, dt = torch.split(t["zxbcdt"], [dim, dim + 2 * GROUPS * STATE, HEADS], dim=-1)
    xbc = _conv(xbc, t["conv1d_weight"], t["conv1d_bias"])
    x, B, C = torch.split(xbc, [dim, GROUPS * STATE, GROUPS * STATE], dim=-1)
    batch, seq = x.shape[:2]
    y = _recurrence(
        x.unflatten(-1, (HEADS, HEADDIM)),
        F.softplus(dt + t["dt_bias"]),
        t["A"],
        B.unflatten(-1, (GROUPS, STATE)),
        C.unflatten(-1, (GROUPS, STATE)),
        t["D"],
    ).reshape(batch, seq, dim)
    return F.linear(_gated_rmsnorm(y, t["rmsnorm_weight"], z, eps, dim // GROUPS), t["outproj_weight"])


def _fused(ssd, t, eps=1e-5, **overrides):
    keywords = dict(
        chunk_size=4, activation="silu", rmsnorm_weight=t["rmsnorm_weight"], rmsnorm_eps=eps,
        outproj_weight=t["outproj_weight"], outproj_bias=None, headdim=HEADDIM, ngroups=GROUPS,
        norm_before_gate=False,
    )  # fmt: skip
    keywords.update(overrides)
    return ssd.mamba_split_conv1d_scan_combined(
        t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], **keywords
    )


def _grads(out, tensors, seed=1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), list(tensors.values()))


F32 = 64 * 2.0**-23  # the references compute in float32 whatever the input (selective_scan_ref's .float(), ...)


def _close(actual, expected, tol=F32):
    """Within ``tol`` of the largest expected magnitude (at least 1): 64 float32 ULP by default."""
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=tol * max(1.0, float(e.detach().abs().max())))


def test_fused_kernel_matches_the_written_out_mixer_with_gradients():
    with mamba_kernels_cpu.install():
        ssd, _, _ = _kernels()
        t = _inputs()
        before = mamba_kernels_cpu._STATE["calls"]
        out = _fused(ssd, t)
        assert mamba_kernels_cpu._STATE["calls"] > before
        expected = _independent(t)
        _close([out], [expected])
        _close(_grads(out, t), _grads(expected, t))


def test_the_package_reference_alone_normalizes_over_the_whole_width():
    """The finding the stand-in corrects: ``mamba_split_conv1d_scan_ref`` calls ``rmsnorm_fn`` without a group
    size; the fused kernel normalizes per group (``dim // ngroups``)."""
    with mamba_kernels_cpu.install():
        ssd, norm, _ = _kernels()
        t = _inputs()
        routed = ssd.rmsnorm_fn
        ssd.rmsnorm_fn = norm.rms_norm_ref  # the reference as shipped (its rmsnorm_fn as a torch function)
        try:
            raw = ssd.mamba_split_conv1d_scan_ref(
                t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], 4,
                rmsnorm_weight=t["rmsnorm_weight"], rmsnorm_eps=1e-5, outproj_weight=t["outproj_weight"],
                headdim=HEADDIM, ngroups=GROUPS, norm_before_gate=False,
            )  # fmt: skip
        finally:
            ssd.rmsnorm_fn = routed
        assert (raw - _independent(t)).abs().max() > 1e-3


def test_one_device_call_equals_the_cp_mixers_decomposition_and_head_slices():
    """The one-device mixer's fused call against what the CP mixer computes: the scan with the gate on each
    rank's heads and groups (``MambaContextParallel``'s slices of conv, ``dt_bias``, ``A``, ``D``), the heads
    put back together, ``rmsnorm_fn`` per group, the projection."""
    ranks, eps = 2, 1e-5
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * STATE
    with mamba_kernels_cpu.install():
        ssd, norm, _ = _kernels()
        t = _inputs()
        whole = _fused(ssd, t, eps)
        z, xbc, dt = torch.split(t["zxbcdt"], [dim, conv_dim, HEADS], dim=-1)
        x, B, C = torch.split(xbc, [dim, GROUPS * STATE, GROUPS * STATE], dim=-1)
        cw = torch.split(t["conv1d_weight"], [dim, GROUPS * STATE, GROUPS * STATE], dim=0)
        cb = torch.split(t["conv1d_bias"], [dim, GROUPS * STATE, GROUPS * STATE], dim=0)
        h, g, parts = HEADS // ranks, GROUPS // ranks, []
        for r in range(ranks):
            hs, gs = slice(r * h * HEADDIM, (r + 1) * h * HEADDIM), slice(r * g * STATE, (r + 1) * g * STATE)
            local = torch.cat([z[..., hs], x[..., hs], B[..., gs], C[..., gs], dt[..., r * h : (r + 1) * h]], -1)
            parts.append(
                ssd.mamba_split_conv1d_scan_combined(
                    local, torch.cat([cw[0][hs], cw[1][gs], cw[2][gs]]), torch.cat([cb[0][hs], cb[1][gs], cb[2][gs]]),
                    t["dt_bias"][r * h : (r + 1) * h], t["A"][r * h : (r + 1) * h], t["D"][r * h : (r + 1) * h],
                    chunk_size=4, activation="silu", rmsnorm_weight=None, outproj_weight=None, headdim=HEADDIM,
                    ngroups=g, norm_before_gate=False,
                )  # fmt: skip
            )
        normed = norm.rmsnorm_fn(
            torch.cat(parts, -1), t["rmsnorm_weight"], None, z=None, eps=eps, group_size=dim // GROUPS,
            norm_before_gate=False,
        )  # fmt: skip
        split = F.linear(normed, t["outproj_weight"])
        _close([split], [whole])
        _close(_grads(split, t), _grads(whole, t))


def test_seq_idx_restarts_the_sequence():
    """``seq_idx`` (what the mixer passes for a one-row batch with an attention mask): each run of equal ids is
    computed as a sequence of its own (the kernel's contract); here row 0 has two sequences, row 1 one."""
    with mamba_kernels_cpu.install():
        ssd, _, _ = _kernels()
        t = _inputs(seq=9)
        seq_idx = torch.tensor([[0] * 5 + [1] * 4, [0] * 9], dtype=torch.int32)
        got = _fused(ssd, t, seq_idx=seq_idx)
        whole = _independent(t)
        first = {**t, "zxbcdt": t["zxbcdt"][:1, :5]}
        second = {**t, "zxbcdt": t["zxbcdt"][:1, 5:]}
        expected = torch.cat([torch.cat([_independent(first), _independent(second)], dim=1), whole[1:]])
        _close([got], [expected])
        assert (got[0, 5:] - whole[0, 5:]).abs().max() > 1e-3  # the second sequence does not see the first


def test_gated_rmsnorm_and_causal_conv_match_written_out_forms():
    generator = torch.Generator().manual_seed(3)
    x, z = torch.randn(2, 5, 12, dtype=D64, generator=generator), torch.randn(2, 5, 12, dtype=D64, generator=generator)
    weight = torch.randn(12, dtype=D64, generator=generator)
    conv_x = torch.randn(2, 6, 9, dtype=D64, generator=generator)  # [B, C, S]
    conv_w, conv_b = torch.randn(6, WIDTH, dtype=D64, generator=generator), torch.randn(6, dtype=D64, generator=generator)
    with mamba_kernels_cpu.install():
        _, norm, conv = _kernels()
        got = norm.rmsnorm_fn(x, weight, None, z=z, eps=1e-6, group_size=4, norm_before_gate=False)
        _close([got], [_gated_rmsnorm(x, weight, z, 1e-6, 4)])
        out = conv.causal_conv1d_fn(conv_x, conv_w, conv_b, activation="silu")
        _close([out], [_conv(conv_x.transpose(1, 2), conv_w, conv_b).transpose(1, 2)], tol=1e-12)  # float64 here


def test_chunk_scan_matches_the_recurrence():
    generator = torch.Generator().manual_seed(4)
    b, s = 2, 12  # the chunked reference takes whole chunks only
    x = torch.randn(b, s, HEADS, HEADDIM, dtype=D64, generator=generator)
    dt = F.softplus(torch.randn(b, s, HEADS, dtype=D64, generator=generator))
    A = -torch.rand(HEADS, dtype=D64, generator=generator) - 0.5
    B, C = (torch.randn(b, s, GROUPS, STATE, dtype=D64, generator=generator) for _ in range(2))
    D = torch.randn(HEADS, dtype=D64, generator=generator)
    with mamba_kernels_cpu.install():
        ssd, _, _ = _kernels()
        got = ssd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=4, D=D)
        _close([got], [_recurrence(x, dt, A, B, C, D)])
        with pytest.raises(NotImplementedError, match="return_final_states"):
            ssd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=4, D=D, return_final_states=True)


def test_what_the_references_do_not_take_is_refused():
    with mamba_kernels_cpu.install():
        ssd, _, conv = _kernels()
        t = _inputs(seq=6)
        with pytest.raises(NotImplementedError, match="return_final_states"):
            _fused(ssd, t, return_final_states=True)
        with pytest.raises(NotImplementedError, match="initial_states"):
            conv.causal_conv1d_fn(torch.zeros(1, 2, 3), torch.zeros(2, 2), initial_states=torch.zeros(1, 2, 1))
        with pytest.raises(mamba_kernels_cpu.MissingExtension, match="causal_conv1d_cuda"):
            sys.modules["causal_conv1d_cuda"].causal_conv1d_fwd  # noqa: B018 - the attribute access raises


def test_off_outside_its_context_and_entered_once_on_cpu_only():
    assert not mamba_kernels_cpu.installed()
    # Outside it the packages are the CPU install's: not importable (their CUDA extensions are not built), unless a
    # package that tolerates that (fla imports parts of mamba_ssm at its own import) loaded them already; either way
    # no stand-in is in them.
    before = {name for name in sys.modules if name.startswith(("mamba_ssm", "causal_conv1d"))}
    try:
        outside = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ModuleNotFoundError as exc:
        assert "selective_scan_cuda" in str(exc) or "mamba_ssm" in str(exc), exc
    else:
        assert before and not getattr(outside.mamba_split_conv1d_scan_combined, "_cp_harness_standin", False)
    before = {name for name in sys.modules if name.startswith(("mamba_ssm", "causal_conv1d"))}
    with pytest.raises(RuntimeError, match="boom"), mamba_kernels_cpu.install():
        assert getattr(_kernels()[0].mamba_split_conv1d_scan_combined, "_cp_harness_standin", False)
        with pytest.raises(RuntimeError, match="entered twice"), mamba_kernels_cpu.install():
            pass
        raise RuntimeError("boom")
    assert not mamba_kernels_cpu.installed()
    assert {name for name in sys.modules if name.startswith(("mamba_ssm", "causal_conv1d"))} == before
    with mamba_kernels_cpu.install():  # the modules of the first entry, back
        assert getattr(_kernels()[0].mamba_split_conv1d_scan_combined, "_cp_harness_standin", False)
    with standins.entered(["mamba_kernels_cpu"], "cuda") as record:
        assert record.descriptions == {} and not mamba_kernels_cpu.installed()
    with standins.entered(["ring_sdpa_cpu", "mamba_kernels_cpu"], "cpu", reference=True) as record:
        assert list(record.descriptions) == ["mamba_kernels_cpu"]  # the one-device runs: this one only
    # restoring puts the packages' own functions back (the Triton ones), not the stand-in's
    with mamba_kernels_cpu.install():
        ssd = _kernels()[0]
    assert not getattr(ssd.mamba_split_conv1d_scan_combined, "_cp_harness_standin", False)
    assert ssd.mamba_split_conv1d_scan_combined.__module__ == "mamba_ssm.ops.triton.ssd_combined"
