"""Golden files: the oracle's and the implementation's results for canonical cases, pinned.

Each canonical case (``CASES``, plain case descriptions that any check or
property test can run) has a folder ``golden/<name>/`` with

- ``oracle.npz``: the oracle's reference arrays (what the check compares the
  ranks with: expected outputs and gradients, layouts, losses);
- ``impl.npz``: what the implementation's ranks returned on a CPU (gloo) pool,
  combined in rank order: token-aligned local tensors concatenated along their
  sequence axis (global order), everything else stacked along a new first axis;
- ``manifest.json``: readable description: the case, its dtype, the generator
  version, the PyTorch version that made the files, how each implementation
  array was combined, each rank's ``info``, the SHA-256 and size of every
  array file, each array's dtype and shape, and a SHA-256 of the manifest itself.

Storage never executes code on load: ``.npz`` archives are read with
``numpy.load(..., allow_pickle=False)``, and every file is checked against the
manifest (present, size, SHA-256, names, dtypes, shapes) before use. Any
problem raises ``GoldenError`` naming the file and how to regenerate.

The files are written deterministically (zip entries uncompressed, in sorted
order, with a fixed date; manifests as sorted, indented JSON), and a case is
rewritten only when its arrays changed, so regenerating twice in a row leaves
every byte as it was.

Command line::

    python -m cp_harness golden check  [-k SUBSTRING] [--impl MODULE] [--backend gloo|nccl] [--storage-only]
    python -m cp_harness golden update [-k SUBSTRING] [--impl MODULE]
    python -m cp_harness golden list

See ``docs/golden.md``.

Modules:

* ``contents`` -- the canonical cases (each check's ``GoldenContents``), the oracle's arrays taken from
  the check's own ``expect``, the ranks' arrays combined in rank order, the numerics platform.
* ``storage`` -- deterministic bytes, the sealed manifest, verified loading.
* ``comparison`` -- current results against a golden case (``Verdict``).
* ``regeneration`` -- rewriting what changed and saying by how much (``update``).
* ``textual`` -- the textual (expecttest) expectations.
* ``cli`` -- the command line.
"""

from cp_harness.golden.cli import main
from cp_harness.golden.comparison import Verdict, compare_arrays, verify
from cp_harness.golden.contents import (
    ARRAY_FILES,
    CASES,
    FORMAT_VERSION,
    GOLDEN_DIR,
    IMPL_FILE,
    MANIFEST,
    ORACLE_FILE,
    REGENERATE,
    ZIP_DATE,
    GoldenError,
    combine_rule,
    impl_arrays,
    numerics_platform,
    oracle_arrays,
    rank_outputs,
)
from cp_harness.golden.regeneration import Change, regenerate, remove_stale, stale_folders, summarize, update
from cp_harness.golden.storage import Golden, build_files, encode_npz, load, seal_manifest
from cp_harness.golden.textual import format_comm, halo_plan

__all__ = [
    "ARRAY_FILES",
    "CASES",
    "FORMAT_VERSION",
    "GOLDEN_DIR",
    "IMPL_FILE",
    "MANIFEST",
    "ORACLE_FILE",
    "REGENERATE",
    "ZIP_DATE",
    "Change",
    "Golden",
    "GoldenError",
    "Verdict",
    "build_files",
    "combine_rule",
    "compare_arrays",
    "encode_npz",
    "format_comm",
    "halo_plan",
    "impl_arrays",
    "load",
    "main",
    "numerics_platform",
    "oracle_arrays",
    "rank_outputs",
    "regenerate",
    "remove_stale",
    "seal_manifest",
    "stale_folders",
    "summarize",
    "update",
    "verify",
]
