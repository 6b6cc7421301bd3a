"""Check a model spec's ``COVERS``: every framework CP callable it names is really executed by its CP path.

    PYTHONPATH=. python examples/automodel/tools/covers_check.py --model examples.automodel.models.glm5_next
    PYTHONPATH=. python examples/automodel/tools/covers_check.py --model examples.automodel.models.qwen3_5_moe \
        --step training [--loss linear_ce]

Forks ``max(--cp)`` gloo ranks (no harness). Each rank builds the spec's model, replaces every reference to each
``COVERS`` callable (in every loaded module, and on its class for methods) by a counting wrapper, runs one
training step the spec's way (``spec.shard``, forward in ``ctx_factory()``, local loss over the global label
count, backward, the logits gathered) per batch and CP size, and restores the originals. Rank 0 prints, per callable, the calls per
CP size summed over ranks (forward and backward of the step), and how many of them had a ``DeviceMesh`` or
process-group argument. Exit status 1 when a declared callable was never called under CP.

``--step training``: the training-step driver's ``COVERS`` (``examples/automodel/training/covers.py``) instead,
counted over 4 ranks as ``dp_shard x cp = 2 x 2``: the framework's mesh and parallelizer built, then one step of
``train_ft_step.STEP.run`` per batch of ``TRAINING_BATCHES`` (two rows: one per dp rank), the spec's stand-ins entered.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import tempfile
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

BATCHES = [
    ("plain", 19, {"seed": 1}),
    ("right_padded", 17, {"pad": 4, "batch_size": 2, "seed": 2}),
    ("packed", 21, {"documents": [[1, 9, 6, 5]], "seed": 3}),
    ("packed", 21, {"documents": [[21]], "seed": 4}),
    # a VLM's images: a 2 x 3 image across the shard boundaries of CP 2 and 3, a 1 x 2 one later (not a multiple of
    # 2 x CP at CP 3: the round-robin padding)
    ("images", 17, {"images": [[[2, 2, 3], [11, 1, 2]]], "seed": 5}),
]


TRAINING_BATCHES = [
    ("packed", 19, {"documents": [[7, 5, 6], [3, 1, 9]], "batch_size": 2, "seed": 1}),
    ("right_padded", 13, {"pad": 4, "batch_size": 2, "seed": 4}),
    ("plain", 11, {"batch_size": 2, "seed": 5}),
    # a VLM's images, one row per dp rank (dp rank 0: a 2 x 3 image across CP 2's shard boundary, a 1 x 2 one; dp
    # rank 1: a 2 x 2 one), then dp rank 1's row text only with the framework's masked fake image
    ("images", 16, {"images": [[[2, 2, 3], [10, 1, 2]], [[4, 2, 2]]], "batch_size": 2, "seed": 3}),
    ("images", 16, {"images": [[[2, 2, 3], [10, 1, 2]], []], "fake_images": True, "batch_size": 2, "seed": 3}),
]


def _resolve(path: str):
    """``(owner, attribute, original)`` for a dotted path naming a module function or a class attribute."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(path)


