"""Repro (no harness): DeepSeek V4 one-device packed training and CP packed training compute different logits for
the same packed batch, because only the CP path aligns documents to the compressor's windows.

    PYTHONPATH=. python examples/automodel/repro/models/deepseek_v4_packed_windows.py     # exit 1 while it shows
    PYTHONPATH=. python examples/automodel/repro/models/deepseek_v4_packed_windows.py --documents 5,1,10,1 \
        --seq-len 17 --dtype bfloat16                                                      # one row of your own

nemo-automodel 0.7.0, ``DeepseekV4ForCausalLM`` at a tiny random config (compress ratios ``[0, 4, 4, 0]``), eager
attention on CPU, float32. One packed row of three documents (lengths 7, 5, 6, one trailing pad token) as the
framework's default THD packing feeds it (``pack_features_for_thd`` + ``packed_sequence_thd_collater``:
``seq_lens``, ``seq_lens_padded``, document-local ``position_ids``, ``qkv_format="thd"``). Three runs:

* **per document** (rank 0): every document alone, unpacked, one device: what packing means.
* **one device, packed** (rank 0): the batch as given, through ``ContextParallelSharder(model, None, batch)`` (the
  identity sharder) and the model, as a one-device run of the recipe does. The model builds document ids from
  ``seq_lens_padded`` and the compressor pools fixed windows of 4 *global* positions
  (``_compressed_window_metadata``): a window that straddles two documents gets id 0 and is dropped, and the
  windows of a document that does not start at a multiple of 4 are offset from its start.
* **CP 2, packed** (two gloo ranks this script forks): ``ContextParallelSharder(model, mesh, batch)`` +
  ``shard``: ``make_dsv4_contiguous_shard_cp_batch_and_ctx`` rebuilds each row, padding every document to the
  per-rank multiple 8 (``_repad_dsv4_packed_batch``), so every document starts on a window boundary; logits
  gathered back to the caller's positions through the sharder's position map.

Prints the largest logit difference of each packed run from the per-document run, per document. It shows when
the CP run matches the per-document run while the one-device packed run does not (only on documents after the
first): one-device and CP training of the same packed data then differ. Two controls: documents that already
start at multiples of 8 (lengths 8, 8, 5), and the misaligned documents packed with the THD packer's per-document
alignment ``pad_to_multiple_of=4`` (the compress ratio): all three runs agree on both.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from nemo_automodel.components.datasets.utils import pack_features_for_thd, packed_sequence_thd_collater  # noqa: E402
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM  # noqa: E402
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from examples.automodel.models.deepseek_v4 import TINY  # noqa: E402  (the spec's data; no harness import)
from examples.automodel.models.deepseek_v41 import BACKEND  # noqa: E402

CONFIG = {**TINY, "torch_dtype": "float32"}  # the spec's tiny config
# name: (document lengths, per-document span alignment of the THD packer: ``packed_sequence.pad_to_multiple_of``)
CASES = {
    "misaligned [7, 5, 6] + 5 pad": ([7, 5, 6], 1),
    "control, documents starting at multiples of 8 [8, 8, 5] + 2 pad": ([8, 8, 5], 1),
    "[7, 5, 6] packed with pad_to_multiple_of=4": ([7, 5, 6], 4),
}
SEQ_LEN, CP = 23, 2
DTYPE = torch.float32
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2}  # CP vs per-document: rounding only (absolute, logits)


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = {**CONFIG, "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[DTYPE]}
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config), backend=BackendConfig(**BACKEND))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=DTYPE)
    return model.eval()


def packed_batch(lengths: list[int], align: int) -> tuple[dict, list[list[int]], list[int]]:
    """One THD-packed row: documents as ``pack_features_for_thd`` concatenates them (with ``align > 1``, each
    document's span padded to a multiple of ``align`` first, as ``pack_dataset(pad_to_multiple_of=align)`` does:
    pad tokens, labels -100, positions counting on), padded to ``SEQ_LEN`` the way the THD packer pads a pack (pad
    tokens, positions counting on, the padding added to the last span). Returns the batch, the documents' tokens
    and their start columns."""
    tokens = torch.randint(1, 64, (sum(lengths),), generator=torch.Generator().manual_seed(1)).tolist()
    docs, start = [], 0
    for n in lengths:
        docs.append(tokens[start : start + n])
        start += n
    features = []
    for d in docs:
        pad = -len(d) % align
        features.append({"input_ids": d + [0] * pad, "labels": d[1:] + [-100] * (pad + 1)})
    record = pack_features_for_thd(features)
    record["seq_lens"] = [len(d) for d in docs]
    starts = [sum(len(f["input_ids"]) for f in features[:i]) for i in range(len(features))]
    extra = SEQ_LEN - len(record["input_ids"])
    last = record["position_ids"][-1]
    record["input_ids"] += [0] * extra
    record["labels"] += [-100] * extra
    record["position_ids"] += [last + 1 + i for i in range(extra)]
    record["seq_lens_padded"][-1] += extra
    return packed_sequence_thd_collater([record]), docs, starts


def logits(model, mesh, batch: dict) -> torch.Tensor:
    sharder = ContextParallelSharder(model, mesh, dict(batch))
    ctx, local = sharder.shard(dict(batch))
    with torch.no_grad(), ctx():
        out = model(**filter_forward_kwargs(model, {k: v for k, v in local.items() if k != "labels"})).logits
    if mesh is None:
        return out
    full = sharder.gather_token_tensor(out, seq_dim=1, trim=False)
    positions = sharder.shard_layout.input_token_stream_positions
    return full.gather(1, positions.clamp(min=0).unsqueeze(-1).expand(-1, -1, full.shape[-1]))


def per_document(model, docs: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for doc in docs:
        ids = torch.tensor([doc])
        batch = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
        out.append(logits(model, None, batch)[0])
    return out


def rank_main(rank: int, init_file: str, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=CP)
    mesh = DeviceMesh("cpu", torch.arange(CP), mesh_dim_names=("cp",))
    model = build()
    lines, shows = [], False
    for name, (lengths, align) in CASES.items():
        batch, docs, starts = packed_batch(lengths, align)
        cp = logits(model, mesh, batch)
        if rank != 0:
            continue
        one = logits(model, None, batch)
        alone = per_document(model, docs)
        lines.append(f"{name}: max |logit - per-document logit| per document")
        worst_one, worst_cp = 0.0, 0.0
        for d, (n, start, ref) in enumerate(zip(lengths, starts, alone), start=1):
            e_one = float((one[0, start : start + n] - ref).abs().max())
            e_cp = float((cp[0, start : start + n] - ref).abs().max())
            lines.append(
                f"  document {d} (positions {start}..{start + n - 1}): one device packed {e_one:.3g}, "
                f"CP {CP} packed {e_cp:.3g}"
            )
            worst_one, worst_cp = max(worst_one, e_one), max(worst_cp, e_cp)
        if "misaligned" in name:
            shows = worst_cp <= TOLERANCE[DTYPE] < worst_one
    if rank == 0:
        verdict = (
            "SHOWS: CP packed matches the per-document runs, one-device packed does not" if shows else "does not show"
        )
        with open(result_file, "w") as handle:
            handle.write("\n".join(lines + [verdict, "1" if shows else "0"]))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    global CASES, SEQ_LEN, DTYPE
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", help="one row's document lengths, e.g. 5,1,10,1 (default: the three cases)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    SEQ_LEN, DTYPE = args.seq_len, getattr(torch, args.dtype)
    if args.documents:
        CASES = {f"misaligned? {args.documents} in {SEQ_LEN}": ([int(n) for n in args.documents.split(",")], 1)}
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.start_processes(rank_main, args=(init_file, result_file), nprocs=CP, start_method="fork")
        *lines, flag = open(result_file).read().splitlines()
    print("\n".join(lines))
    return int(flag)


if __name__ == "__main__":
    sys.exit(main())
