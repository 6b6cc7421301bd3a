"""The gate suite: CP-versus-oracle properties for any implementation.

Run it against your own module with
``pytest --pyargs cp_harness.tests --cp-impl your.module``.
"""
