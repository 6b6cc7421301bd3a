"""Judging: turning rank outputs and oracle results into verdicts.

* ``compare`` -- the one comparison routine (bit-exact or within a ULP budget) and token grids.
* ``budgets`` -- the error budget type and its documentation (each check owns its numbers).
* ``excess`` -- the excess judge: CP error against one rank of the same implementation.
* ``comm_minimum`` -- the analytic least communication of each collective pattern.
* ``error_maps`` -- PNG pictures of where a token-aligned tensor is wrong.
* ``serialize`` -- report values as strict JSON (non-finite floats as strings).
"""
