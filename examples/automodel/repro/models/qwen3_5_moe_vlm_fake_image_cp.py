"""Qwen3.5-MoE VLM (nemo-automodel 0.7.0), round-robin CP (``shard_batch_aux_only``): the fake image the framework's
VLM datasets inject into a text-only sample (``inject_fake_images``, on by default: FSDP needs the vision tower to
run on every rank) is masked out with ``attention_mask = 0`` on its placeholders (``mask_fake_vision_tokens_batch``:
"invisible to attention"); under CP the mask is dropped (``shard_batch_aux_only`` pops ``attention_mask``, the text
model sets ``attention_mask = padding_mask = None`` under CP), so the sample's text attends to the fake image and
its MoE routers count it: CP > 1 trains text-only samples on another input than CP 1 (finding M9,
docs/models/qwen3_5_moe_vlm.md). No harness: two gloo ranks this script forks, the framework's ``apply_cp``,
``ContextParallelSharder`` and forward, torch's ring SDPA with the harness's CPU kernel for its per-step op
(``ring_sdpa_cpu``: the ring has no CPU handler; nothing else of it is replaced).

One row of 16 tokens (a multiple of 2 x CP: no divisibility padding, so finding M8 stays out) laid out as the
framework's data path lays out a text-only sample: the fake image first (2 x 2 placeholders, constant pixels), the
text after, ``attention_mask`` 0 on the placeholders, the loader's mRoPE positions (``get_rope_index``) in the batch.
Printed: the largest logit difference over the text positions, CP against one device, with the fake image masked and,
as a control, with the same row unmasked (the image a real one): equal. Exit 1 while the masked row differs, 0 when
it matches, 2 when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_vlm_fake_image_cp.py
"""

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD, LENGTH, PORT = 2, 16, "29563"


def _logits(spec, model, mesh, batch: dict) -> torch.Tensor:
    """The forward as the recipe runs it (the spec's shard: ``apply_cp``, ``ContextParallelSharder``), logits
    ``[1, S, V]`` in global order (gathered over the CP ranks with the sharder's index map)."""
    ctx, local, sharder = spec.shard(model, mesh, batch)
    with ctx(), torch.no_grad():
        logits = spec.forward(model, local)
    return spec.gather_logits(sharder, logits)


def _rank(rank: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    from cp_harness import standins
    from examples.automodel.models import qwen3_5_moe_vlm_mrope  # the tiny config, the loader's positions

    spec: Any = qwen3_5_moe_vlm_mrope  # its make_batch takes images= and fake_images= (the VLM spec's own)

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    masked = spec.make_batch("images", LENGTH, seed=3, images=[[]], fake_images=True)
    unmasked = {**masked, "attention_mask": torch.ones_like(masked["attention_mask"])}
    text = masked["attention_mask"][0].bool()
    model = spec.build(torch.float32, 0)
    for name, batch in (("masked", masked), ("unmasked", unmasked)):
        one_device = _logits(spec, model, None, batch) if rank == 0 else None
        with standins.entered(("ring_sdpa_cpu",), "cpu"):
            cp = _logits(spec, model, mesh, batch)
        if one_device is not None:  # rank 0
            results[name] = ((cp - one_device)[0, text].abs().max().item(), one_device[0, text].abs().max().item())
    dist.destroy_process_group()


def main() -> int:
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, args=(shared,), nprocs=WORLD)
        results = dict(shared)
    print(
        f"one text-only row of {LENGTH} tokens with the framework's fake image (2 x 2 placeholders first), CP {WORLD}"
    )
    for name, (diff, largest) in results.items():
        print(f"fake image {name}: text logits max |CP - one device| {diff:.3g} (largest {largest:.3g})")
    if results["unmasked"][0] > 1e-5 * results["unmasked"][1]:
        print("could not run: the control (the image unmasked on both sides) differs")
        return 2
    if results["masked"][0] > 1e-5 * results["masked"][1]:
        print("DEFECT: under CP the text of a text-only sample attends to the fake image its attention_mask hides")
        return 1
    print("the masked fake image is invisible under CP too")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
