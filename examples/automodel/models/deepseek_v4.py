"""Model spec: nemo-automodel 0.7.0's ``DeepseekV4ForCausalLM`` at a tiny random config (same interface as
``deepseek_v41``: see that module's docstring; shard/forward/gather_logits/loss/batches are shared).

Tiny config: hidden 16, 4 layers with compress ratios ``[0, 4, 4, 0]`` (sliding window only, compressed with
the indexer, compressed, sliding window only), hash routing in layer 0, MoE 4 experts (2 active) + 1 shared,
2 heads of 8, vocabulary 64, window 4, no MTP or vision. Eager CPU backend as for V4.1.

Status (float32 and bfloat16, CP 2 and 3 against one rank): unpacked batches (plain, odd length, right
padded) match (float32: logits <= 1e-6, gradients <= 1e-7). Packed batches do NOT compare yet: the CP
sharder packs by ``seq_lens``, but on one rank (identity sharder) ``DeepseekV4ForCausalLM.forward`` takes
``seq_lens`` into ``**attn_kwargs`` and ignores it, so the baseline attends across documents (CP 2 and CP 3
agree with each other, and differ from the baseline by the same 1.5-2.4 in logits). V4's one-device packed
format (THD ``qkv_format``/``cu_seqlens``) is not wired into ``make_batch`` here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from examples.automodel.models.deepseek_v41 import (  # noqa: F401  (the shared half of the interface)
    BACKEND, BATCH_KEYS, DTYPES, IGNORE_INDEX, forward, gather_logits, local_labels, loss, make_batch,
    num_label_tokens, pad_batch, shard, valid_positions)

NAME = "deepseek_v4"
FRAMEWORK_CLASS = "nemo_automodel.components.models.deepseek_v4.model.DeepseekV4ForCausalLM"

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, qk_rope_head_dim=4, q_lora_rank=8, o_lora_rank=8, o_groups=2,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, compress_ratios=[0, 4, 4, 0],
    sliding_window=4, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=4, index_head_dim=8, index_n_heads=2,
    index_topk=64, num_nextn_predict_layers=0, vision_n_layers=0, initializer_range=0.2,
    max_position_embeddings=4096, pad_token_id=0,
)


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> DeepseekV4Config:
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return DeepseekV4Config(**{**copy.deepcopy(TINY), **overrides}, torch_dtype=name)


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DeepseekV4ForCausalLM(config(dtype, **overrides), backend=BackendConfig(**BACKEND))
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    return model.train()


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    from nemo_automodel.components.models.deepseek_v4.cp import dsv4_cp_local_seq_multiple  # noqa: PLC0415
    if cp_size <= 1:
        return seq_len
    divisor = cp_size * max(dsv4_cp_local_seq_multiple(model.config), 2)
    return seq_len + (-seq_len) % divisor
