"""Drive a model spec at CP 1, 2, 3 on forked gloo ranks, without the harness, and print the worst errors.

    PYTHONPATH=. python examples/automodel/tools/run_standalone.py                     # default cases, float32
    PYTHONPATH=. python examples/automodel/tools/run_standalone.py --dtypes float32,bfloat16 --cp 2,3
    PYTHONPATH=. python examples/automodel/tools/run_standalone.py --cases 1 --cp 2    # one case (fresh time)
    PYTHONPATH=. python examples/automodel/tools/run_standalone.py --overrides index_topk=3,candidate_topk_blocks=2
    PYTHONPATH=. python examples/automodel/tools/run_standalone.py --padding-repro     # one process, no ranks

One launcher imports torch and the spec (``--model``, default ``examples.automodel.models.deepseek_v41``),
builds each (dtype, overrides) model once, then forks ``max(--cp)`` ranks that join one gloo group and
make a CP sub-group of ranks ``0..N-1`` for every CP size. Per case and dtype the one-rank baseline runs on
rank 0 without a mesh (the identity sharder, as a one-device run of the recipe does), then every CP size
runs on its sub-group: ``spec.shard`` (``ContextParallelSharder(model, mesh, batch)`` + ``shard``), forward
in ``ctx_factory()``, local loss over local labels divided by the global label count, backward, parameter
gradients summed over the group, loss summed over the group, logits gathered with the sharder's
``gather_token_tensor``. The launcher compares logits at valid positions, the loss and every parameter
gradient against the baseline and names the worst parameter and position. At most ``max(--cp)`` processes
compute at once (1 thread each).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the spec builds from a config: no Hub lookups at import

_T0 = time.perf_counter()

import torch  # noqa: E402

torch.set_num_threads(1)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

DEFAULT_CASES = [
    # (name, kind, seq_len, kwargs)
    ("plain-16", "plain", 16, {}),
    ("odd-19", "plain", 19, {}),
    ("odd-17", "plain", 17, {}),
    ("right-padded-20/5", "right_padded", 20, {"pad": 5}),
    ("packed-3docs-19", "packed", 19, {"documents": [[7, 5, 6]]}),
    ("packed-2docs-20", "packed", 20, {"documents": [[11, 9]]}),
    ("odd-13-b2", "plain", 13, {"batch_size": 2}),
    ("right-padded-17/4-b2", "right_padded", 17, {"pad": 4, "batch_size": 2}),
    ("packed-b2-23", "packed", 23, {"batch_size": 2, "documents": [[1, 9, 6, 5], [13, 8]]}),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def run_one(spec, model, mesh, batch, grad_sum_dtype=None):
    """Shard, forward, local loss, backward, sum gradients over the CP group. Returns what rank 0 reports."""
    group = None if mesh is None else mesh.get_group()
    model.zero_grad(set_to_none=True)
    count = spec.num_label_tokens(batch)
    ctx_factory, local_batch, sharder = spec.shard(model, mesh, batch)
    with ctx_factory():
        logits = spec.forward(model, local_batch)
        local_loss = spec.loss(logits, spec.local_labels(local_batch), count)
    local_loss.backward()
    full_logits = spec.gather_logits(sharder, logits.detach())
    loss = local_loss.detach().clone()
    grads = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        grad = grad.detach().clone().to(grad_sum_dtype or grad.dtype)
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad.to(parameter.dtype)
    if group is not None:
        dist.all_reduce(loss, group=group)
    return {"logits": full_logits, "loss": loss, "grads": grads}


def _rank_main(rank, world, store_path, sizes, spec_name, models, inbox, outbox):
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        meshes = {}
        for n in sorted(sizes):
            if n == 1:
                continue
            group = dist.new_group(list(range(n))) if n < world else dist.group.WORLD
            if rank < n:
                meshes[n] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
        spec = importlib.import_module(spec_name)
        outbox.put(("ready", rank, None))
        while True:
            message = inbox.get()
            if message is None:
                break
            case_id, model_key, batch, n, grad_sum_dtype = message
            start = time.perf_counter()
            try:
                result = run_one(spec, models[model_key], None if n == 1 else meshes[n], batch, grad_sum_dtype)
                result["seconds"] = time.perf_counter() - start
                outbox.put((case_id, rank, result if rank == 0 else None))
            except Exception:
                outbox.put((case_id, rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Pool:
    """``world`` forked ranks; ``run(model_key, batch, n)`` runs on ranks ``0..n-1`` and returns rank 0's result."""

    def __init__(self, world, sizes, spec_name, models):
        ctx = mp.get_context("fork")
        self.world = world
        self.store = tempfile.NamedTemporaryFile(prefix="cp-standalone-", delete=False).name
        os.unlink(self.store)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, self.store, sizes, spec_name, models, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        for _ in range(world):
            self._get()
        self.case_id = 0

    def _get(self, timeout=600):
        message = self.outbox.get(timeout=timeout)
        if isinstance(message[2], dict) and "error" in message[2]:
            raise RuntimeError(f"rank {message[1]} failed:\n{message[2]['error']}")
        return message

    def run(self, model_key, batch, n, grad_sum_dtype=None):
        self.case_id += 1
        for r in range(n):
            self.inboxes[r].put((self.case_id, model_key, batch, n, grad_sum_dtype))
        result = None
        for _ in range(n):
            case_id, rank, payload = self._get()
            assert case_id == self.case_id
            if rank == 0:
                result = payload
        return result

    def close(self):
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
        if os.path.exists(self.store):
            os.unlink(self.store)


