"""Model specs: real framework models that a CP driver builds, shards the framework's way and compares.

Each module here (e.g. ``deepseek_v41``) is a *model spec*: ``build(dtype, seed)``, ``shard(model, mesh,
batch)``, ``forward(model, local_batch)``, ``gather_logits``, ``loss`` with global-count normalisation,
``valid_positions`` and ``BATCH_KEYS``; its module docstring documents shapes. ``run_standalone.py``
drives a spec on forked gloo ranks without the harness. Importing a spec needs the framework's model
dependencies (``transformers==5.18.0`` and friends), not only torch.
"""

# The model specs ``scripts/real_clients`` gates (those whose ``REQUIRES`` is unmet here are skipped, with it, and
# run by the nightly GPU job).
SPECS = ("deepseek_v41", "load_balanced_sdpa", "load_balanced_sdpa_alltoall", "kimi_linear_kda",
         "mimo_v2_flash_te_thd", "nemotron_v3_mamba")
