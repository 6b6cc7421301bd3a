"""The benchmark's options: one frozen ``BenchOptions``, parsed from the command line in one place.

Every section receives the same ``BenchOptions``; nothing reads ``argparse``
output or changes an option after :func:`parse_options` returns. Counts left
out on the command line take their default from ``--quick`` (small counts and
a small grid for the smoke test, full counts otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses

DEFAULT_JSON = "reports/bench.json"

# Defaults of the counts that --quick shrinks: (full run, --quick).
_COUNT_DEFAULTS = {
    "warm_cases": (60, 6),
    "warmup_cases": (3, 1),
    "fresh_cases": (3, 1),
    "throughput_sizes": ((1, 2, 4, 8), (2,)),
    "memory_sizes": ((1, 2, 4), (1, 2)),
    "memory_seq_len": (4096, 256),
}
# Counts that must be at least 1: a rate over no cases, or a repeat check over no repeats, means nothing.
_AT_LEAST_ONE = ("warm_cases", "fresh_cases", "comm_repeats")


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What one benchmark run measures and where it writes; the defaults are those of a full run."""

    json_path: str | None = DEFAULT_JSON
    quick: bool = False
    impl: str = "cp_impl"  # the command line resolves --impl / $CP_IMPL (cp_harness.options)
    backend: str = "gloo"
    skip_throughput: bool = False
    skip_fresh: bool = False
    skip_comm: bool = False
    skip_memory: bool = False
    skip_suite: bool = False
    warm_cases: int = 60
    warmup_cases: int = 3
    fresh_cases: int = 3
    throughput_sizes: tuple[int, ...] = (1, 2, 4, 8)
    comm_repeats: int = 1
    memory_sizes: tuple[int, ...] = (1, 2, 4)
    memory_seq_len: int = 4096
    memory_dtype: str = "float32"
    suite_cmd: str = "./scripts/test"
    fail_on_miss: bool = False

    def __post_init__(self) -> None:
        for key in _AT_LEAST_ONE:
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be at least 1")


def _sizes(text: str) -> tuple[int, ...]:
    from cp_harness.cases.descriptions import parse_world_sizes

    try:
        return parse_world_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _description() -> str:
    """The package docstring up to its module map: what the command measures, for ``--help``."""
    import ast
    from pathlib import Path

    package = ast.get_docstring(ast.parse((Path(__file__).parent / "__init__.py").read_text())) or ""
    return package.split("\nModules\n")[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cp_harness bench", description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=DEFAULT_JSON,
        metavar="PATH",
        help=f"where to write the JSON report (default {DEFAULT_JSON})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small counts and a small grid (the smoke test); numbers are then only indicative",
    )
    from cp_harness import options

    options.add_cli_options(p, "bench")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--skip-throughput", action="store_true", help="leave out the warm-pool throughput section")
    p.add_argument("--skip-fresh", action="store_true", help="leave out the fresh-torchrun-per-case baseline")
    p.add_argument("--skip-comm", action="store_true", help="leave out the communication section")
    p.add_argument("--skip-memory", action="store_true", help="leave out the memory section")
    p.add_argument("--skip-suite", action="store_true", help="leave out the full CPU test command")
    p.add_argument(
        "--warm-cases",
        type=int,
        default=None,
        help="timed warm cases per CP size (default 60; quick 6); at N=2 with the fresh baseline, at least "
        "as many as fit in the time the fresh torchruns took",
    )
    p.add_argument(
        "--warmup-cases", type=int, default=None, help="untimed warm-up cases per CP size (default 3; quick 1)"
    )
    p.add_argument("--fresh-cases", type=int, default=None, help="fresh-torchrun cases (default 3; quick 1)")
    p.add_argument(
        "--throughput-sizes",
        type=_sizes,
        default=None,
        help="CP sizes of the warm throughput (default 1,2,4,8; 1 is the no-collective reference; quick 2)",
    )
    p.add_argument("--comm-repeats", type=int, default=1, help="runs of the communication grid (counts must not vary)")
    p.add_argument(
        "--memory-sizes", type=_sizes, default=None, help="CP sizes of the memory section (default 1,2,4; quick 1,2)"
    )
    p.add_argument(
        "--memory-seq-len", type=int, default=None, help="tokens of the memory case (default 4096; quick 256)"
    )
    p.add_argument("--memory-dtype", default="float32", choices=("float32", "float64"))
    p.add_argument(
        "--suite-cmd",
        default="./scripts/test",
        help="the full CPU test command, run from the repository root (default ./scripts/test)",
    )
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a target is missed")
    return p


def options_from_namespace(args: argparse.Namespace) -> BenchOptions:
    """``BenchOptions`` from parsed arguments: counts not given take their ``--quick`` or full-run default.

    A count below its minimum exits with the option's name, as argparse does for a malformed value.
    """
    from cp_harness import options

    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(BenchOptions)}
    values["impl"] = options.from_cli(args)["impl"]  # the one read of $CP_IMPL
    for key, (full, quick) in _COUNT_DEFAULTS.items():
        if values[key] is None:
            values[key] = quick if args.quick else full
    try:
        return BenchOptions(**values)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def parse_options(argv: list[str] | None = None) -> BenchOptions:
    """The command line (``sys.argv[1:]`` when ``argv`` is None) as ``BenchOptions``."""
    return options_from_namespace(build_parser().parse_args(argv))
