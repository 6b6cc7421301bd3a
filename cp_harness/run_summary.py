"""The run summary: what a pytest session ran and found, as one typed object printed at its end.

``SUMMARY`` is this process's; the plugin adds each runner's tally when its pool closes, tests add named
counts (``count``) and notes (``note``: a contract difference found and how it is treated), and xdist
workers hand theirs to the controller as a plain dict (``as_dict`` / ``merge``), which prints the sum.
"""

from __future__ import annotations

import collections
import dataclasses

from cp_harness.cases.profiles import in_dtype_order


@dataclasses.dataclass
class RunSummary:
    """Examples per CP size, payload dtype and implementation; one-rank baselines; pool starts; named counts;
    notes; the error maps failing cases wrote."""

    by_size: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_dtype: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_impl: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    several_impls: bool = False
    baseline_runs: int = 0
    pool_starts: int = 0
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: list = dataclasses.field(default_factory=list)
    error_maps: list = dataclasses.field(default_factory=list)

    def add_runner(self, runner, *, several_impls: bool) -> None:
        """A closed runner's tally, its pool's starts (more than one per pool: a rank fault restarted it) and
        the error maps its failing cases wrote."""
        tally = runner.tally
        self.by_size.update(tally.by_size)
        self.by_dtype.update(tally.by_dtype)
        self.by_impl.update(tally.by_impl)
        self.several_impls = self.several_impls or several_impls
        self.baseline_runs += tally.baseline_runs
        self.pool_starts += runner.pool.starts
        self.error_maps.extend(runner.error_maps)
        for what, why in sorted(tally.not_judged.items()):
            self.note(f"not judged: {what} ({why})")
        for what, text in sorted(tally.standins.items()):
            self.note(f"ran on a stand-in: {what} ({text})")

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def as_dict(self) -> dict:
        """Plain data (JSON-able) for the trip from an xdist worker to the controller."""
        return {
            "by_size": {str(k): v for k, v in self.by_size.items()},
            "by_dtype": dict(self.by_dtype),
            "by_impl": dict(self.by_impl),
            "several_impls": self.several_impls,
            "baseline_runs": self.baseline_runs,
            "pool_starts": self.pool_starts,
            "counts": dict(self.counts),
            "notes": list(self.notes),
            "error_maps": list(self.error_maps),
        }

    def merge(self, data: dict) -> None:
        """Add a worker's ``as_dict``."""
        self.by_size.update({int(k): v for k, v in data.get("by_size", {}).items()})
        self.by_dtype.update(data.get("by_dtype", {}))
        self.by_impl.update(data.get("by_impl", {}))
        self.several_impls = self.several_impls or bool(data.get("several_impls"))
        self.baseline_runs += int(data.get("baseline_runs", 0))
        self.pool_starts += int(data.get("pool_starts", 0))
        self.counts.update(data.get("counts", {}))
        for text in data.get("notes", []):
            self.note(text)
        self.error_maps.extend(data.get("error_maps", []))

    @property
    def empty(self) -> bool:
        return not (self.by_size or self.counts or self.notes or self.error_maps or self.pool_starts)

    def lines(self) -> list[str]:
        """The summary's lines (the plugin prints them under its own header)."""
        out = []
        if self.by_size:
            per_size = ", ".join(f"N={n}: {self.by_size[n]}" for n in sorted(self.by_size))
            out.append(f"CP examples run: {sum(self.by_size.values())} ({per_size})")
        if self.by_dtype:
            names = in_dtype_order(self.by_dtype)
            out.append("CP examples per dtype: " + ", ".join(f"{d}: {self.by_dtype[d]}" for d in names))
        named = dict(self.counts)
        if self.several_impls:
            named.update({f"cp examples of implementation {name}": n for name, n in self.by_impl.items()})
        if self.baseline_runs:
            named["one-rank baseline runs (excess judge)"] = self.baseline_runs
        if self.pool_starts:
            named["rank pool starts"] = self.pool_starts
        out += [f"{key}: {named[key]}" for key in sorted(named)]
        out += list(self.notes)
        if self.error_maps:
            unique = list(dict.fromkeys(self.error_maps))
            out.append(f"error maps of the failing cases ({len(unique)}):")
            out += [f"  {path}" for path in unique]
        return out


SUMMARY = RunSummary()


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to this process's named counter ``name``."""
    SUMMARY.count(name, n)


def note(text: str) -> None:
    """A line for the end-of-run summary (e.g. a contract difference a test found and how it is treated)."""
    SUMMARY.note(text)
