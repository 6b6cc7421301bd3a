"""Model specs: real framework models that a CP driver builds, shards the framework's way and compares.

Each module here (e.g. ``deepseek_v41``) is a *model spec*: ``build(dtype, seed)``, ``shard(model, mesh,
batch)``, ``forward(model, local_batch)``, ``gather_logits``, ``loss`` with global-count normalisation,
``valid_positions`` and ``BATCH_KEYS``; its module docstring documents shapes. ``run_standalone.py``
drives a spec on forked gloo ranks without the harness. Importing a spec needs the framework's model
dependencies (``transformers==5.18.0`` and friends), not only torch.
"""
