"""Model specs: real framework models that a CP driver builds, shards the framework's way and compares.

Each module here (e.g. ``deepseek_v41``) is a *model spec*: ``build(dtype, seed)``, ``shard(model, mesh,
batch)``, ``forward(model, local_batch)``, ``gather_logits``, ``loss`` with global-count normalisation,
``valid_positions`` and ``BATCH_KEYS``; its module docstring documents shapes. ``run_standalone.py``
drives a spec on forked gloo ranks without the harness. Importing a spec needs the framework's model
dependencies (``transformers==5.18.0`` and friends), not only torch.

Specs: ``deepseek_v41``, ``deepseek_v4``, ``qwen3_8_flash_next`` and ``glm5_next`` (``docs/models/``; they also
declare ``WORLD_SIZES``, ``BATCH_KINDS`` and ``COVERS``). ``covers_check.py`` runs a spec's ``COVERS`` under CP and
counts the calls; ``verify_declared.py`` is ``verify`` restricted to the cases a spec declares;
``calibrate_spec.py`` prints a spec's worst CP errors, spreads and error/bound per dtype over drawn cases.
"""

# The model specs ``scripts/real_clients`` gates (those whose ``REQUIRES`` is unmet here are skipped, with it, and
# run by the nightly GPU job).
SPECS = ("deepseek_v41", "load_balanced_sdpa", "load_balanced_sdpa_alltoall", "kimi_linear_kda",
         "mimo_v2_flash_te_thd", "nemotron_v3_mamba")
