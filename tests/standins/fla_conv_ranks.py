"""The ranks of the fla convolution-halo test (``test_fla_conv_cpu.py``): this process imports torch, fla and the
framework once, then forks every rank of every CP size in ``--worlds`` (gloo, one process group per size); it exits
non-zero (after ending the others) when a rank fails.

Per variant (dtype, rows, documents, seed): the framework's own ``CPAwareGatedDeltaNet`` (Qwen3.5-MoE's linear
attention, a tiny config) is built on every rank from the same seed. The one-device reference is the framework's
one-device convolution (``module.causal_conv1d_fn`` as ``_forward_no_cp`` calls it: on this CPU, transformers'
``F.conv1d`` fallback) on each document of each row on its own; the "other" run computes the documents in reverse
order (the spread). The CP run gives each rank its contiguous slice of ``mixed_qkv`` ``[B, D, S]`` and calls the
framework's ``_conv1d_with_cp`` with fla's ``build_cp_context`` built as ``_forward_with_cp`` builds it (one
sequence ``[0, S]`` for plain rows; the packed ``cu_seqlens`` for block-diagonal CP), under the stand-ins
``fla_conv_cpu`` and ``fla_gloo_allgather``; then backward with the same upstream gradient. Rank 0 judges the
output, ``d mixed_qkv`` (both gathered in rank order) and the conv weight's gradient (summed over the ranks) with the
harness's judge (``model_specs.judge_tensor``, ``C x spread + FLOOR``, the real-model check's bounds), and writes
the verdicts as JSON to ``<--out-dir>/<world>.json``. A variant with ``"defect"`` runs the CP step inside that
context manager of ``tests/fixtures/_gradient_only_defects.py``; ``"gloo_plain": true`` instead calls fla's
``all_gather_into_tensor`` without the gloo stand-in and records what gloo says; ``"kimi": true`` runs Kimi Linear's
KDA short convolution instead (``run_kimi``), with ``"doc_ids"`` ``[B, S]`` (0: padding).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
import sys

import forked_worlds  # the launcher beside this script (sys.path[0] when run as a script)
import torch
import torch.distributed as dist

from cp_harness import standins
from cp_harness.checks.real_model import FLOOR, C
from cp_harness.usage import model_specs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "fixtures"))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STANDINS = ("fla_conv_cpu", "fla_gloo_allgather")
# fmt: off
LINEAR = dict(layer_types=["linear_attention"], linear_num_key_heads=1, linear_key_head_dim=4,
              linear_num_value_heads=2, linear_value_head_dim=4, linear_conv_kernel_dim=4)
# fmt: on


def build_module(dtype: torch.dtype, seed: int):
    """The framework's ``CPAwareGatedDeltaNet`` for the spec's tiny text config with one linear-attention layer."""
    from nemo_automodel.components.models.qwen3_5_moe.cp_linear_attn import CPAwareGatedDeltaNet

    from examples.automodel.models import qwen3_5_moe

    text = qwen3_5_moe.config(dtype, num_hidden_layers=1, **LINEAR).text_config
    torch.manual_seed(seed)
    module = CPAwareGatedDeltaNet(text, layer_idx=0).to(dtype)
    if module.conv_kernel_size != LINEAR["linear_conv_kernel_dim"]:
        raise AssertionError(f"conv kernel {module.conv_kernel_size}")
    return module


def one_device(module, x: torch.Tensor, grad: torch.Tensor, cu: list[int], reverse: bool) -> dict[str, torch.Tensor]:
    """The framework's one-device convolution on each document ``[a, b)`` of each row on its own."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    spans = list(zip(cu[:-1], cu[1:]))
    outs: dict[tuple[int, int], torch.Tensor] = {}
    for a, b in reversed(spans) if reverse else spans:
        outs[(a, b)] = module.causal_conv1d_fn(
            x[:, :, a:b], weight=module.conv1d.weight.squeeze(1), bias=module.conv1d.bias, activation=module.activation
        )
    out = torch.cat([outs[s] for s in spans], dim=2)
    out.backward(grad)
    return {"out": out.detach(), "dx": x.grad.detach(), "dweight": module.conv1d.weight.grad.detach().clone()}


