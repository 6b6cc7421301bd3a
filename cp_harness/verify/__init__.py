"""The main job: verify an implementation on a warm pool and print a report.

For every documented function (grouped as the API pages group them), the
sharder and both miniature models, Hypothesis draws cases (``--examples`` per
row, seeded by ``--seed``), the pool runs them and the oracle judges them. A
failing row is shrunk by Hypothesis to a small case, its error maps are
written and its reproduction command printed. The table lists, per row:
examples run, passed, the largest error in ULPs (``exact`` for data movement,
which must match bit for bit), the worst CP excess (CP error / error of the
same implementation on one rank, ``cp_harness.judging.excess``; ``-`` where nothing
is arithmetic or every case had one rank), and the bytes moved over the wire
compared with the analytic minimum (``cp_harness.judging.comm_minimum``; ``-`` where
there is no closed form, e.g. whole models; ``unaccounted`` where the meter saw
communication it could not attribute, so no ratio is given). ``--dtypes``
restricts the dtypes the cases draw (rows without any of them are left out),
``--rows`` the rows run. ``--json PATH`` writes the same report as JSON
(``VerifyResult.as_dict``). Exit status: 0 when every row passed, 1 on any
failure, 2 when the run could not start (bad arguments, no GPUs, an
implementation that does not import).

* ``rows`` -- the rows: declared row, tally, failure; ``default_rows``, ``select_rows``.
* ``search`` -- one row: Hypothesis draws, the pool runs, the tally counts, a failure is shrunk.
* ``result`` -- ``VerifySettings`` (what is asked), ``VerifyResult`` (what was found, its JSON), ``result_text``.
* ``run`` -- ``run_verify(settings) -> VerifyResult``: the pool, the rows, no printing.
* ``progress`` -- the progress bar on stderr.
"""

from cp_harness.verify.progress import Progress
from cp_harness.verify.result import SHRINK_SECONDS, VerifyResult, VerifySettings, format_table, result_text
from cp_harness.verify.rows import Row, RowFailure, RowTally, default_rows, select_rows
from cp_harness.verify.run import run_verify
from cp_harness.verify.search import run_row

__all__ = [
    "Progress",
    "Row",
    "RowFailure",
    "RowTally",
    "SHRINK_SECONDS",
    "VerifyResult",
    "VerifySettings",
    "default_rows",
    "format_table",
    "result_text",
    "run_row",
    "run_verify",
    "select_rows",
]
