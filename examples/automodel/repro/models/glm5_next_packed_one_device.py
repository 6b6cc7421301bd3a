"""GLM-5.3 (nemo-automodel 0.7.0): on one device a packed THD batch attends across its documents; under CP the
same batch is kept per document. So CP N does not compute what one device computes on a packed batch.

The batch is what the framework's THD packing gives a model that owns its CP (``packed_sequence_thd_collater``:
``input_ids``, ``labels``, ``position_ids``, ``seq_lens``, ``seq_lens_padded``, ``qkv_format="thd"``).

* One device, as ``train_ft.py`` runs it at ``cp_size=1``: ``ContextParallelSharder(model, mesh, batch)`` with a
  size-1 CP mesh resolves the identity sharder (the model's CP hook runs only at CP > 1, or for THD when the
  model has a ``supports_thd`` attribute, which this one does not), then ``model(**filter_forward_kwargs(...))``.
  ``Glm5NextForConditionalGeneration.forward`` builds its document map from ``_packed_seq_ids``, ``cu_seqlens``,
  ``attention_mask`` or ``padding_mask`` (``model._packed_context_from_inputs``) and never reads ``seq_lens``:
  the whole row is one document.
* CP 2 (two gloo ranks forked here): the model's ``shard_batch_for_glm5_next_cp`` builds the map from
  ``seq_lens_padded`` / ``seq_lens`` (``cp._global_doc_ids_from_batch``): three documents.

The script prints, per document, the largest logit difference between CP 2 and one device, and between CP 2 and
one device given the same documents in a key its forward reads (``_packed_seq_ids``). Exit status 1 while the
one-device run differs from CP on documents 2 and 3 (the defect); 0 once one device honours ``seq_lens``; 2 when
it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/glm5_next_packed_one_device.py
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from examples.automodel.models import glm5_next as spec  # noqa: E402  (spec.build: the tiny config; spec.make_batch:
from examples.automodel.models.model_owned_cp import apply_moe_cp  # noqa: E402

#                                                        the framework's packed_sequence_thd_collater)

DOCUMENTS = [7, 5, 6]  # in a row of 19: one pad token at the end
SEQ_LEN = 19


def run(model, batch, mesh):
    """The recipe's step: the sharder for ``mesh`` and ``batch``, the forward; logits [1, S, V] in global order."""
    batch = dict(batch)
    sharder = ContextParallelSharder(model, mesh, batch)
    ctx, local = sharder.shard(batch)
    local.pop("labels")
    with torch.no_grad(), ctx():
        logits = model(**filter_forward_kwargs(model, local)).logits
    return sharder.gather_token_tensor(logits, seq_dim=1, trim=True, fill=0)


def rank_main(rank, store, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = spec.build(torch.float32, seed=0).eval()
    batch = spec.make_batch("packed", SEQ_LEN, documents=[DOCUMENTS], seed=1)
    solo = dist.new_group([0])  # collective: both ranks create it
    if rank == 0:  # one device: the recipe at cp_size=1 (a size-1 CP mesh), the model not parallelised
        mesh1 = DeviceMesh.from_group(solo, "cpu", mesh_dim_names=("cp",))
        given = run(model, batch, mesh1)
        doc_ids = torch.zeros(1, SEQ_LEN, dtype=torch.int32)
        start = 0
        for index, length in enumerate(DOCUMENTS, 1):
            doc_ids[0, start : start + length] = index
            start += length
        with_ids = run(model, {**batch, "_packed_seq_ids": doc_ids}, mesh1)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    apply_moe_cp(model, mesh)  # the framework's parallelizer.apply_cp (a placeholder for its TE isinstance class)
    cp = run(model, batch, mesh)
    if rank == 0:
        queue.put(tuple(t.numpy() for t in (cp, given, with_ids)) + (sorted(batch),))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, os.path.join(tmp, "store"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            cp, given, with_ids, keys = queue.get(timeout=600)
        except Exception as exc:  # noqa: BLE001 - a rank died: no verdict
            print(f"could not run: {type(exc).__name__}: {exc}")
            return 2
        finally:
            for p in procs:
                p.join(timeout=60)
    print(f"batch keys (packed_sequence_thd_collater): {keys}; documents {DOCUMENTS} in a row of {SEQ_LEN}")
    start, moved = 0, []
    for index, length in enumerate(DOCUMENTS, 1):
        part = slice(start, start + length)
        a = float(abs(cp[0, part] - given[0, part]).max())
        b = float(abs(cp[0, part] - with_ids[0, part]).max())
        print(
            f"document {index} (positions {start}..{start + length - 1}): max |CP2 - one device as given| = "
            f"{a:.3g}; max |CP2 - one device with _packed_seq_ids| = {b:.3g}"
        )
        moved.append(a)
        start += length
    defect = moved[0] < 1e-4 and min(moved[1:]) > 1e-2
    print(
        "DEFECT: one device attends across documents (seq_lens ignored); CP keeps them apart"
        if defect
        else "no difference: one device and CP agree on the packed batch"
    )
    return 1 if defect else 0


if __name__ == "__main__":
    sys.exit(main())