def cp_step(module, x, grad, cu: list[int], packed: bool, defect: str | None) -> tuple[dict, dict]:
    from fla.ops.cp import build_cp_context

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    local = x.shape[2] // world
    x_local = x[:, :, rank * local : (rank + 1) * local].detach().clone().requires_grad_()
    grad_local = grad[:, :, rank * local : (rank + 1) * local].contiguous()
    module.zero_grad(set_to_none=True)
    if packed:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        ctx = build_cp_context(cu_seqlens=cu_t, group=group, conv1d_kernel_size=module.conv_kernel_size,
                               cu_seqlens_cpu=cu_t)  # fmt: skip
    else:
        ctx = build_cp_context(cu_seqlens=torch.tensor([0, x.shape[2]], dtype=torch.long), group=group,
                               conv1d_kernel_size=module.conv_kernel_size)  # fmt: skip
    with standins.entered(STANDINS, "cpu") as record, _fault(defect):
        out_local = module._conv1d_with_cp(x_local, ctx)
        out_local.backward(grad_local)
        used = record.used()
    gathered = {"out": _gathered(out_local.detach(), 2), "dx": _gathered(x_local.grad.detach(), 2)}
    dweight = module.conv1d.weight.grad.detach().clone()
    dist.all_reduce(dweight)
    gathered["dweight"] = dweight
    return gathered, used


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _judge(cp: dict, ref: dict, other: dict, dtype: str, seq_dim: int) -> dict:
    """The verdicts of ``out``, ``dx``, ``dweight`` and the sequence positions whose ``dx`` exceeds the bound."""
    verdicts = {}
    for name in ("out", "dx", "dweight"):
        v = model_specs.judge_tensor(cp[name].float().numpy(), ref[name].float().numpy(),
                                     other[name].float().numpy(), dtype, C, FLOOR[dtype])  # fmt: skip
        verdicts[name] = {"ok": v["ok"], "error": v.get("error"), "bound": v.get("bound")}
    diff = (cp["dx"].double() - ref["dx"].double()).abs()
    diff = diff.amax(dim=tuple(d for d in range(diff.dim()) if d != seq_dim))
    tol = verdicts["dx"]["bound"] * float(ref["dx"].double().abs().max()) * model_specs.ulp_unit(dtype)
    return {"verdicts": verdicts, "dx_wrong_at": [int(i) for i in torch.nonzero(diff > tol).flatten()]}


def _fault(defect: str | None):
    if defect is None:
        return contextlib.nullcontext()
    import _gradient_only_defects

    return getattr(_gradient_only_defects, defect)()


