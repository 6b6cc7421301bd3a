"""GLM-5.2 DSA (nemo-automodel 0.7.0, ``glm_moe_dsa``) at ``cp_size`` 1: the recipe's sharder hands a packed THD
batch to the model unconverted, and the model's packed backends (``backend.attn`` ``"tilelang"`` / ``"cudnn"``, the
only ones its CP accepts) refuse it for want of ``cu_seqlens``.

The batch is what the framework's THD packing gives at ``cp_size`` 1 (``input_ids``, ``labels``, ``position_ids``,
``seq_lens``, ``seq_lens_padded`` ``[1, S]`` / ``[1, D]``, ``qkv_format="thd"``).

* ``train_ft.py`` builds ``ContextParallelSharder(model, device_mesh, batch)``; with a CP axis of size 1,
  ``context_parallel/utils.py::_prepare_cp_sharder`` calls the model's ``prepare_model_inputs_for_cp`` only at
  ``cp_size > 1`` or when ``getattr(model, "supports_thd", False)``; ``GlmMoeDsaForCausalLM`` declares
  ``supports_thd=True`` in its ``ModelCapabilities`` dataclass only, so the attribute is absent and the identity
  sharder returns the rows as they are: no ``process_input_for_thd``, no ``cu_seqlens``.
* The model's forward then raises: with ``backend.attn="cudnn"`` ``GlmMoeDsaModel.forward`` ``ValueError: cuDNN DSA
  requires 'cu_seqlens' for packed THD input.`` (before any kernel, so on a CPU too); with ``"tilelang"`` the
  indexer raises ``ValueError: TileLang DSA indexer requires 'cu_seqlens'`` (after its CUDA check: on a CPU it stops
  earlier, at ``should_use_tilelang``).
* The model's own hook on the same size-1 mesh (what the dispatch skips) gives ``cu_seqlens``: the CP path's
  sharder works at one rank.

Exit status 1 while the recipe's one-rank sharder gives the model no ``cu_seqlens`` and the forward raises for it
(the defect); 0 once it does; 2 when the script could not run.

    PYTHONPATH=. python examples/automodel/repro/models/glm_dsa_one_device_no_thd.py
"""

import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from examples.automodel.models import glm_moe_dsa as spec  # noqa: E402  (the tiny config and the THD layout)

DOCUMENTS = [[7, 5, 6]]
SEQ_LEN = 19


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            world = dist.group.WORLD
            assert world is not None
            mesh = DeviceMesh.from_group(world, "cpu", mesh_dim_names=("cp",))  # a CP axis of size 1
            batch, _ = spec.thd_batch(spec.make_batch("packed", SEQ_LEN, documents=DOCUMENTS, seed=1), 1)
            model: Any = spec.build(torch.bfloat16, 0)
            model.backend.attn = "cudnn"  # the other packed backend; its cu_seqlens check precedes every kernel
            print(f"model has attribute supports_thd: {hasattr(model, 'supports_thd')}; "
                  f"ModelCapabilities.supports_thd: {type(model).ModelCapabilities().supports_thd}")  # fmt: skip
            sharder = ContextParallelSharder(model, mesh, dict(batch))
            _, local = sharder.shard(dict(batch))
            print(f"recipe's sharder at cp_size 1: local keys {sorted(local)}")
            hook = model.prepare_model_inputs_for_cp(dict(batch))["cp_sharder"]
            _, hooked = ContextParallelSharder(
                device_mesh=mesh,
                shard_batch=hook.shard_batch,
                local_token_global_indices=hook.local_token_global_indices,
            ).shard(dict(batch))
            print(f"the model's own hook on the same mesh: cu_seqlens {hooked['cu_seqlens'].tolist()}")
            kwargs = {key: value for key, value in local.items() if key != "labels"}
            try:
                model(**filter_forward_kwargs(model, kwargs))
                raised = None
            except ValueError as exc:
                raised = str(exc)
            print(f"forward on the recipe's batch: {'ValueError: ' + raised if raised else 'ran'}")
            defect = "cu_seqlens" not in local and raised is not None and "cu_seqlens" in raised
            print("DEFECT: the one-rank recipe path gives GLM DSA no THD batch" if defect else "fixed")
            return 1 if defect else 0
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001 - a repro that cannot run says so
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