def worst(a, b, mask=None):
    """(max |a-b|, index tuple) over ``mask`` (broadcast over trailing dims)."""
    diff = (a.double() - b.double()).abs()
    if mask is not None:
        diff = diff * mask.reshape(*mask.shape, *([1] * (diff.ndim - mask.ndim))).to(diff.dtype)
    if diff.numel() == 0:
        return 0.0, ()
    flat = int(diff.argmax())
    return float(diff.reshape(-1)[flat]), tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


def compare(spec, batch, ref, got):
    valid = spec.valid_positions(batch)
    logit_err, logit_at = worst(got["logits"], ref["logits"], valid)
    loss_err = abs(float(got["loss"]) - float(ref["loss"]))
    grad_err, grad_at, grad_name, grad_rel = 0.0, (), "-", 0.0
    for name, g in ref["grads"].items():
        err, at = worst(got["grads"][name], g)
        if err > grad_err or grad_name == "-":
            grad_err, grad_at, grad_name = err, at, name
            grad_rel = err / max(float(g.abs().max()), 1e-30)
    return logit_err, logit_at, loss_err, grad_err, grad_name, grad_at, grad_rel


def build_models(spec, dtypes, overrides):
    models = {}
    for name in dtypes:
        key = (name, tuple(sorted(overrides.items())))
        models[key] = spec.build(DTYPES[name], seed=0, **overrides)
    return models


