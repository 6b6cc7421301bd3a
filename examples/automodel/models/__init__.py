"""Model specs: real framework models that a CP driver builds, shards the framework's way and compares.

Each module here (e.g. ``deepseek_v41``) is a *model spec*: ``build(dtype, seed)``, ``shard(model, mesh,
batch)``, ``forward(model, local_batch)``, ``gather_logits``, ``loss`` with global-count normalisation,
``valid_positions`` and ``BATCH_KEYS``; its module docstring documents shapes. ``tools/run_standalone.py``
drives a spec on forked gloo ranks without the harness. Importing a spec needs the framework's model
dependencies (``transformers==5.18.0`` and friends), not only torch.

Specs (``SPECS``; a page each in ``docs/models/``): on CPU with gradients ``deepseek_v41``, ``deepseek_v4``,
``qwen3_8_flash_next``, ``glm5_next``, ``qwen3_5_moe``; forward only on CPU ``gemma4_moe``, ``kimi_linear``,
``kimi_k3``; GPU only ``load_balanced_sdpa`` (+ ``_alltoall``), ``kimi_linear_kda``, ``mimo_v2_flash_te_thd``,
``nemotron_v3_mamba``. They declare ``WORLD_SIZES``, ``BATCH_KINDS``, ``COVERS`` and, where they apply,
``BATCH_ROWS``, ``FORWARD_ONLY_ON``, ``REQUIRES`` (``cp_harness.usage.spec_contract``). ``tools/covers_check.py`` runs a spec's ``COVERS`` under CP and
counts the calls;
``tools/calibrate_spec.py`` prints a spec's worst CP errors, spreads and error/bound per dtype over drawn cases.
"""

# The model specs ``scripts/real_clients`` gates (those whose ``REQUIRES`` is unmet here are skipped, with it, and
# run by the nightly GPU job).
SPECS = ("deepseek_v41", "deepseek_v4", "qwen3_8_flash_next", "glm5_next", "qwen3_5_moe", "gemma4_moe",
         "kimi_linear", "kimi_k3", "load_balanced_sdpa", "load_balanced_sdpa_alltoall", "kimi_linear_kda",
         "mimo_v2_flash_te_thd", "nemotron_v3_mamba")
