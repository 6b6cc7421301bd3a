"""The one option table: every setting the command line (``python -m cp_harness ...``) and the pytest plugin
(``--cp-...``) take, declared once, with its type, default, help and the environment variable (if any) that
gives its default. Both entry points build their options from ``OPTIONS`` and read the environment here, once,
at the boundary (``resolve``); nothing inside the package reads an environment variable for its configuration.

An option says which entry points take it: ``commands`` (the CLI subcommands: ``verify``, ``run-case``,
``calibrate``, ``repro``, ``node``) and ``plugin`` (pytest, as ``--cp-<name>`` unless ``plugin_flag`` says otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_IMPL = "cp_impl"


def _world_sizes(text: str) -> tuple[int, ...]:
    from cp_harness.cases.descriptions import parse_world_sizes

    try:
        return parse_world_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated positive integers, e.g. 1,2,3,4,8 ({exc})"
        ) from exc


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


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _address(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT, e.g. node0.cluster:29400")
    return text


def _node_rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a node rank 0..nnodes-1")
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting. ``dest``: its name in the parsed settings; ``flag``: the CLI flag; ``parse``: text -> value
    (also applied to a default given as text); ``env``: the environment variable whose value is the default
    when the option is not given (read by ``resolve`` only)."""

    dest: str
    flag: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flag_only: bool = False  # a switch (store_true)
    commands: frozenset[str] = frozenset()
    plugin: bool = False
    plugin_flag: str | None = None
    env: str | None = None
    metavar: str | None = None

    @property
    def pytest_flag(self) -> str:
        return self.plugin_flag or "--cp-" + self.flag.removeprefix("--")

    def _kwargs(self) -> dict[str, Any]:
        if self.flag_only:
            return {"action": "store_true", "default": False, "help": self.help}
        shown = "" if self.default in (None, ()) or "default" in self.help else f" (default {self.default})"
        kwargs: dict[str, Any] = {"default": None, "help": self.help + shown}
        if self.parse is not None:
            kwargs["type"] = self.parse
        if self.choices is not None:
            kwargs["choices"] = self.choices
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        return kwargs


_VERIFY, _RUN_CASE, _CALIBRATE, _REPRO, _NODE = "verify", "run-case", "calibrate", "repro", "node"
_ALL = frozenset({_VERIFY, _RUN_CASE, _CALIBRATE, _REPRO})
_POOL = frozenset({_VERIFY, _NODE})  # where the ranks run (docs/meshes.md: a pool across nodes)

