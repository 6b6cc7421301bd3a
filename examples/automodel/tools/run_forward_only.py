"""Forward-only check of a model spec at CP 1, 2, 3 against one device, without the harness (logits and loss).

    PYTHONPATH=. python examples/automodel/tools/run_forward_only.py --model examples.automodel.models.gemma4_moe
    PYTHONPATH=. python examples/automodel/tools/run_forward_only.py --model examples.automodel.models.kimi_linear \
        --dtypes float32,bfloat16 --cp 1,2,3 --repeat 2

For specs whose CP path cannot run a backward on this device (``spec.FORWARD_ONLY_ON``): every forward runs
under ``torch.no_grad()`` (on CPU the FlexAttention CP paths raise in the forward itself when Q/K/V require
grad), so gradients are not compared. One launcher imports the spec and builds each dtype's model once, then
forks ``max(--cp)`` gloo ranks with one CP sub-group of ranks ``0..N-1`` per size. Per case and dtype rank 0
runs one device (``mesh=None``) twice, plainly and with the batch rows reversed (the reference spread), then
every CP size runs on its sub-group: ``spec.shard``, ``spec.forward`` in ``ctx_factory()``, the local loss over
``spec.local_labels`` divided by the global label count, summed over the group, logits gathered with
``spec.gather_logits``. Errors are normwise, in ULPs of the dtype at the largest one-device value (the
harness's unit), against the harness's bound ``4 x spread + floor`` (floor 1024 float32, 8 bfloat16 ULP).
``--fixture`` runs a defect fixture module instead of the spec and prints the positions its logits move.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_T0 = time.perf_counter()

import torch  # noqa: E402

torch.set_num_threads(1)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 1024.0, "bfloat16": 8.0}
C = 4.0

# (name, kind, seq_len, keywords): the harness smoke batches plus single-token documents and odd lengths.
CASES = [
    ("packed-3docs-19", "packed", 19, {"documents": [[7, 5, 6]], "seed": 1}),
    ("packed-b2-1tok-23", "packed", 23, {"batch_size": 2, "documents": [[1, 9, 6, 5], [13, 1, 8]], "seed": 2}),
    ("packed-1doc-21", "packed", 21, {"documents": [[21]], "seed": 3}),
    ("right-padded-17/4-b2", "right_padded", 17, {"pad": 4, "batch_size": 2, "seed": 4}),
    ("plain-13", "plain", 13, {"seed": 5}),
    ("plain-19", "plain", 19, {"seed": 6}),
    ("packed-1tok-docs-9", "packed", 9, {"documents": [[1, 1, 3, 1, 2]], "seed": 7}),
    ("packed-b2-1doc-and-2docs-16", "packed", 16, {"batch_size": 2, "documents": [[16], [9, 7]], "seed": 8}),
    # Kimi specs only (make_batch(packing=...)): the THD collater's form; fails by finding K1 (one device).
    ("thd-packed-3docs-19", "packed", 19, {"documents": [[7, 5, 6]], "seed": 1, "packing": "thd"}),
]


def run_one(spec, model, mesh, batch):
    group = None if mesh is None else mesh.get_group()
    count = spec.num_label_tokens(batch)
    with torch.no_grad():
        ctx_factory, local, sharder = spec.shard(model, mesh, batch)
        with ctx_factory():
            logits = spec.forward(model, local)
            labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
            value = spec.loss(logits, labels, count).detach().float().clone()
        full = spec.gather_logits(sharder, logits)
    if group is not None:
        dist.all_reduce(value, group=group)
    return {"logits": full.float(), "loss": value}


def _rank_main(rank, world, store, sizes, spec_name, models, inbox, outbox):
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        meshes = {}
        for n in sorted(sizes):
            if n == 1:
                continue
            group = dist.new_group(list(range(n))) if n < world else dist.group.WORLD
            if rank < n:
                meshes[n] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
        spec = importlib.import_module(spec_name)
        outbox.put(("ready", rank, None))
        while (message := inbox.get()) is not None:
            case_id, dtype, batch, n = message
            start = time.perf_counter()
            try:
                result = run_one(spec, models[dtype], None if n == 1 else meshes[n], batch)
                result["seconds"] = time.perf_counter() - start
                outbox.put((case_id, rank, result if rank == 0 else None))
            except Exception:  # noqa: BLE001 - reported by the launcher
                outbox.put((case_id, rank, {"error": traceback.format_exc()[-4000:]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Pool:
    def __init__(self, world, sizes, spec_name, models):
        ctx = mp.get_context("fork")
        self.store = tempfile.mktemp(prefix="cp-forward-only-")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(r, world, self.store, sizes, spec_name, models, self.inboxes[r], self.outbox),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        for _ in range(world):
            self._get()
        self.case_id = 0

    def _get(self):
        message = self.outbox.get(timeout=900)
        if isinstance(message[2], dict) and "error" in message[2]:
            raise RuntimeError(f"rank {message[1]} failed:\n{message[2]['error']}")
        return message

    def run(self, dtype, batch, n):
        self.case_id += 1
        for r in range(n):
            self.inboxes[r].put((self.case_id, dtype, batch, n))
        result = None
        for _ in range(n):
            case_id, rank, payload = self._get()
            assert case_id == self.case_id
            result = payload if rank == 0 else result
        return result

    def close(self):
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
        if os.path.exists(self.store):
            os.unlink(self.store)


def _reversed_rows(batch):
    rows = batch["input_ids"].shape[0]
    return {
        k: (v.flip(0) if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == rows else v)
        for k, v in batch.items()
    }


def ulps(actual, expected, dtype, mask=None):
    """(normwise error in ULPs of ``dtype`` at max |expected|, per-position max |diff| [B, S], worst index)."""
    diff = (actual.double() - expected.double()).abs()
    ref = expected.double().abs()
    if mask is not None:
        m = mask.reshape(*mask.shape, *([1] * (diff.ndim - mask.ndim)))
        diff, ref = diff * m, ref * m
    scale = float(ref.max()) if ref.numel() else 0.0
    unit = torch.finfo(DTYPES[dtype]).eps
    worst = float(diff.max()) if diff.numel() else 0.0
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    return (worst / (scale * unit) if scale else (0.0 if worst == 0 else float("inf"))), diff, index


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples.automodel.models.gemma4_moe")
    parser.add_argument("--fixture", default="", help="defect fixture module run in the spec's place")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cp", default="1,2,3")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--overrides", default="", help="build overrides, e.g. attn_implementation=sdpa")
    args = parser.parse_args()
    spec_name = args.fixture or args.model
    spec = importlib.import_module(spec_name)
    dtypes = args.dtypes.split(",")
    sizes = sorted({int(n) for n in args.cp.split(",")} | {1})
    t = time.perf_counter()
    overrides = dict(item.split("=") for item in filter(None, args.overrides.split(",")))
    overrides = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in overrides.items()}
    models = {name: spec.build(DTYPES[name], 0, **overrides) for name in dtypes}
    print(f"{spec_name}: import {t - _T0:.1f} s, build {time.perf_counter() - t:.2f} s", flush=True)
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    kinds = getattr(spec, "BATCH_KINDS", ("plain", "right_padded", "packed"))
    cases = [c for c in cases if c[1] in kinds]
    if "packing" not in inspect.signature(spec.make_batch).parameters:
        cases = [c for c in cases if "packing" not in c[3]]
    pool = Pool(max(sizes), set(sizes), spec_name, models)
    print(
        f"{'case':28} {'dtype':9} CP {'logits ULP':>10} {'bound':>7} {'at [row, pos, vocab]':22} "
        f"{'loss ULP':>9} {'bound':>6} {'verdict':8} {'CP s':>6}"
    )
    worst, times, failed = {}, {}, 0
    try:
        for _ in range(args.repeat):
            for name, kind, seq_len, keys in cases:
                batch = spec.make_batch(kind, seq_len, **keys)
                valid = spec.valid_positions(batch).to(torch.float64)
                for dtype in dtypes:
                    ref = pool.run(dtype, batch, 1)
                    other = pool.run(dtype, _reversed_rows(batch), 1)
                    other["logits"] = other["logits"].flip(0)
                    spread_l, _, _ = ulps(other["logits"], ref["logits"], dtype, valid)
                    spread_s, _, _ = ulps(other["loss"], ref["loss"], dtype)
                    for n in sizes:
                        got = pool.run(dtype, batch, n)
                        err_l, diff, at = ulps(got["logits"], ref["logits"], dtype, valid)
                        err_s, _, _ = ulps(got["loss"], ref["loss"], dtype)
                        bound_l, bound_s = C * spread_l + FLOOR[dtype], C * spread_s + FLOOR[dtype]
                        ok = err_l <= bound_l and err_s <= bound_s
                        failed += not ok
                        times.setdefault(n, []).append(got["seconds"])
                        w = worst.setdefault((dtype, n), [0.0, 0.0])
                        w[0], w[1] = max(w[0], err_l), max(w[1], err_s)
                        print(
                            f"{name:28} {dtype:9} {n:>2} {err_l:10.1f} {bound_l:7.0f} {str(list(at)):22} "
                            f"{err_s:9.2f} {bound_s:6.0f} {'ok' if ok else 'FAIL':8} {got['seconds']:6.3f}",
                            flush=True,
                        )
                        if not ok:
                            moved = (
                                diff.amax(-1)
                                > bound_l * float(ref["logits"].abs().max()) * torch.finfo(DTYPES[dtype]).eps
                            )
                            print(
                                f"    positions beyond the bound [row, pos]: {moved.nonzero().tolist()}; "
                                f"loss CP {float(got['loss']):.6g} one device {float(ref['loss']):.6g}"
                            )
    finally:
        pool.close()
    print("worst normwise error, ULP (logits, loss):")
    for (dtype, n), (el, es) in sorted(worst.items()):
        print(f"  {dtype:9} CP {n}: {el:.1f} {es:.2f}")
    for n, ts in sorted(times.items()):
        warm = sorted(ts[len(ts) // 4 :]) if len(ts) > 3 else sorted(ts)
        print(
            f"  CP {n} forward-only case (all ranks, rank 0's time): median {warm[len(warm) // 2]:.3f} s, "
            f"first {ts[0]:.2f} s, over {len(ts)}"
        )
    print(f"{failed} case(s) beyond the bound; total {time.perf_counter() - _T0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
