"""Model spec: nemo-automodel 0.7.0's ``DeepseekV41ForCausalLM`` at a tiny random config, CP the framework's way.

The worked example of a spec (the interface: ``_base``): the framework's ``ContextParallelSharder`` enters CP and
every verb is the common one (``_base.shard``, ``forward``, ``gather_logits``, the batches and the loss); what is
this model's is its config, its build (zero-initialised attention sinks and router bias redrawn, so that their
gradients and effects are exercised) and its CP padding. float64 does not run: the eager attention computes in
float32 and casts back. ``build`` takes about 0.3 s; ``overrides`` replace fields of the text config (e.g.
``index_topk=3, candidate_topk_blocks=2``). Parameters are in ``dtype`` except the ones the framework keeps in
float32 (LM head, hyper-connections, sinks, compressor, router bias); logits are float32 (the LM head is).

Tiny config (``TINY``): hidden 16, 6 layers with compress ratios ``[0, 2, 2, 1, 1, 1]``: layer 0
sliding-window only, 1 Full (ratio 2, KV and index source), 2 Reuse (ratio 2), 3 Full (ratio 1, KV,
index and candidate-block source), 4 Reindex (ratio 1, uses candidates), 5 Reuse (ratio 1); MoE with 4
routed experts (2 active) and one shared expert per layer; 2 heads of 8; vocabulary 64; window 4; no
Engram, vision or MTP. Backend ``BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32",
experts="torch", dispatcher="torch")``. The default ``index_topk``/``candidate_topk_blocks`` are larger
than any compressed width used here, so the indexer keeps every visible key; smaller values exercise
the hard top-k selection, whose ties (``relu`` zeros) make the result depend on the row width, hence on
CP padding (see ``padding_sensitivity_repro`` in ``tools/run_standalone.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from examples.automodel.models._base import *  # noqa: F403  (the common verbs are this spec's)
from examples.automodel.models._base import BATCH_KEYS, build_seeded, dtype_name, pad_batch, padded_length, tiny  # noqa: F401

NAME = "deepseek_v41"
FRAMEWORK_CLASS = "nemo_automodel.components.models.deepseek_v41.model.DeepseekV41ForCausalLM"

BACKEND = dict(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=6, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, qk_rope_head_dim=4, q_lora_rank=8, o_lora_rank=8, o_groups=2,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, sliding_window=4,
    compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4],
    index_n_heads=2, index_head_dim=8, index_topk=64, candidate_source_layer_id=3, candidate_topk_blocks=64,
    candidate_block_size=2, hc_mult=2, hc_sinkhorn_iters=4, rms_norm_eps=1e-6, engram_layer_ids=[],
    engram_num_embeddings=[], num_nextn_predict_layers=0, dspark_target_layer_ids=[], initializer_range=0.2,
    max_position_embeddings=4096, dspark_noise_token_id=63, pad_token_id=0,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 256},
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> DeepseekV41Config:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    name = dtype_name(NAME, dtype)
    text = {**tiny(TINY, overrides), "dtype": name}
    return DeepseekV41Config(
        text_config=text, vision_config={"num_hidden_layers": 0}, dtype=name, pad_token_id=text["pad_token_id"]
    )


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``DeepseekV41ForCausalLM`` on CPU in train mode, seeded; all-zero sinks and router bias redrawn."""
    cfg = config(dtype, **overrides)
    return build_seeded(
        lambda: DeepseekV41ForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed, nonzero=True
    )


def cp_padded_length(model: Any, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size`` (``cp_size * max(lcm(ratios), 2)``).

    Running one device on a row right-padded (masked) to this length reproduces what CP padding does to the
    model, which separates padding sensitivity from CP errors.
    """
    return padded_length(seq_len, cp_size, cp_size * max(model._packed_alignment, 2))