OPTIONS: tuple[Option, ...] = (
    Option(
        "impl",
        "--impl",
        "module exposing inkling2 and mistral_large4 (default: $CP_IMPL, else cp_impl); "
        "MODULE,MODULE,... judges several in one run (each sharder-using case draws one; the first is the "
        "primary one)",
        DEFAULT_IMPL,
        commands=_ALL | {"golden", "bench", _NODE},
        plugin=True,
        env="CP_IMPL",
        metavar="MODULE",
    ),
    Option(
        "world_sizes",
        "--world-sizes",
        "CP sizes the cases use, e.g. 1,2,3,4,8 (the pool starts max ranks)",
        "1,2,3,4,8",
        _world_sizes,
        commands=frozenset({_VERIFY, _CALIBRATE, _NODE}),
        plugin=True,
        metavar="SIZES",
    ),
    Option(
        "backend",
        "--backend",
        "process-group backend of the ranks: gloo on CPU, nccl with one GPU per rank",
        "gloo",
        choices=("gloo", "nccl"),
        commands=_ALL | {_NODE},
        plugin=True,
    ),
    Option(
        "launcher",
        "--launcher",
        "how the ranks start: forked from one process that imported torch and the "
        "implementation (default for gloo on one node), by torchrun (default for nccl and for --nnodes > 1; use it "
        "if importing the implementation starts threads), or external: started elsewhere (srun), they connect to "
        "--listen",
        None,
        choices=("fork", "torchrun", "external"),
        commands=_ALL | {_NODE},
        plugin=True,
    ),
    Option(
        "nnodes",
        "--nnodes",
        "nodes the ranks are spread over (torchrun agents with the c10d rendezvous, or srun); "
        "the largest world size is split evenly",
        1,
        _positive,
        commands=_POOL,
        plugin=True,
        metavar="N",
    ),
    Option(
        "node_rank",
        "--node-rank",
        "start only this node's torchrun agent here and print the command for the "
        "others (default with --nnodes > 1: every node's agent on this machine)",
        None,
        _node_rank,
        commands=_POOL,
        plugin=True,
        metavar="K",
    ),
    Option(
        "rdzv_endpoint",
        "--rdzv-endpoint",
        "the c10d rendezvous of the torchrun agents (default: this machine, a "
        "free port; required when other nodes start their own agent)",
        None,
        _address,
        commands=_POOL,
        plugin=True,
        metavar="HOST:PORT",
    ),
    Option(
        "listen",
        "--listen",
        "the address this process accepts the ranks on (default 127.0.0.1, a free port; "
        "required when ranks start elsewhere: an address of this machine every node reaches)",
        None,
        _address,
        commands=_POOL,
        plugin=True,
        metavar="HOST:PORT",
    ),
    Option(
        "rank_order",
        "--rank-order",
        "blocked: the launcher's numbering (node k holds a block of ranks); cyclic: "
        "rank r on node r %% nnodes, so that CP groups interleave the nodes",
        "blocked",
        choices=("blocked", "cyclic"),
        commands=_POOL,
        plugin=True,
    ),
    Option(
        "precision_policy",
        "--precision-policy",
        "strict: every bfloat16/float16 sum accumulates in float32 and "
        "rounds once (the contract); payload: partial sums may stay in the payload's precision, as a backend's "
        "reduce-scatter does, within N-1 ULPs (cp_harness/judging/policy.py)",
        "strict",
        choices=("strict", "payload"),
        commands=frozenset({_VERIFY, _RUN_CASE, _REPRO}),
        plugin=True,
    ),
    Option(
        "model_specs",
        "--model",
        "model spec module(s), comma-separated: the real-model rows (the framework's own CP "
        "path against the same model on one device); the ranks import them once, before they are forked",
        (),
        _names,
        commands=frozenset({_VERIFY, _NODE}),
        plugin=True,
        metavar="MODULE",
    ),
    Option(
        "step",
        "--step",
        "with --model: forward-backward judges the model's CP forward and backward against one "
        "device (the real-model rows); training judges one training step as the recipe runs it on dp_shard x cp = "
        "2 x 2 (FSDP2 over dp_shard_cp, the recipe's loss scaling, the clip-grad norm; --world-sizes 4; "
        "docs/training_step.md)",
        "forward-backward",
        choices=("forward-backward", "training"),
        commands=frozenset({_VERIFY}),
    ),
    Option(
        "error_dir",
        "--error-maps",
        "where failing cases write error-map PNGs (default: "
        "$CP_HARNESS_ERROR_MAP_DIR, else <temp>/cp-harness-error-maps)",
        None,
        commands=_ALL,
        plugin=True,
        env="CP_HARNESS_ERROR_MAP_DIR",
        metavar="DIR",
    ),
    Option(
        "export_repros",
        "--export-repros",
        "write a standalone repro (one script, torch, numpy and the code under "
        "test only, with its .npz) for every failing case into DIR; the report names each script "
        "(cp_harness/repro)",
        None,
        commands=frozenset({_VERIFY}),
        plugin=True,
        metavar="DIR",
    ),
    Option(
        "examples", "--examples", "generated examples per row", 25, _positive, commands=frozenset({_VERIFY, _CALIBRATE})
    ),
    Option(
        "seed",
        "--seed",
        "seed of the example generator: same seed, same cases",
        0,
        int,
        commands=frozenset({_VERIFY, _CALIBRATE}),
    ),
    Option(
        "json_path",
        "--json",
        "also write the report as JSON",
        None,
        commands=frozenset({_VERIFY, _CALIBRATE}),
        metavar="PATH",
    ),
    Option(
        "dtypes",
        "--dtypes",
        "only cases of these payload dtypes, e.g. bfloat16,float16 (float64, float32, "
        "bfloat16, float16, int64, int32, bool; layout: the rows without a floating payload); rows that draw "
        "none of them are left out (default: all)",
        None,
        _dtypes,
        commands=frozenset({_VERIFY, _CALIBRATE}),
        metavar="DTYPES",
    ),
    Option(
        "rows",
        "--rows",
        "only the rows whose name contains one of these comma-separated texts",
        (),
        _names,
        commands=frozenset({_VERIFY, _CALIBRATE}),
        metavar="TEXT",
    ),
    Option(
        "shrink_seconds",
        "--shrink-seconds",
        "time a failing row may spend shrinking its failure to a small case",
        20.0,
        float,
        commands=frozenset({_VERIFY}),
        metavar="SECONDS",
    ),
    Option(
        "case_timeout",
        "--case-timeout",
        "seconds one case may run on the ranks before they count as hung "
        "(default 120; 300 for real models: a rank's first case of a model builds and compiles it)",
        None,
        float,
        commands=_POOL | {_RUN_CASE, _REPRO},
        plugin=True,
        metavar="SECONDS",
    ),
    Option(
        "update_golden",
        "--update-golden",
        "rewrite golden files whose content changed (see docs/golden.md)",
        False,
        flag_only=True,
        plugin=True,
        plugin_flag="--update-golden",
    ),
    Option(
        "summary_json",
        "--summary-json",
        "also write the run summary (and pytest's outcome counts and duration) to PATH as JSON",
        None,
        plugin=True,
        metavar="PATH",
    ),
)
BY_DEST = {o.dest: o for o in OPTIONS}