class Counting:
    """Count calls of the ``COVERS`` callables while installed; every replaced reference is restored on exit."""

    def __init__(self, paths):
        self.paths = list(paths)
        self.calls = collections.Counter()
        self.with_group = collections.Counter()
        self._undo = []

    def _wrapper(self, path, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.calls[path] += 1
            if any(isinstance(a, (DeviceMesh, dist.ProcessGroup)) for a in (*args, *kwargs.values())):
                self.with_group[path] += 1
            return original(*args, **kwargs)

        return wrapper

    def __enter__(self):
        for path in self.paths:
            owner, name, original = _resolve(path)
            raw = owner.__dict__.get(name, original) if isinstance(owner, type) else original
            wrapped = self._wrapper(path, original if not isinstance(raw, staticmethod) else raw.__func__)
            if isinstance(owner, type):
                self._undo.append((owner, name, raw))
                setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
                continue
            for module_name, module in list(sys.modules.items()):  # `from x import f` copies the reference
                if module_name.startswith("nemo_automodel") and vars(module).get(name) is original:
                    self._undo.append((module, name, original))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _dtype(spec) -> torch.dtype:
    """float32 where the spec runs it, else the first of its ``DTYPES`` (glm_moe_dsa: bfloat16 only)."""
    dtypes = tuple(getattr(spec, "DTYPES", (torch.float32,)))
    return torch.float32 if torch.float32 in dtypes else dtypes[0]


def _standins(spec):
    """The spec's ``STANDINS`` that run on this rank's device, around the CP step and the one-device runs alike
    (as the harness enters a ``reference_too`` stand-in; a stand-in of another device is left out)."""
    from cp_harness.standins import entered

    return entered(tuple(getattr(spec, "STANDINS", ())), "cuda" if torch.cuda.is_available() else "cpu")


def _rank(rank, world, store, sizes, spec_name, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    meshes = {}
    for n in sizes:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))
        if rank < n:
            meshes[n] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    spec = importlib.import_module(spec_name)
    model = spec.build(_dtype(spec), 0)
    report = {}
    for n in sizes:
        counting = Counting(spec.COVERS)
        if rank < n:
            with counting, _standins(spec):
                for kind, seq_len, keys in BATCHES:
                    if kind not in getattr(spec, "BATCH_KINDS", (kind,)):
                        continue
                    batch = spec.make_batch(kind, seq_len, **keys)
                    model.zero_grad(set_to_none=True)
                    count = spec.num_label_tokens(batch)
                    ctx_factory, local, sharder = spec.shard(model, meshes[n], batch)
                    with ctx_factory():
                        logits = spec.forward(model, local)
                        spec.loss(logits, spec.local_labels(local), count).backward()
                    spec.gather_logits(sharder, logits.detach())  # as the harness's step: the logits to global order
        report[n] = (dict(counting.calls), dict(counting.with_group))
        dist.barrier()
    queue.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _training_rank(rank, world, store, sizes, spec_name, queue, loss="masked"):
    """One rank of ``--step training``: the mesh and FSDP2 model built and one step per batch run, all counted."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from examples.automodel.training import covers, train_ft_step

    spec = importlib.import_module(spec_name)
    counting = Counting(covers.covers(loss, spec_name.rsplit(".", 1)[-1]))
    overrides = getattr(spec, "MTP_OVERRIDES", {}) if loss == "mtp" else {}
    with counting, _standins(spec):
        context = train_ft_step.mesh_context(world // 2, 2)
        model = train_ft_step.parallelized(spec, torch.float32, 0, context, **overrides)
        for kind, seq_len, keys in TRAINING_BATCHES:
            if kind in getattr(spec, "BATCH_KINDS", (kind,)):
                batch = spec.make_batch(kind, seq_len, **keys)
                train_ft_step.STEP.run(spec, model, context, batch, 1, loss=loss)
    queue.put((rank, {world: (dict(counting.calls), dict(counting.with_group))}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--cp", default="2,3")
    parser.add_argument("--step", choices=("forward-backward", "training"), default="forward-backward")
    parser.add_argument("--loss", choices=("masked", "linear_ce", "mtp"), default="masked", help="with --step training")
    args = parser.parse_args()
    spec = importlib.import_module(args.model)
    target: Callable[..., None]
    if args.step == "training":
        from examples.automodel.training import covers

        sizes, target, declared = [4], _training_rank, covers.covers(args.loss, args.model.rsplit(".", 1)[-1])
        extra: tuple = (args.loss,)
    else:
        sizes, target, declared = sorted({int(n) for n in args.cp.split(",")}), _rank, spec.COVERS
        extra = ()
    world = max(sizes)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=target, args=(r, world, os.path.join(tmp, "store"), sizes, args.model, queue, *extra))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        reports = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    missing = []
    print(f"{args.model}: COVERS calls per CP size (all ranks, forward + backward); '/m' = with a mesh or group arg")
    for path, what in declared.items():
        row = []
        for n in sizes:
            calls = sum(r[1][n][0].get(path, 0) for r in reports)
            grouped = sum(r[1][n][1].get(path, 0) for r in reports)
            ranks = sum(1 for r in reports if r[1][n][0].get(path, 0))
            row.append(f"CP {n}: {calls:4d} calls on {ranks} rank(s), {grouped:3d}/m")
            if calls == 0:
                missing.append(f"{path} (CP {n})")
        print(f"  {path}\n      {' | '.join(row)}\n      ({what})")
    if missing:
        print("NEVER CALLED:", ", ".join(missing))
        return 1
    print("every declared callable ran under CP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
