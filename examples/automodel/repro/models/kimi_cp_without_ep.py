"""Kimi Linear CP needs ep_size > 1: without EP nothing hands the CP mesh to the MLA layers (nemo-automodel 0.7.0).

No harness: torch, the framework, two gloo ranks this script forks. ``KimiMLAAttention._cp_mesh`` is set only by
``setup_cp_attention``, which only the MoE parallelizer's ``apply_cp`` calls, and ``_parallelize_moe`` runs only at
``ep_size > 1`` (``distributed/model_parallelizer.py``). At ``ep_size == 1`` the infrastructure's dense CP pass
(``_transformers/infrastructure.py``, ``mesh.ep_size <= 1 and mesh.cp_size > 1``) only calls
``attach_context_parallel_hooks`` for a non-TE model. This script does exactly that, then the recipe's
``ContextParallelSharder(model, mesh, batch).shard(batch)`` and the forward (read in the code, run here: the
infrastructure itself is not run).

    PYTHONPATH=. python examples/automodel/repro/models/kimi_cp_without_ep.py     # exit 1 while it raises
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.distributed.context_parallel.utils import attach_context_parallel_hooks  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from examples.automodel.repro.models.kimi_thd_one_device import build  # noqa: E402


def rank_main(rank, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    model = build()
    attach_context_parallel_hooks(model)  # the ep_size <= 1 CP pass for non-TE attention
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    try:
        with torch.no_grad():
            _, local = ContextParallelSharder(model, mesh, batch).shard(batch)
            model(**{k: v for k, v in local.items() if k != "labels"})
        out.put((rank, "no error"))
    except Exception as exc:  # noqa: BLE001 - the finding
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def main():
    store = tempfile.mktemp()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, text in results:
        print(f"rank {rank}: {text}")
    return 1 if any(text != "no error" for _, text in results) else 0


if __name__ == "__main__":
    sys.exit(main())
