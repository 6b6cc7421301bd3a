"""The memory section: per-rank peak memory of the miniature model's forward and backward at several CP sizes.

One long packed row (``cases.memory_case``) runs at each of ``--memory-sizes``
under check ``bench_memory``, which reports per rank the peak tensor memory
(forward, and forward plus backward), the bytes saved for the backward and,
on CUDA, the allocator's peak. CP should make each rank's share fall as N grows.
"""

from __future__ import annotations

import time

from cp_harness.bench.cases import memory_case
from cp_harness.bench.options import BenchOptions
from cp_harness.bench.progress import log
from cp_harness.bench.timed_runs import judge_case

# A long sequence at N=1 can take minutes on a loaded CPU; the runner's usual case timeout is shorter.
_MIN_TIMEOUT_S = 900.0


def measure(runner, options: BenchOptions) -> dict:
    rows: dict[str, dict] = {}
    for n in sorted(options.memory_sizes):
        case = memory_case(n, options.memory_seq_len, options.memory_dtype)
        log(f"memory: {options.memory_seq_len} tokens at N={n}")
        started = time.perf_counter()
        report = judge_case(runner.pool, case, timeout=max(runner.config.case_timeout, _MIN_TIMEOUT_S))
        per_rank = report.info["per_rank"]
        rows[str(n)] = {
            "per_rank": per_rank,
            "seconds": time.perf_counter() - started,
            "peak_bytes_max": max(r["peak_bytes"] for r in per_rank),
            "forward_peak_bytes_max": max(r["forward_peak_bytes"] for r in per_rank),
            "saved_bytes_max": max(r["saved_bytes"] for r in per_rank),
        }
        if "cuda_peak_bytes" in per_rank[0]:
            rows[str(n)]["cuda_peak_bytes_max"] = max(r["cuda_peak_bytes"] for r in per_rank)
    base = rows.get("1")
    for row in rows.values():
        if base:
            row["peak_vs_n1"] = row["peak_bytes_max"] / base["peak_bytes_max"]
            row["saved_vs_n1"] = row["saved_bytes_max"] / base["saved_bytes_max"]
    peaks = [rows[k]["peak_bytes_max"] for k in sorted(rows, key=int)]
    return {
        "seq_len": options.memory_seq_len,
        "batch": 1,
        "dtype": options.memory_dtype,
        "model": "inkling2",
        "case": memory_case(1, options.memory_seq_len, options.memory_dtype),
        "sizes": rows,
        "falls_with_cp": all(a > b for a, b in zip(peaks, peaks[1:])),
    }
