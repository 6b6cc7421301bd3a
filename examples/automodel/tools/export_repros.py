"""The standalone repros of the documented framework defects (``known_defects.json``), as the harness exports them.

One script per documented row, in ``repro/exported/`` (``<defect>-<adapter>-<verify row id>.py`` and its
``.npz``): each runs the row's documented case without the harness (torch, numpy and nemo-automodel; the
adapter's translation copied in), exits 1 while the defect is there and 0 with ``--impl cp_impl`` (or ``--fixed``
for the gathers: ``FixedGather``, the fix proposed upstream). D1's model case is narrowed to the gather whose
gradient is wrong, with the inputs and the permuted upstream gradient it received in the model run.

    python -m examples.automodel.tools.export_repros            # rewrite examples/automodel/repro/exported/
    python -m examples.automodel.tools.export_repros --check    # exit 1 when a committed file is not what is written now

Run from the repository root (the scripts' run lines name paths relative to it). ``tests/repro`` checks that
the committed files are current and that each fails and passes as said.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.automodel.tools.defects import load_known

EXPORTED = Path(__file__).resolve().parents[1] / "repro" / "exported"


def _row_ids() -> dict[str, str]:
    from cp_harness.verify import default_rows

    return {row.name: row.id for row in default_rows()}


def entries() -> list[dict]:
    """The documented rows an adapter reaches (a spec's defect has no entry yet), each with its script's name."""
    ids = _row_ids()
    return [{**e, "name": f"{e['id']}-{e['adapter']}-{ids[e['row']]}"} for e in load_known() if "adapter" in e]


def export_all(runner, directory: str, on_export: Callable[[dict, Any, Any], None] | None = None) -> dict[str, Any]:
    """Run every documented row's case on ``runner`` (a ``CaseRunner`` whose pool loads the adapters by name) and
    write its repro into ``directory``: ``{name: Exported}``, each also given to ``on_export(entry, report,
    exported)`` as soon as it is written (``entry``: of ``entries``; ``report``: the case's). A case that no longer
    fails is an error."""
    out = {}
    for entry in entries():
        case = {**entry["case"], "impl": f"examples.automodel.adapters.{entry['adapter']}"}
        report = runner.run(case)
        if report.ok:
            raise RuntimeError(f"{entry['name']}: the documented case passes now; nothing to export")
        out[entry["name"]] = runner.export_repro(case, report, directory, name=entry["name"])
        if on_export is not None:
            on_export(entry, report, out[entry["name"]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args(argv)
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    known = entries()
    impls = sorted({f"examples.automodel.adapters.{e['adapter']}" for e in known})
    from cp_harness.cases.meshes import ranks_needed

    runner = CaseRunner(
        PoolConfig(world_size=max(ranks_needed(e["case"]) for e in known), impl=",".join(["cp_impl", *impls]))
    )
    target = tempfile.mkdtemp() if args.check else str(EXPORTED)
    try:
        exported = export_all(runner, target)
    finally:
        runner.close()
    missing = [name for name, e in exported.items() if e.path is None]
    for name in missing:
        print(f"{name}: no repro ({exported[name].why})", file=sys.stderr)
    if not args.check:
        print(f"{len(exported) - len(missing)} repros written to {EXPORTED}")
        return 1 if missing else 0
    stale = [
        f
        for f in sorted(os.listdir(target))
        if not (EXPORTED / f).exists() or not filecmp.cmp(os.path.join(target, f), EXPORTED / f, shallow=False)
    ]
    for f in stale:
        print(
            f"{f}: not what the exporter writes now (python -m examples.automodel.tools.export_repros)", file=sys.stderr
        )
    return 1 if stale or missing else 0


if __name__ == "__main__":
    sys.exit(main())
