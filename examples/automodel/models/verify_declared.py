"""``cp_harness verify --model SPEC`` restricted to the cases the spec declares it supports, until the harness
reads the declarations itself (then this script is redundant).

    PYTHONPATH=. python examples/automodel/models/verify_declared.py \
        --model examples.automodel.models.qwen3_8_flash_next --examples 12 --world-sizes 1,2,3

The same rows, draws (Hypothesis, ``--seed``), pool, judge and table as ``verify``
(``cp_harness.verify.run_verify`` with its own real-model rows), except that a drawn case is dropped, not run,
when the spec's ``PACKED_MAX_ROWS`` excludes it (rows a packed batch may have; Qwen3.8-Flash-Next packs one THD
row per micro-batch). ``WORLD_SIZES`` and ``BATCH_KINDS`` the harness honours itself; ``declared`` checks them
too, for the scripts that draw cases on their own. Exit status as ``verify``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys


def declared(spec) -> callable:
    """``case -> bool``: whether the spec's declarations admit the real-model case."""
    sizes = getattr(spec, "WORLD_SIZES", None)
    kinds = getattr(spec, "BATCH_KINDS", ("plain", "right_padded", "packed"))
    packed_rows = getattr(spec, "PACKED_MAX_ROWS", None)

    def admits(case: dict) -> bool:
        batch = case["batch"]
        if sizes is not None and int(case["world_size"]) not in sizes:
            return False
        if batch["kind"] not in kinds:
            return False
        return not (batch["kind"] == "packed" and packed_rows is not None
                    and int(batch.get("batch_size", 1)) > packed_rows)
    return admits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="one model spec module")
    parser.add_argument("--examples", type=int, default=25)
    parser.add_argument("--world-sizes", default="1,2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from cp_harness.verify import VerifySettings, default_rows, result_text, run_verify

    admits = declared(importlib.import_module(args.model))
    rows = [dataclasses.replace(row, spec=dataclasses.replace(
                row.spec, cases=lambda space, cases=row.spec.cases: cases(space).filter(admits)))
            for row in default_rows() if row.spec.needs_model]
    result = run_verify(VerifySettings(impl=os.environ.get("CP_IMPL", "cp_impl"), model=(args.model,),
                                       world_sizes=tuple(int(n) for n in args.world_sizes.split(",")),
                                       examples=args.examples, seed=args.seed), rows=rows)
    if result.cannot_run is not None:
        print(f"verify_declared: cannot run: {result.cannot_run}", file=sys.stderr)
        return result.exit_code
    print(result_text(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.as_dict(), handle, indent=1, default=str)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
