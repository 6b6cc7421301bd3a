"""The benchmark's options (``cp_harness.bench.options``) and its package map, without a rank pool."""

from __future__ import annotations

import dataclasses
import pkgutil

import pytest

import cp_harness.bench
from cp_harness.bench.options import BenchOptions, parse_options


def test_defaults_follow_quick() -> None:
    assert parse_options([]) == BenchOptions()
    quick = parse_options(["--quick"])
    assert (quick.warm_cases, quick.warmup_cases, quick.fresh_cases) == (6, 1, 1)
    assert (quick.throughput_sizes, quick.memory_sizes, quick.memory_seq_len) == ((2,), (1, 2), 256)
    # A count given on the command line wins over the --quick default.
    assert parse_options(["--quick", "--warm-cases", "9", "--throughput-sizes", "1,2"]).warm_cases == 9


def test_options_are_frozen_and_counts_checked() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BenchOptions().quick = True  # type: ignore[misc]
    with pytest.raises(SystemExit, match="--fresh-cases must be at least 1"):
        parse_options(["--fresh-cases", "0"])


def test_package_docstring_names_every_module() -> None:
    doc = cp_harness.bench.__doc__
    for module in pkgutil.iter_modules(cp_harness.bench.__path__):
        assert f"``{module.name}``" in doc, f"cp_harness/bench/{module.name}.py is missing from the package docstring"
