"""Judging: turning rank outputs and oracle results into verdicts, and verdicts into text.

* ``compare`` -- the one comparison routine (bit-exact or within a ULP budget) and token grids.
* ``budgets`` -- the error budget type and how the budgets were measured (each check owns its numbers).
* ``policy`` -- the judging policy handed to the judge: ``STRICT`` (the contract) or ``UNJUDGED`` (calibration).
* ``excess`` -- the excess judge: CP error against one rank of the same implementation.
* ``comm_minimum`` -- the analytic least communication of each collective pattern.
* ``verdicts`` -- the verdict model (``CaseReport``): comparisons and problems as data.
* ``render`` -- the one renderer of verdicts as text.
* ``error_maps`` -- PNG pictures of where a token-aligned tensor is wrong.
* ``serialize`` -- report values as strict JSON (non-finite floats as strings).
"""
