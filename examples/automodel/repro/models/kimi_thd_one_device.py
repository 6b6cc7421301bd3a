"""Kimi Linear on ONE device ignores THD packing metadata; CP on the same batch honours it (nemo-automodel 0.7.0).

No harness: torch, the framework, two gloo ranks this script forks. Tiny random Kimi Linear, MLA layers only (KDA
needs fla). One pack of three documents [7, 5, 6] collated by the framework's ``packed_sequence_thd_collater``
(the recipe's default ``packing_strategy: thd`` and the collater of the Kimi Linear CP example): ``seq_lens``,
``seq_lens_padded``, ``position_ids``, ``qkv_format="thd"``, no attention mask.

K1  One device: ``ContextParallelSharder`` at cp_size 1 is the identity (no TE, no magi, no ``supports_thd``),
    so the model receives ``seq_lens`` in its ``**attn_kwargs``; ``squeeze_input_for_thd`` leaves no
    ``cu_seqlens`` and ``_packed_context_from_inputs`` reads only ``attention_mask`` / ``cu_seqlens``: plain
    causal attention over the whole row, documents 2 and 3 attend to the documents before them.
    CP 2: ``shard_batch_for_kimi_cp`` builds the document map from ``seq_lens_padded``: documents separated.
The expected logits of a document are the model's logits on that document alone.

    PYTHONPATH=. python examples/automodel/repro/models/kimi_thd_one_device.py     # exit 1 while K1 shows
"""

import contextlib
import os
import sys
import tempfile
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from nemo_automodel.components.datasets.utils import packed_sequence_thd_collater  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.kimi_linear import cp as kimi_cp  # noqa: E402
from nemo_automodel.components.models.kimi_linear.config import KimiLinear48BConfig  # noqa: E402
from nemo_automodel.components.models.kimi_linear.model import KimiLinear48BForCausalLM  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from examples.automodel.models.kimi_linear import BACKEND  # noqa: E402  (the spec's backend; no harness import)

torch.set_num_threads(1)
DOCS = [7, 5, 6]


def build():
    cfg = KimiLinear48BConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        mla_use_nope=True,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        linear_attn_config={
            "kda_layers": [],
            "full_attn_layers": [1, 2, 3],
            "short_conv_kernel_size": 4,
            "head_dim": 8,
            "num_heads": 2,
        },
        initializer_range=0.2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = KimiLinear48BForCausalLM(cfg, backend=BackendConfig(**BACKEND))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model


def thd_batch():
    ids = torch.randint(1, 64, (sum(DOCS),), generator=torch.Generator().manual_seed(1)).tolist()
    return packed_sequence_thd_collater(
        [
            {
                "input_ids": ids,
                "labels": [-100] * len(ids),
                "seq_lens": list(DOCS),
                "seq_lens_padded": list(DOCS),
                "position_ids": [p for n in DOCS for p in range(n)],
            }
        ]
    )


@contextlib.contextmanager
def transformer_engine_placeholder():  # apply_cp imports TE only for an isinstance test
    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention")
    modules = [types.ModuleType(n) for n in names]
    modules[2].DotProductAttention = type("DotProductAttention", (), {})
    sys.modules.update(zip(names, modules))
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


def rank_main(rank, store, out):
    from nemo_automodel.components.moe.parallelizer import apply_cp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    model = build()
    with transformer_engine_placeholder():
        apply_cp(model, mesh)  # the MoE parallelizer's CP step (ep_size > 1)
    kimi_cp._COMPILED_FLEX_ATTENTION[0] = flex_attention  # CPU: inductor fails to build this kernel
    batch = thd_batch()
    with torch.no_grad():
        sharder = ContextParallelSharder(model, mesh, batch)
        ctx, local = sharder.shard(batch)
        with ctx():
            logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
        full = sharder.gather_token_tensor(logits, seq_dim=1, trim=True, fill=0)
    if rank == 0:
        out.put(full.numpy())  # a plain array: the rank may exit before the parent reads it


def main():
    store = tempfile.mktemp()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    cp = torch.from_numpy(out.get(timeout=900))
    for p in procs:
        p.join(60)
    model = build()
    batch = thd_batch()
    with torch.no_grad():
        sharder = ContextParallelSharder(model, None, dict(batch))  # cp_size 1: the identity sharder
        _, local = sharder.shard(dict(batch))
        one = model(**{k: v for k, v in local.items() if k != "labels"}).logits
        expected, start = [], 0
        for n in DOCS:
            expected.append(model(input_ids=batch["input_ids"][:, start : start + n]).logits)
            start += n
        expected = torch.cat(expected, dim=1)
    d_one = (one - expected).abs().amax(-1)[0]
    d_cp = (cp - expected).abs().amax(-1)[0]
    print(f"documents {DOCS}, THD collater keys {sorted(batch)}")
    print(
        f"one device: max |logit - per-document logit| {float(d_one.max()):.3g} at positions "
        f"{torch.nonzero(d_one > 1e-3).flatten().tolist()}"
    )
    print(f"CP 2      : max |logit - per-document logit| {float(d_cp.max()):.2g}")
    defect = bool(d_one.max() > 1e-3)
    print("DEFECT: one device attends across THD documents (CP 2 separates them)" if defect else "no defect")
    return 1 if defect else 0


if __name__ == "__main__":
    sys.exit(main())
