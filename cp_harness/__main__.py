"""Command line: ``python -m cp_harness <command>`` (also installed as ``cp-harness``).

Commands:

- ``verify``: the main job. Checks an implementation against the oracles on a
  warm rank pool and prints a table; exit status 1 on any failure.
- ``run-case CASE_JSON``: runs one case (as printed by a failing test) and prints its report.
- ``node``: on another node of a pool across nodes, starts that node's torchrun agent with the command
  ``verify --node-rank K`` prints (the same options give the same command), or, with ``--launcher external``,
  becomes one rank of an ``srun`` task (``docs/meshes.md``).
- ``repro CASE_JSON -o repro.py``: runs one case and, when it fails, writes its standalone repro (one script
  needing torch, numpy and the code under test only, with its ``.npz``; ``cp_harness.repro``).
- ``golden ...``: golden files (``cp_harness.golden``).
- ``bench ...``: benchmarks (``cp_harness.bench``).
"""

from __future__ import annotations

import argparse
import json
import sys

from cp_harness import options


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option comes from the one table (``cp_harness.options``)."""
    parser = argparse.ArgumentParser(
        prog="cp_harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="verify an implementation and print the report")
    options.add_cli_options(verify, "verify")
    run_case = sub.add_parser("run-case", help="run one case description and print its report")
    options.add_cli_options(run_case, "run-case")
    run_case.add_argument("case", help="the case as JSON (the 'case:' line of a failure)")
    node = sub.add_parser("node", help="start one node's torchrun agent of a pool across nodes")
    options.add_cli_options(node, "node")
    node.add_argument("--print-only", action="store_true", help="print the command instead of running it")
    repro = sub.add_parser("repro", help="write the standalone repro script of a failing case")
    options.add_cli_options(repro, "repro")
    repro.add_argument("case", help="the case as JSON (the 'case:' line of a failure)")
    repro.add_argument(
        "-o",
        "--output",
        default="repro.py",
        metavar="PATH",
        help="the script to write (its arrays go beside it as PATH.npz; default repro.py)",
    )
    return parser


def _node(values: dict, print_only: bool) -> int:
    import os
    import shlex

    from cp_harness.ranks.lifecycle import RankProcesses
    from cp_harness.ranks.outputs import PoolConfig

    pool = options.pool_options(values)
    external = values.get("launcher") == "external"  # srun: every task becomes one rank
    if not external and (pool.get("node_rank") is None or pool.get("nnodes", 1) < 2):
        print(
            "node: give --nnodes N (> 1) and --node-rank K of this node, or --launcher external (one rank per "
            "srun task)",
            file=sys.stderr,
        )
        return 2
    try:
        config = PoolConfig(
            world_size=max(values["world_sizes"]),
            backend=values["backend"],
            impl=values["impl"],
            preload=tuple(values["model_specs"]),
            **pool,
        )
        command = RankProcesses(config).node_command(config.node_rank or 0, local=False)
    except ValueError as exc:
        print(f"node: {exc}", file=sys.stderr)
        return 2
    if print_only:
        print(shlex.join(command))
        return 0
    os.execvp(sys.executable, [sys.executable, *command[1:]])  # this process becomes the node's agent


def _verify(values: dict) -> int:
    from cp_harness.verify import VerifySettings, result_text, run_verify

    result = run_verify(VerifySettings.from_options(values))
    if result.cannot_run is not None:
        print(f"cp_harness verify: cannot run: {result.cannot_run}", file=sys.stderr)
        return result.exit_code
    print(result_text(result))
    if values["json_path"]:
        import os

        directory = os.path.dirname(os.path.abspath(values["json_path"]))
        os.makedirs(directory, exist_ok=True)
        with open(values["json_path"], "w") as f:
            json.dump(result.as_dict(), f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"JSON report written to {values['json_path']}")
    return result.exit_code


def _case_runner(values: dict, text: str):
    """``(case, runner)`` for a command that runs one case, or ``(None, exit status)`` after saying what is wrong."""
    from cp_harness.judging.policy import policy_named
    from cp_harness.ranks.devices import DeviceError, check_backend
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    try:
        case = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"case is not JSON ({exc}); paste the 'case:' line of the failure", file=sys.stderr)
        return None, 2
    if not isinstance(case, dict) or "check" not in case or "world_size" not in case:
        print("case must be a JSON object with at least 'check' and 'world_size'", file=sys.stderr)
        return None, 2
    from cp_harness.cases.meshes import MeshLayout, ranks_needed

    try:
        MeshLayout.of(case)
        ranks = ranks_needed(case)  # a case on a world mesh needs every rank of the mesh
        check_backend(values["backend"], ranks)
    except (DeviceError, ValueError) as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return None, 2
    timeout = values["case_timeout"] or (300.0 if case.get("spec") else 120.0)
    return case, CaseRunner(
        PoolConfig(
            world_size=ranks,
            backend=values["backend"],
            impl=values["impl"],
            launcher=values["launcher"],
            case_timeout=timeout,
            collective_timeout=max(30.0, timeout / 2),
            preload=(case["spec"],) if case.get("spec") else (),
        ),
        policy=policy_named(values["precision_policy"]),
    )


def _run_case(values: dict, text: str) -> int:
    from cp_harness.judging.render import verdict_text

    case, runner = _case_runner(values, text)
    if case is None:
        return runner
    try:
        report = runner.run(case)
    finally:
        runner.close()
    print(verdict_text(report, values["impl"], backend=values["backend"], error_dir=values["error_dir"]))
    return 0 if report.ok else 1


def _repro(values: dict, text: str, output: str) -> int:
    """Exit status 0: the script was written; 1: the case passes (nothing to reproduce); 2: no script could be
    written (bad arguments, or a kind of failure without one: the message says why)."""
    import os

    from cp_harness.cases.implementation import impl_names
    from cp_harness.judging.render import failure_message

    stem = os.path.splitext(os.path.basename(output))[0]
    if stem in {name.split(".")[0] for name in impl_names(values["impl"])}:
        print(
            f"-o {output}: run as a script, its folder comes first on sys.path, so `import {stem}` would import "
            f"the script instead of the module under test; name it otherwise (e.g. {stem}-repro.py)",
            file=sys.stderr,
        )
        return 2
    case, runner = _case_runner(values, text)
    if case is None:
        return runner
    try:
        report = runner.run(case)
        if report.ok:
            print(f"the case passes against {values['impl']!r}: nothing to reproduce, no script written")
            return 1
        directory, name = os.path.dirname(os.path.abspath(output)), os.path.splitext(os.path.basename(output))[0]
        exported = runner.export_repro(case, report, directory, name=name)
    finally:
        runner.close()
    print(failure_message(case, report, values["impl"], backend=values["backend"]))
    print(exported.line() + (f" ({exported.note})" if exported.note else ""))
    return 0 if exported.path else 2


# Commands implemented by their own module's ``main(argv) -> int``.
_DELEGATED = {"golden": "cp_harness.golden", "bench": "cp_harness.bench"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        return int(importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    values = options.from_cli(args)  # the one read of the environment ($CP_IMPL, $CP_HARNESS_ERROR_MAP_DIR)
    if args.command == "verify":
        return _verify(values)
    if args.command == "run-case":
        return _run_case(values, args.case)
    if args.command == "node":
        return _node(values, args.print_only)
    if args.command == "repro":
        return _repro(values, args.case, args.output)
    return 2


if __name__ == "__main__":
    sys.exit(main())
