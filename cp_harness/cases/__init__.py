"""Cases: what a test asks the ranks to run, as small JSON-able descriptions.

* ``descriptions`` -- the case keys, the deterministic batches and tensors a
  case stands for (every rank rebuilds them from the seed), canonical JSON.
* ``strategies`` -- Hypothesis strategies: layouts, payloads, one per check family.
* ``profiles`` -- the ``ci`` / ``nightly`` / ``dev`` Hypothesis profiles.
* ``malformed_inputs`` -- the catalogue of malformed inputs (data: base call, mutations, accepted errors).
* ``implementation`` -- finding and loading the implementation under test (``--cp-impl``, ``$CP_IMPL``).
"""
