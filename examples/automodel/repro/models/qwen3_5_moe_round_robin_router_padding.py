"""Qwen3.5-MoE (nemo-automodel 0.7.0), round-robin CP (``shard_batch_aux_only``, the path of every unpacked batch,
text or images): the MoE routers' load-balancing loss counts the CP divisibility padding, one device's does not
(finding M8, docs/models/qwen3_5_moe_vlm.md). No harness: two gloo ranks this script forks, the framework's
``apply_cp``, ``ContextParallelSharder`` and forward, torch's ring SDPA with the harness's CPU kernel for its
per-step op (``ring_sdpa_cpu``: the ring has no CPU handler; nothing else of it is replaced).

A row of 13 tokens at CP 2 is padded to 16 (a multiple of 2 x CP) inside the forward
(``shard_sequence_for_cp_round_robin``: zero embeddings); causal attention keeps the 3 padded positions out of every
real token's result, so logits and loss match one device. But ``Qwen3_5MoeTextModelBackend.forward`` sets
``padding_mask = None`` under CP ("TE ring-attention and FLA CP do not support padding masks"), so every MoE layer
routes the padded positions as tokens and its ``Gate`` adds them to the expert-load statistics of the auxiliary
loss (``router_aux_loss_coef``, 0.001 by default): the routers' gradients differ from one device's.

Printed: the largest difference of each router gradient (CP summed over ranks vs one device) with the default
coefficient and, as a control, with 0 (equal: only the auxiliary loss differs). Exit 1 while they differ.
``--fixed``: every MoE layer gets the sharded ``padding_mask`` (True on the divisibility padding; the sharder pads
it so when the batch has one) instead of ``None``: the gradients match (exit 0). Exit 2 when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_round_robin_router_padding.py [--fixed]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD, LENGTH, PORT = 2, 13, "29561"
ROUTERS = ("model.language_model.layers.0.mlp.gate.weight", "model.language_model.layers.1.mlp.gate.weight")


def _router_grads(spec, model, mesh, batch: dict, fixed: bool) -> dict[str, torch.Tensor]:
    """One step (the spec's shard/forward, the framework's MaskedCrossEntropy over the global label count); the
    routers' gradients, summed over the CP ranks."""
    from nemo_automodel.components.moe.layers import MoE

    model.zero_grad(set_to_none=True)
    count = int((batch["labels"] != -100).sum())
    ctx, local, _ = spec.shard(model, mesh, batch)
    original = MoE.forward
    if fixed and mesh is not None:

        def forward(self, x, padding_mask=None, *args, **kwargs):  # the sharded mask instead of None
            return original(self, x, local["padding_mask"] if padding_mask is None else padding_mask, *args, **kwargs)

        MoE.forward = forward
    try:
        with ctx():
            logits = spec.forward(model, local)
            spec.loss(logits, local["labels"], count).backward()
    finally:
        MoE.forward = original
    out = {}
    for name, parameter in model.named_parameters():
        if name in ROUTERS:
            grad = parameter.grad.detach().clone()
            if mesh is not None:
                dist.all_reduce(grad)
            out[name] = grad
    return out


def _rank(rank: int, fixed: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    from cp_harness import standins
    from examples.automodel.models import qwen3_5_moe_vlm as spec  # the tiny config and the recipe's step

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    tokens = torch.randint(1, spec.TEXT_VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    # A text row as the default collater gives it; padding_mask (all real) so that the sharder pads it with True.
    batch = {"input_ids": tokens, "labels": labels, "padding_mask": torch.zeros_like(tokens, dtype=torch.bool)}
    for coef in (0.001, 0.0):
        model = spec.build(torch.float32, 0, router_aux_loss_coef=coef)
        one_device = _router_grads(spec, model, None, batch, fixed) if rank == 0 else None
        with standins.entered(("ring_sdpa_cpu",), "cpu"):
            cp = _router_grads(spec, model, mesh, batch, fixed)
        if one_device is not None:  # rank 0
            results[str(coef)] = {
                name: ((cp[name] - one_device[name]).abs().max().item(), one_device[name].abs().max().item())
                for name in ROUTERS
            }
    dist.destroy_process_group()


def main(fixed: bool) -> int:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(fixed, results), nprocs=WORLD)
        measured = dict(results)
    print(f"one row of {LENGTH} tokens at CP {WORLD} (padded to {LENGTH + (-LENGTH) % (2 * WORLD)}), text only")
    differ = False
    for coef, rows in measured.items():
        for name, (diff, largest) in rows.items():
            bad = diff > 1e-6 * largest
            differ |= bad and coef != "0.0"
            print(f"router_aux_loss_coef {coef}: {name}: max |CP - one device| {diff:.3g} (largest {largest:.3g})")
        if coef == "0.0" and any(d > 1e-6 * m for d, m in rows.values()):
            print("could not run: the control (no auxiliary loss) differs")
            return 2
    if differ:
        print("DEFECT: under round-robin CP the routers' load-balancing loss counts the divisibility padding")
        return 1
    print("the routers' gradients match one device")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
