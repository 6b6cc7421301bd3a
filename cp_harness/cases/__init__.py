"""Cases: what a test asks the ranks to run, as small JSON-able descriptions.

* ``descriptions`` -- the case keys, the deterministic batches and tensors a
  case stands for (every rank rebuilds them from the seed), canonical JSON.
* ``strategies`` -- Hypothesis strategy families: the case space, payload dtypes, layouts, images (each
  check builds its own strategy from them).
* ``profiles`` -- the ``ci`` / ``nightly`` / ``dev`` Hypothesis profiles.
* ``meshes`` -- world meshes as training builds them (``mesh_layout``): CP groups, their ranks, checked layouts.
* ``malformed_catalogue`` -- the catalogue of malformed inputs (data: base call, mutations, accepted errors).
* ``malformed_inputs`` -- building, mutating and calling those inputs on a rank, and judging what they raised.
* ``implementation`` -- finding and loading the implementation under test (``--cp-impl``, ``$CP_IMPL``).
"""
