"""Smoke test of the benchmark command (``python -m cp_harness bench``, ``docs/benchmarks.md``).

Runs ``bench --quick --skip-suite --skip-fresh`` in-process on the session's
warm rank pool (no second pool to start) and checks that the report has
every section and that the bundled implementation moves exactly the
analytic minimum: nothing the receiver does not need.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from cp_harness.bench.options import parse_options
from cp_harness.bench.run import run_bench


def test_bench_quick_writes_report(tmp_path: Path, cp_runner) -> None:
    path = tmp_path / "bench.json"
    options = parse_options(["--quick", "--skip-suite", "--skip-fresh", "--json", str(path), "--impl", cp_runner.impl])
    out = io.StringIO()
    code, _ = run_bench(options, stream=out, runner=cp_runner)
    text = out.getvalue()
    assert code == 0, text[-6000:]
    report = json.loads(path.read_text())
    for section in ("environment", "pool", "throughput", "communication", "memory", "suite", "targets"):
        assert section in report, f"section {section!r} missing from the report"
    assert report["suite"] == {"skipped": True}
    assert report["throughput"]["fresh"] is None

    # Both modes, each with the per-case breakdown and the overlap gained; the ratio's warm rate is the pipelined one.
    throughput = report["throughput"]
    warm, sequential = throughput["warm"]["2"], throughput["sequential"]["2"]
    assert warm["mode"] == "pipelined" and sequential["mode"] == "sequential"
    assert "pipelined" in throughput["warm_mode"]
    for mode in (warm, sequential):
        assert mode["cases"] >= 1 and mode["cases_per_second"] > 0
        assert set(mode["breakdown_ms"]) == {"ranks", "transport", "oracle", "compare"}
        assert all(v >= 0 for v in mode["breakdown_ms"].values()), mode["breakdown_ms"]
        assert mode["breakdown_ms"]["ranks"] > 0 and mode["breakdown_ms"]["oracle"] > 0
        assert isinstance(mode["overlap_gained_ms"], float)
    # Sequential: the parts add up to the wall time (nothing overlaps), within the harness's own overhead.
    assert abs(sequential["overlap_gained_ms"]) < 0.25 * sequential["mean_ms"], sequential
    for column in ("ranks ms", "transport ms", "oracle ms", "compare ms", "overlap gained ms"):
        assert column in text, column
    assert "sequential: run, then judge" in text and "pipelined: judged while the next run" in text

    comm = report["communication"]
    assert set(comm["functions"]) == {"inkling2.convolution_history", "inkling2.gather_sequence",
                                      "mistral_large4.gather_tokens", "mistral_large4.shifted_cp_loss"}
    for name, f in comm["functions"].items():
        for key in ("ratio_sent", "ratio_recv", "worst_rank_ratio_sent", "worst_rank_ratio_recv"):
            assert f[key] <= 1.0, f"{name}: {key} = {f[key]} (more moved than the receiver needs)"
        assert f["control_sent"] > 0  # the validation handshake is counted, apart from the payload
    for case in comm["cases"]:
        assert case["sent"] == case["min_sent"] and case["recv"] == case["min_recv"], case["detail"]
    assert any(c["case"]["width"] - 1 > c["case"]["shape"][1] for c in comm["cases"]
               if c["function"] == "inkling2.convolution_history"), "the grid must include histories spanning ranks"

    memory = report["memory"]["sizes"]
    assert memory["2"]["peak_bytes_max"] < memory["1"]["peak_bytes_max"]
    assert memory["2"]["saved_bytes_max"] < memory["1"]["saved_bytes_max"]
    assert any(t["name"].startswith("comm ratio") and t["ok"] for t in report["targets"])
    assert "Targets" in text and "Communication" in text and "Memory per rank" in text
