"""cp_harness: does every CP rank compute what one device would?

The harness draws small JSON case descriptions, runs them on a warm pool of
ranks with the implementation under test, and judges every rank's outputs
against the float64 oracles (``oracle/``) and against one rank of the same
implementation. Data flows one way, and so do the imports (lowest first;
``tests/project/test_harness_layers.py`` keeps it so):

* :mod:`cp_harness.cases` -- case descriptions and the tensors they stand for,
  Hypothesis strategies and profiles, the catalogue of malformed inputs,
  loading the implementation under test.
* :mod:`cp_harness.instruments` -- what the ranks measure besides results:
  bytes moved through ``torch.distributed``, documented functions called.
* :mod:`cp_harness.judging` -- comparison (exact / ULP), budgets, the excess
  judge, communication minima, error maps, the verdict model and its renderer.
* :mod:`cp_harness.standins` -- kernel stand-ins: one device kernel replaced by a
  CPU computation of its contract (ring SDPA's per-step kernel), named in reports.
* :mod:`cp_harness.usage` -- how a CP model uses the API under test:
  resolving a returned sharder the framework's way, the miniature models.
* :mod:`cp_harness.repro` -- standalone repros: a failing case as one script that needs torch, numpy and the
  code under test only (the parts every script holds, the script families, the one writer).
* :mod:`cp_harness.checks` -- one module per check: what runs on every rank,
  the oracle half, and everything the check owns (budgets, golden contents,
  strategy, examples, communication minimum).
* :mod:`cp_harness.ranks` -- the launcher, one rank's loop, the wire format,
  devices, and the pool that feeds the ranks one case at a time.
* :mod:`cp_harness.runner` -- one case on the pool, judged, with its one-rank
  baseline; :mod:`cp_harness.run_summary` -- run-wide counters.
* :mod:`cp_harness.golden`, :mod:`cp_harness.bench`, :mod:`cp_harness.verify`,
  :mod:`cp_harness.calibrate` -- the commands (``python -m cp_harness ...``);
  :mod:`cp_harness.options` -- the one option table the command line and the plugin share.
* :mod:`cp_harness.pytest_plugin` and :mod:`cp_harness.__main__` -- the entry
  points; ``cp_harness.tests`` is the gate suite (``pytest --pyargs cp_harness.tests``).
"""
