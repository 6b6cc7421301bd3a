"""Command line: ``python -m cp_harness <command>`` (also installed as ``cp-harness``).

Commands:

- ``verify``: the main job. Checks an implementation against the oracles on a
  warm rank pool and prints a table; exit status 1 on any failure.
- ``run-case CASE_JSON``: runs one case (as printed by a failing test) and prints its report.
- ``golden ...``: golden files (``cp_harness.golden``).
- ``bench ...``: benchmarks (``cp_harness.bench``).
"""

from __future__ import annotations

import argparse
import json
import sys


def _world_sizes(text: str) -> tuple[int, ...]:
    from cp_harness.cases.descriptions import parse_world_sizes

    try:
        return parse_world_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _dtypes(text: str) -> tuple[str, ...]:
    from cp_harness.cases.strategies import ALL_DTYPES

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in ALL_DTYPES + ("layout",)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(ALL_DTYPES + ('layout',))}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", default=None, help="module exposing inkling2 and mistral_large4 (default: $CP_IMPL or cp_impl)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="gloo on CPU, nccl with one GPU per rank")
    p.add_argument("--precision-policy", default="strict", choices=("strict", "payload"),
                   help="strict: every bfloat16/float16 sum accumulates in float32 and rounds once (the contract); "
                        "payload: partial sums may stay in the payload's precision, as a backend's reduce-scatter "
                        "does, within N-1 ULPs (cp_harness/judging/policy.py)")
    p.add_argument("--launcher", default=None, choices=("fork", "torchrun"),
                   help="how the ranks start: forked from one process that imported torch and the implementation "
                        "(default for gloo), or by torchrun (default for nccl; use it if importing your "
                        "implementation starts threads)")
    p.add_argument("--error-maps", dest="error_dir", default=None, metavar="DIR",
                   help="where failing cases write error-map PNGs (default: $CP_HARNESS_ERROR_MAP_DIR, "
                        "else <temp>/cp-harness-error-maps)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cp_harness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    verify = sub.add_parser("verify", help="verify an implementation and print the report")
    _add_common(verify)
    verify.add_argument("--world-sizes", type=_world_sizes, default=(1, 2, 3, 4, 8),
                        help="CP sizes the cases use, e.g. 1,2,3,4,8 (the pool starts max ranks; default 1,2,3,4,8)")
    verify.add_argument("--examples", type=_positive, default=25, help="generated examples per row (default 25)")
    verify.add_argument("--model", default=None, metavar="MODULE",
                        help="model spec module(s), comma-separated: run the real-model rows (the framework's own CP "
                             "path against the same model on one device) instead of the implementation's rows")
    verify.add_argument("--seed", type=int, default=0, help="seed of the example generator (default 0)")
    verify.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the report as JSON")
    verify.add_argument("--dtypes", type=_dtypes, default=None, metavar="DTYPES",
                        help="only cases of these payload dtypes, e.g. bfloat16,float16 (float64, float32, bfloat16, "
                             "float16, int64, int32, bool; layout: the rows without a floating payload); rows that "
                             "draw none of them are left out (default: all)")
    verify.add_argument("--rows", type=lambda t: tuple(x for x in t.split(",") if x), default=(), metavar="TEXT",
                        help="only the rows whose name contains one of these comma-separated texts")
    verify.add_argument("--shrink-seconds", type=float, default=None, metavar="SECONDS",
                        help="time a failing row may spend shrinking its failure to a small case (default 20)")

    run_case = sub.add_parser("run-case", help="run one case description and print its report")
    _add_common(run_case)
    run_case.add_argument("case", help="the case as JSON (the 'case:' line of a failure)")

    return parser


# Commands implemented by their own module's ``main(argv) -> int``.
_DELEGATED = {"golden": "cp_harness.golden", "bench": "cp_harness.bench"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        return int(importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    from cp_harness.cases.implementation import selected_impl_name

    from cp_harness.judging.policy import policy_named

    impl = selected_impl_name(args.impl)
    if args.command == "verify":
        from cp_harness.verify import SHRINK_SECONDS, run_verify

        shrink = SHRINK_SECONDS if args.shrink_seconds is None else args.shrink_seconds
        return run_verify(impl=impl, world_sizes=args.world_sizes, examples=args.examples, backend=args.backend,
                          launcher=args.launcher, seed=args.seed, json_path=args.json_path, error_dir=args.error_dir,
                          shrink_seconds=shrink, dtypes=args.dtypes, row_names=args.rows, model=args.model,
                          policy=policy_named(args.precision_policy))
    if args.command == "run-case":
        from cp_harness.ranks.pool import PoolConfig
        from cp_harness.judging.render import verdict_text
        from cp_harness.runner import CaseRunner

        try:
            case = json.loads(args.case)
        except json.JSONDecodeError as exc:
            print(f"case is not JSON ({exc}); paste the 'case:' line of the failure", file=sys.stderr)
            return 2
        if not isinstance(case, dict) or "check" not in case or "world_size" not in case:
            print("case must be a JSON object with at least 'check' and 'world_size'", file=sys.stderr)
            return 2
        from cp_harness.ranks.devices import DeviceError, check_backend

        try:
            check_backend(args.backend, int(case["world_size"]))
        except DeviceError as exc:
            print(f"cannot run: {exc}", file=sys.stderr)
            return 2
        runner = CaseRunner(PoolConfig(world_size=int(case["world_size"]), backend=args.backend, impl=impl,
                                       launcher=args.launcher), policy=policy_named(args.precision_policy))
        try:
            report = runner.run(case)
        finally:
            runner.close()
        print(verdict_text(report, impl, backend=args.backend, error_dir=args.error_dir))
        return 0 if report.ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
