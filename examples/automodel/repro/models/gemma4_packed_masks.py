"""Gemma4 MoE on ONE device mis-masks neat-packed batches; CP on the same packs does not (nemo-automodel 0.7.0).

No harness: torch, the framework, two gloo ranks this script forks. Tiny random Gemma4 MoE (text only,
``use_bidirectional_attention="vision"`` as the released configs, sliding window 4). Packs are collated as
``datasets.vlm.collate_fns.neat_packed_vlm_collater`` does: at ``cp_size <= 1`` (``materialize_4d_mask=True``)
a ``[B, 1, S, S]`` block-causal ``attention_mask`` and ``_packed_seq_ids`` only when a row holds two or more
documents; at ``cp_size > 1`` the indexed ``[B, S]`` mask and ``_packed_seq_ids``. The expected logits of a
document are the model's logits on that document alone (no mask, no padding).

G1  one document per row: the one-device forward receives only the 4-D mask; HF's sliding-window mask builder
    returns a given 4-D mask unchanged, so the sliding layers attend the whole document (positions >= window
    differ). Any attention implementation.
G2  two documents, attention "eager" (what the Gemma4 MoE recipes set): ``_packed_seq_ids`` selects
    ``_build_packed_gemma4_causal_mask_mapping``, which returns *boolean* masks; eager attention adds the mask
    to the scores (``attn_weights + attention_mask``), i.e. +1 where allowed and +0 where masked: no causal or
    document masking at all (every position differs). With "sdpa" the same masks are right.
CP 2 (the ring, FlexAttention run uncompiled on CPU under no_grad) matches the per-document logits in both.

    PYTHONPATH=. python examples/automodel/repro/models/gemma4_packed_masks.py     # exit 1 while G1 or G2 shows
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from nemo_automodel.components.datasets.utils import _indexed_mask_to_4d_block_causal  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.gemma4_moe.model import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from examples.automodel.models.gemma4_moe import BACKEND  # noqa: E402  (the spec's backend; no harness import)

torch.set_num_threads(1)
TEXT = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=4,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=8,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=64,
    use_bidirectional_attention="vision",
    final_logit_softcapping=30.0,
    pad_token_id=0,
    dtype="float32",
)


def build(attention):
    cfg = Gemma4Config(text_config=dict(TEXT), vision_config=None, audio_config=None, dtype="float32")
    cfg._attn_implementation = cfg.text_config._attn_implementation = attention
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(cfg, backend=BackendConfig(**BACKEND))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model


def pack(lengths, seed):
    """One row: documents concatenated (document-local positions), as the neat packer lays them out."""
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.full_like(ids, -100)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "mm_token_type_ids": torch.zeros_like(ids),
        "doc": doc,
    }


def one_device_batch(p):  # neat_packed_vlm_collater, materialize_4d_mask=True
    out = {k: p[k] for k in ("input_ids", "position_ids", "mm_token_type_ids")}
    out["attention_mask"] = _indexed_mask_to_4d_block_causal(p["doc"])
    if p["doc"].max() > 1:
        out["_packed_seq_ids"] = p["doc"]
    return out


def per_document(model, p, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=p["input_ids"][:, start : start + n]).logits)
        start += n
    return torch.cat(out, dim=1)


CHECKS = [
    ("G1 one document", [12], "eager"),
    ("G2 two documents, eager", [6, 6], "eager"),
    ("   two documents, sdpa", [6, 6], "sdpa"),
]


def rank_main(rank, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    for name, lengths, attention in CHECKS:
        model = build(attention)
        p = pack(lengths, seed=1)
        batch = {
            "input_ids": p["input_ids"],
            "labels": p["labels"],
            "position_ids": p["position_ids"],
            "mm_token_type_ids": p["mm_token_type_ids"],
            "attention_mask": p["doc"],
            "_packed_seq_ids": p["doc"],
        }
        with torch.no_grad():
            sharder = ContextParallelSharder(model, mesh, batch)  # installs Gemma4's ring on first shard
            for module in model.modules():
                if hasattr(module, "_gemma4_cp_sliding_backend"):
                    module._gemma4_cp_compiled_flex_attn = flex_attention  # CPU: inductor refuses return_lse
            ctx, local = sharder.shard(batch)
            with ctx():
                local_logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
            cp = sharder.gather_token_tensor(local_logits, seq_dim=1, trim=True, fill=0)
        if rank == 0:
            out.put((name, cp.numpy()))  # a plain array: the rank may exit before the parent reads it


def main():
    store = tempfile.mktemp()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    cp = {name: torch.from_numpy(a) for name, a in (out.get(timeout=900) for _ in CHECKS)}
    for p in procs:
        p.join(60)
    defect = False
    for name, lengths, attention in CHECKS:
        model = build(attention)
        p = pack(lengths, seed=1)
        with torch.no_grad():
            expected = per_document(model, p, lengths)
            one = model(**one_device_batch(p)).logits
        d_one = (one - expected).abs().amax(-1)[0]
        d_cp = (cp[name] - expected).abs().amax(-1)[0]
        bad = bool(d_one.max() > 1e-3)
        defect |= bad and name.startswith("G")
        print(
            f"{name:26} documents {lengths} attention {attention:5}: max |logit - per-document logit|  "
            f"one device {float(d_one.max()):.3g} at positions {torch.nonzero(d_one > 1e-3).flatten().tolist()}; "
            f"CP 2 {float(d_cp.max()):.2g}"
        )
    print("DEFECT: the one-device packed forward is mis-masked (CP 2 is right)" if defect else "no defect")
    return 1 if defect else 0


if __name__ == "__main__":
    sys.exit(main())
