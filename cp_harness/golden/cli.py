"""``python -m cp_harness golden check|update|list`` (``docs/golden.md``)."""

from __future__ import annotations

import argparse
import os
import sys

from cp_harness import options
from cp_harness.cases.descriptions import canonical
from cp_harness.golden.comparison import verify
from cp_harness.golden.contents import CASES, GOLDEN_DIR, REGENERATE, GoldenError
from cp_harness.golden.regeneration import _runner, stale_folders, update
from cp_harness.golden.storage import load


def _select(pattern: str | None) -> list[str]:
    names = [n for n in CASES if not pattern or pattern in n]
    if not names:
        raise SystemExit(f"no golden case name contains {pattern!r}; known: {', '.join(CASES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_harness golden", description="golden files (docs/golden.md)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in (
        ("check", "compare the current oracle and implementation with the golden files"),
        ("update", "regenerate the golden files that changed (CPU, gloo) and print what changed"),
        ("list", "list the canonical cases"),
    ):
        p = sub.add_parser(command, help=text)
        if command == "list":
            continue
        p.add_argument("-k", dest="pattern", default=None, help="only cases whose name contains this")
        p.add_argument(
            "--dir", default=None, help=f"golden folder (default: $CP_HARNESS_GOLDEN_DIR, else {GOLDEN_DIR})"
        )
        options.add_cli_options(p, "golden")
        if command == "check":
            p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
            p.add_argument(
                "--storage-only", action="store_true", help="verify the files and the oracle; start no ranks"
            )
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, case in CASES.items():
            print(f"{name}: {canonical(case)}")
        return 0
    impl = options.from_cli(args)["impl"]  # the one read of $CP_IMPL
    args.dir = args.dir or os.environ.get("CP_HARNESS_GOLDEN_DIR") or str(GOLDEN_DIR)
    names = _select(args.pattern)
    if args.command == "update":
        try:
            update(names if args.pattern else None, args.dir, impl=impl)
        except GoldenError as exc:
            print(f"golden update failed: {exc}", file=sys.stderr)
            return 1
        return 0
    failures = 0
    stale = stale_folders(args.dir)
    if stale and not args.pattern:
        print(
            f"FAIL stale golden folders (not in cp_harness.golden.CASES): {', '.join(stale)}; regenerate with: {REGENERATE}"
        )
    runner = None if args.storage_only else _runner(impl, args.backend, names)
    # Pipelined: the ranks run the next cases while this one is checked.
    runs = None if runner is None else runner.run_outputs_many([CASES[name] for name in names])
    try:
        for name in names:
            outputs = None if runs is None else next(runs)
            try:
                golden = load(name, args.dir)
                verdict = verify(golden, outputs, implementation=impl, backend=args.backend)
            except GoldenError as exc:
                print(f"FAIL {name}: {exc}")
                failures += 1
                continue
            if verdict.ok:
                same = {True: ", bit-identical", False: ", within budget (not bit-identical)", None: ""}[
                    verdict.bit_identical
                ]
                print(f"ok   {name} ({len(verdict.comparisons)} comparisons{same})")
            else:
                print(f"FAIL {verdict.format()}")
                failures += 1
    finally:
        if runner is not None:
            runner.close()
    print(f"{len(names) - failures} of {len(names)} golden cases match")
    return 1 if failures or (stale and not args.pattern) else 0