def run_kimi(variant: dict) -> dict:
    """Kimi Linear's KDA short convolution as the framework's ``KimiDeltaAttention._kda_core`` calls it: fla's
    ``ShortConvolution`` (built as the framework builds ``q_conv1d``) on each row with ``cp_context=
    build_fla_cp_context(KimiPackedContext(doc_ids, seq_start, cp_size), row, group, conv_size)`` under CP, and
    with ``cu_seqlens = row_cu_seqlens(row)`` on one device (fla's conv there too: entered with ``fla_conv_cpu``,
    which that path needs on a CPU). ``x`` is ``[B, S, D]``."""
    from fla.modules import ShortConvolution
    from nemo_automodel.components.models.kimi_linear.cp import KimiPackedContext, build_fla_cp_context

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[variant["dtype"]]
    torch.manual_seed(variant["seed"])
    conv = ShortConvolution(hidden_size=16, kernel_size=4, activation="silu", dtype=dtype)
    gen = torch.Generator().manual_seed(variant["seed"] + 1)
    doc_ids = torch.tensor(variant["doc_ids"])
    rows, seq = doc_ids.shape
    x = torch.randn(rows, seq, 16, generator=gen).to(dtype)
    grad = torch.randn(rows, seq, 16, generator=gen).to(dtype)
    kwargs = dict(cache=None, output_final_state=False)

    def one_device(order):
        leaf = x.detach().clone().requires_grad_()
        conv.zero_grad(set_to_none=True)
        packed = KimiPackedContext(doc_ids=doc_ids)
        outs = {}
        with standins.entered(("fla_conv_cpu",), "cpu"):
            for row in order:
                cu, _ = packed.row_cu_seqlens(row)
                outs[row], _ = conv(x=leaf[row : row + 1], cu_seqlens=cu, **kwargs)
            out = torch.cat([outs[r] for r in range(rows)])
            out.backward(grad)
        return {"out": out.detach(), "dx": leaf.grad.detach(), "dweight": conv.weight.grad.detach().clone()}

    ref, other = one_device(range(rows)), one_device(reversed(range(rows)))
    local = seq // world
    leaf = x[:, rank * local : (rank + 1) * local].detach().clone().requires_grad_()
    conv.zero_grad(set_to_none=True)
    packed = KimiPackedContext(doc_ids=doc_ids, seq_start=rank * local, cp_size=world)
    with standins.entered(STANDINS, "cpu") as record, _fault(variant.get("defect")):
        outs = [conv(x=leaf[row : row + 1], cu_seqlens=None, cp_context=build_fla_cp_context(packed, row,
                dist.group.WORLD, conv.kernel_size[0]), **kwargs)[0] for row in range(rows)]  # fmt: skip
        out = torch.cat(outs)
        out.backward(grad[:, rank * local : (rank + 1) * local].contiguous())
        used = record.used()
    dweight = conv.weight.grad.detach().clone()
    dist.all_reduce(dweight)
    cp = {"out": _gathered(out.detach(), 1), "dx": _gathered(leaf.grad.detach(), 1), "dweight": dweight}
    return {"world": world, "standins": sorted(used), **_judge(cp, ref, other, variant["dtype"], seq_dim=1)}


def run_variant(variant: dict) -> dict:
    world = dist.get_world_size()
    if variant.get("kimi"):
        return run_kimi(variant)
    if variant.get("gloo_plain"):
        from fla.ops.cp import all_gather_into_tensor

        try:
            out, _ = all_gather_into_tensor(torch.full((3, 2), float(dist.get_rank())), group=dist.group.WORLD)
            return {"gloo_plain": "ran", "slots": [float(v) for v in out[:, 0, 0]]}
        except RuntimeError as e:
            return {"gloo_plain": str(e)}
    dtype = DTYPES[variant["dtype"]]
    module = build_module(dtype, variant["seed"])
    gen = torch.Generator().manual_seed(variant["seed"] + 1)
    rows, seq = variant["rows"], variant["seq"]
    dim = module.conv1d.weight.shape[0]
    x = torch.randn(rows, dim, seq, generator=gen).to(dtype)
    grad = torch.randn(rows, dim, seq, generator=gen).to(dtype)
    cu = variant.get("cu") or [0, seq]
    ref = one_device(module, x, grad, cu, reverse=False)
    other = one_device(module, x, grad, cu, reverse=True)
    cp, used = cp_step(module, x, grad, cu, packed=variant.get("cu") is not None, defect=variant.get("defect"))
    # dx_wrong_at: the positions whose dx differs beyond the bound (which rank boundary a defect hits)
    return {"world": world, "standins": sorted(used), **_judge(cp, ref, other, variant["dtype"], seq_dim=2)}


def rank_main(variants: list[dict], out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = []
    for v in variants:
        try:
            results.append(run_variant(v))
        except Exception:
            if dist.get_rank() == 0:
                print(f"variant {v}:", file=sys.stderr)
            raise
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _import_once() -> None:
    """What every rank needs, imported once before the fork (fla's import is most of the time)."""
    import fla.modules.convolution  # noqa: F401
    import fla.ops.cp  # noqa: F401
    from nemo_automodel.components.models.qwen3_5_moe import cp_linear_attn  # noqa: F401

    from examples.automodel.models import qwen3_5_moe  # noqa: F401


if __name__ == "__main__":
    sys.exit(forked_worlds.main(rank_main, _import_once))
