"""The stand-in ``te_thd_partition_cpu`` (one process): Transformer Engine's THD partition-index kernel against the
partition written out here document by document (``2N`` equal chunks of each padded document, rank ``r`` holding
chunks ``r`` and ``2N-1-r``, documents in order), its behaviour past the last document (the kernel's search keeps
such slots in the last document), the checks the kernel makes (``RuntimeError``), and the install: the module
exists only inside the block, holds only this function, and a real TE is left alone."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys

import pytest
import torch

from cp_harness import standins
from cp_harness.standins import te_thd_partition_cpu
from cp_harness.standins.te_thd_partition_cpu import MODULE, thd_get_partitioned_indices

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(MODULE) is not None, reason="Transformer Engine is installed: its kernel is the real one"
)


def _by_documents(padded: list[int], n: int, rank: int) -> list[int]:
    out, start = [], 0
    for length in padded:
        chunk = length // (2 * n)
        for c in (rank, 2 * n - 1 - rank):
            out += list(range(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_each_rank_holds_chunks_r_and_2n_minus_1_minus_r_of_every_document(n):
    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        padded = [
            2 * n * int(k) for k in torch.randint(1, 4, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        ]
        cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        held = []
        for rank in range(n):
            got = thd_get_partitioned_indices(cu, total, n, rank)
            assert got.dtype == torch.int32 and got.shape == (total // n,)
            assert got.tolist() == _by_documents(padded, n, rank), (padded, n, rank)
            held += got.tolist()
        assert sorted(held) == list(range(total))  # a partition of the stream


def test_slots_past_the_last_document_continue_its_second_chunk_as_the_kernel_computes():
    """A stream of 12 tokens whose documents end at 8 (N = 2): the kernel's binary search never leaves the last
    document, so the slots past it continue that document's second chunk (indices 8, 9 on rank 0)."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert thd_get_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 9]
    assert thd_get_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.tensor([0, 8], dtype=torch.int64), 8, 2, 0), "int32"),
        ((torch.tensor([0, 6], dtype=torch.int32), 8, 2, 0), "boundary must be divisible by 2 * world_size = 4"),
        ((torch.tensor([0, 8], dtype=torch.int32), 10, 2, 0), "total_tokens 10"),
        ((torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2), "rank 2 outside world_size 2"),
        ((torch.tensor([8], dtype=torch.int32), 8, 2, 0), "at least 2 entries"),
    ],
)
def test_the_kernels_checks_raise(args, words):
    with pytest.raises(RuntimeError, match=re.escape(words)):
        thd_get_partitioned_indices(*args)


def test_the_module_exists_only_inside_the_stand_in_and_holds_only_the_partition():
    with pytest.raises(ImportError):
        importlib.import_module(MODULE)
    before = te_thd_partition_cpu.TE_THD_PARTITION_CPU.calls()
    with standins.entered(["te_thd_partition_cpu"], "cpu") as record:
        tex = importlib.import_module(MODULE)
        assert tex.thd_get_partitioned_indices(torch.tensor([0, 4], dtype=torch.int32), 4, 2, 1).tolist() == [1, 2]
        with pytest.raises(AttributeError, match="needs Transformer Engine"):
            tex.fused_attn_fwd  # noqa: B018 - any other TE symbol
        assert record.used() == {"te_thd_partition_cpu": te_thd_partition_cpu.TE_THD_PARTITION_CPU.description}
    assert MODULE not in sys.modules and te_thd_partition_cpu.TE_THD_PARTITION_CPU.calls() == before + 1
    with standins.entered(["te_thd_partition_cpu"], "cuda"):  # another device: the real kernel's, not entered
        assert MODULE not in sys.modules
