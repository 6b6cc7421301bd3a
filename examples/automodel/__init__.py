"""Gating nemo-automodel 0.7.0's own CP with this harness, laid out by role (docs/real_clients.md, docs/real_models.md).

- ``adapters/``: one module per framework CP primitive, served inside ``cp_impl`` (``ADAPTERS``, ``NOT_ADAPTED``);
- ``models/``: the model specs, real framework models a driver builds, shards the framework's way and compares
  (``SPECS``), and their shared helpers (``_base``, ``model_owned_cp``);
- ``attention/``: attention subjects, the framework's own CP attention functions (the EAGLE-3 ring, zig-zag ring and
  Ulysses attention) as its training code calls them, for the ``cp_attention`` check (``SUBJECTS``; docs/real_clients.md);
- ``repro/``: standalone repros without the harness: hand-written ones of the primitives' defects (``_launch`` their
  launcher), of the models' findings (``repro/models/``), and the exported ones (``repro/exported/``, written by
  ``tools/export_repros``);
- ``tools/``: the gate (``run``: ``python -m examples.automodel.tools.run``, which ``scripts/real_clients`` runs),
  ``defects`` (``known_defects.json``, the documented findings, and their signatures), ``coverage`` (the coverage
  table), ``export_repros``, ``comm_probe``; and the spec tools run without the gate: ``calibrate_spec``,
  ``covers_check``, ``run_standalone`` (a spec at CP 1, 2, 3 on forked gloo ranks, no harness).
- ``training/``: the recipes' training steps built from the framework's own pieces, the drivers of
  ``verify --step training`` (``train_ft_step``: ``recipes/llm/train_ft.py``'s step; docs/training_step.md).
"""