def padding_repro(spec, dtype=torch.float32, seq_len=19, seed=0, overrides=None, extra_pad=1, verbose=True):
    """One process: the same unpadded batch, then with ``extra_pad`` masked pad tokens appended.

    Returns the worst |logit change| at the real positions (and where), and the per-position change.
    """
    overrides = overrides if overrides is not None else {"index_topk": 3, "candidate_topk_blocks": 2}
    model = spec.build(dtype, seed=0, **overrides).eval()
    batch = spec.make_batch("plain", seq_len, seed=seed)
    padded = spec.make_batch("right_padded", seq_len + extra_pad, pad=extra_pad, seed=0)
    padded["input_ids"][:, :seq_len] = batch["input_ids"]
    padded["labels"][:, :seq_len] = batch["labels"]
    with torch.no_grad():
        a = spec.forward(model, spec.shard(model, None, batch)[1])
        b = spec.forward(model, spec.shard(model, None, padded)[1])[:, :seq_len]
    change = (a - b).abs().amax(-1)[0]
    err, at = worst(a, b)
    if verbose:
        print(
            f"padding repro: seq_len {seq_len} seed {seed} +{extra_pad} masked pad: worst |logit change| "
            f"{err:.3g} at {at}; positions changed: {torch.nonzero(change > 0).flatten().tolist()}"
        )
    return err, at, change


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples.automodel.models.deepseek_v41")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--cp", default="2,3", help="CP sizes compared against one rank")
    parser.add_argument("--cases", type=int, default=len(DEFAULT_CASES), help="first K default cases")
    parser.add_argument("--overrides", default="", help="text-config overrides, e.g. index_topk=3")
    parser.add_argument("--repeat", type=int, default=1, help="run the case list this many times (timing)")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        help="KIND:SEQ_LEN[:SEED] instead of the default list, e.g. plain:15:1 (repeatable)",
    )
    parser.add_argument("--padding-repro", action="store_true")
    parser.add_argument(
        "--padding-check", action="store_true", help="also run one rank at each CP-padded length and compare"
    )
    parser.add_argument("--grad-sum-dtype", default="", help="sum gradients over CP in this dtype (float32)")
    args = parser.parse_args()
    overrides = _parse_overrides(args.overrides)
    spec = importlib.import_module(args.model)
    t_import = time.perf_counter() - _T0
    if args.padding_repro:
        for seq_len in (19, 17, 21, 13, 15):
            padding_repro(spec, seq_len=seq_len, overrides=overrides or None)
        return 0
    sizes = sorted({int(n) for n in args.cp.split(",")})
    dtypes = args.dtypes.split(",")
    t = time.perf_counter()
    models = build_models(spec, dtypes, overrides)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    pool = Pool(max(sizes), set(sizes) | {1}, args.model, models)
    t_pool = time.perf_counter() - t
    print(f"import {t_import:.1f} s, build {t_build:.2f} s, pool of {max(sizes)} ranks {t_pool:.1f} s")
    print(
        f"{'case':24} {'dtype':9} {'CP':>2} {'logits':>9} {'at':14} {'loss':>9} {'grad':>9}  parameter[index]"
        f"   base s  CP s"
    )
    worst_by = {}
    case_times = []
    try:
        for _ in range(args.repeat):
            cases = DEFAULT_CASES[: args.cases]
            if args.case:
                cases = [
                    (
                        c,
                        c.split(":")[0],
                        int(c.split(":")[1]),
                        {"seed": int(c.split(":")[2])} if c.count(":") > 1 else {},
                    )
                    for c in args.case
                ]
            for name, kind, seq_len, kwargs in cases:
                batch = spec.make_batch(kind, seq_len, **kwargs)
                for dtype_name in dtypes:
                    key = (dtype_name, tuple(sorted(overrides.items())))
                    t = time.perf_counter()
                    ref = pool.run(key, batch, 1)
                    t_ref = time.perf_counter() - t
                    for n in sizes:
                        if n == 1:
                            continue
                        t = time.perf_counter()
                        got = pool.run(key, batch, n, DTYPES.get(args.grad_sum_dtype))
                        t_cp = time.perf_counter() - t
                        case_times.append((n, t_ref, t_cp))
                        le, lat, lo, ge, gname, gat, grel = compare(spec, batch, ref, got)
                        w = worst_by.setdefault((dtype_name, n), [0.0, 0.0, 0.0])
                        w[0], w[1], w[2] = max(w[0], le), max(w[1], lo), max(w[2], ge)
                        print(
                            f"{name:24} {dtype_name:9} {n:>2} {le:9.2e} {str(lat):14} {lo:9.2e} {ge:9.2e}  "
                            f"{gname}{list(gat)} (/max {grel:.1e})   {t_ref:.3f} {t_cp:.3f}"
                        )
                        if args.padding_check and kind != "packed":
                            padded_len = spec.cp_padded_length(models[key], seq_len, n)
                            if padded_len != seq_len:
                                padded = pool.run(key, spec.pad_batch(batch, padded_len), 1)
                                valid = spec.valid_positions(batch)
                                trimmed = padded["logits"][:, :seq_len]
                                e_pad, at_pad = worst(trimmed, ref["logits"], valid)
                                e_cp_pad, _ = worst(got["logits"], trimmed, valid)
                                print(
                                    f"    padding check: 1 rank at CP-padded length {padded_len} vs 1 rank: "
                                    f"{e_pad:.2e} at {at_pad}; CP {n} vs 1 rank padded: {e_cp_pad:.2e}"
                                )
    finally:
        pool.close()
    print("worst per dtype and CP size (logits, loss, gradients):")
    for (dtype_name, n), (le, lo, ge) in sorted(worst_by.items()):
        print(f"  {dtype_name:9} CP {n}: {le:.2e} {lo:.2e} {ge:.2e}")
    for n in sorted({c[0] for c in case_times}):
        pairs = [r + c for m, r, c in case_times if m == n]
        print(
            f"  warm CP {n} case + its 1-rank baseline: median {sorted(pairs)[len(pairs) // 2]:.3f} s, "
            f"min {min(pairs):.3f} s over {len(pairs)}"
        )
    print(f"total {time.perf_counter() - _T0:.1f} s since process start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