def add_cli_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of CLI subcommand ``command``, from the table."""
    for option in OPTIONS:
        if command in option.commands:
            parser.add_argument(option.flag, dest=option.dest, **option._kwargs())


def add_pytest_options(group) -> None:
    """The plugin's options (``--cp-...``), from the table (``group``: a pytest option group)."""
    for option in OPTIONS:
        if option.plugin:
            group.addoption(option.pytest_flag, dest=f"cp_{option.dest}", **option._kwargs())


def resolve(given: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every option's value: as given (not ``None``), else its environment variable's, else its default (text
    defaults parsed like a given value). ``environ`` defaults to ``os.environ``: the one read of the environment
    for configuration."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for dest, option in BY_DEST.items():
        value = given.get(dest)
        if value is None and option.env and environ.get(option.env):
            value = option.parse(environ[option.env]) if option.parse else environ[option.env]
        if value is None:
            value = option.default
            if isinstance(value, str) and option.parse is not None and option.dest != "impl":
                value = option.parse(value)
        out[dest] = value
    return out


def from_cli(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of a parsed command line (options the subcommand does not take keep their defaults)."""
    return resolve(vars(args), environ)


def from_pytest(config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of a pytest run (``config``: pytest's ``Config``)."""
    given = {o.dest: config.getoption(f"cp_{o.dest}") for o in OPTIONS if o.plugin}
    return resolve(given, environ)


def pool_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``PoolConfig`` fields the resolved options set (how the ranks start and where), for every entry point."""
    out = {
        key: values[key]
        for key in ("launcher", "nnodes", "node_rank", "rdzv_endpoint", "listen", "rank_order")
        if values.get(key) is not None
    }
    if values.get("case_timeout") is not None:
        out["case_timeout"] = float(values["case_timeout"])
    return out
