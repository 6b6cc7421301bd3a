"""Benchmarks: harness throughput and communication volume against their limits.

``python -m cp_harness bench [--json PATH] [--quick] [--skip-suite] [--skip-fresh] ...``

One run measures, on this machine and under the same load:

- **throughput**: verified CP cases per second on the warm rank pool for the
  standard case (a miniature-model forward and backward on every rank plus
  the float64 oracle comparison; Inkling2-mini, batch 2, sequence 64,
  float64, packed rows) at each CP size, in two modes: sequential (run the
  case, then judge it: the ranks idle while the test process judges) and
  pipelined (``CaseRunner.run_many``: the oracle runs while the ranks work and
  the next cases are queued on the ranks while one is judged); per case where
  the time goes (ranks, pool transport, oracle, comparison) and the overlap
  gained (the parts' sum minus the wall time per case); the pool's own floor
  (a case that only all-reduces one number); and the naive way: a fresh
  ``torchrun`` per case (start a 2-rank pool, run the case, judge it, shut the
  pool down), each followed by at least as long of warm 2-rank cases in each
  mode, so that the rates are sampled under the same load. The ratio of the
  pipelined warm rate to the fresh rate at 2 ranks is the number the target
  is about.
- **communication**: for a grid of cases of every documented collective
  function (``convolution_history`` over widths, CP sizes and local lengths,
  both gathers in both float dtypes, differentiable and not, plus integer and
  bool payloads, ``shifted_cp_loss``), the bytes each rank sent and received
  (counted at the dispatcher by ``cp_harness.instruments.comm_meter``)
  against the analytic minimum of that call (``cp_harness.judging.comm_minimum``),
  payload and validation control messages apart.
- **memory**: per-rank peak tensor memory and saved-activation bytes of the
  miniature model's forward and backward on a long sequence at several CP
  sizes (check ``bench_memory``).
- **suite**: examples run and wall time of the full CPU test command.

It prints one table per section and a targets table (measured vs target,
PASS or MISS with the factor) and writes everything as JSON. The exit status
is 1 when a case fails its check (or ``--fail-on-miss`` and a target is
missed), else 0. See ``docs/benchmarks.md``.

Modules
-------
* ``options`` -- ``BenchOptions`` and the command line parsed into it, in one place.
* ``cases`` -- the cases it times: the standard model case, the pool's floor, the long memory case.
* ``timed_runs`` -- running cases for the clock (sequential, pipelined, fresh torchrun) and their summary.
* ``throughput`` -- warm pool rate per CP size against a fresh ``torchrun`` per case.
* ``communication`` -- bytes each rank moved against the analytic minimum of each documented call.
* ``memory`` -- per-rank peak memory and saved activations at several CP sizes.
* ``suite`` -- examples run and wall time of the full CPU test command.
* ``targets`` -- the issue's limits and each measurement against them.
* ``progress`` -- timestamped progress lines on stderr.
* ``report`` -- the text tables and the JSON report.
* ``run`` -- one run: the selected sections on one warm pool, the suite, the targets, the report.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m cp_harness bench ARGS``: parse ``argv`` into ``BenchOptions``, run, return the exit status."""
    from cp_harness.bench.options import parse_options

    options = parse_options(argv)
    from cp_harness.bench.run import run_bench

    code, _ = run_bench(options)
    return code
