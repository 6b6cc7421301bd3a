"""Model spec: nemo-automodel 0.7.0's Kimi K3 text model (``KimiK3ForCausalLM``) at a tiny random config, MLA
layers only, CP the framework's way.

Kimi K3 runs the same CP design as Kimi Linear (``kimi_linear`` spec: contiguous shards, all-gather of the
compressed KV latent, document-causal FlexAttention) but from its *own copy* of the code
(``kimi_k3/cp.py``, ``kimi_k3/model.py``), which differs: the document map travels as plain batch fields
(``kimi_packed_doc_ids`` / ``_seq_start`` / ``_cp_size``, pipeline-safe) instead of a ``KimiPackedContext``,
``prepare_model_inputs_for_cp`` itself calls ``setup_cp_attention`` on every attention module and requires
``model.cp_mesh`` (set by ``apply_cp``), and the MLA has a query LoRA and a sigmoid output gate. Judging Kimi
Linear does not run any of this code, hence this spec. Everything else is ``kimi_linear``'s: batches (the
same ``document_ids`` packing contract), ``shard`` (``apply_cp`` then the model's sharder, on a CP twin),
loss, gathering, and the reasons a CPU judges logits and loss only.

Restricted to MLA (``linear_attn_config["kda_layers"] = []``): K3's KDA layers need ``fla``. Tiny config
(``TINY``): hidden 16, 3 MLA layers (2 heads, query LoRA 8, latent 8, nope 8 + rope 4, value 8, output gate),
attention residuals over blocks of 2 layers, layer 0 dense, layers 1-2 latent MoE (4 experts, 2 active, one
shared, expert hidden 8), SiTU activations (torch), vocabulary 64.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.kimi_k3 import cp as k3_cp
from nemo_automodel.components.models.kimi_k3 import model as k3_model
from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig
from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM, KimiMLAAttention

from examples.automodel.models import _base, model_owned_cp
from examples.automodel.models._kimi_mla import flex_attention_for, mla_cp_kernels, no_cpu_backward
from examples.automodel.models.kimi_linear import (  # noqa: F401  (re-exported: same verbs, same semantics)
    BACKEND,
    BATCH_KEYS,
    BATCH_KINDS,
    DTYPES,
    IGNORE_INDEX,
    WORLD_SIZES,
    cp_padded_length,
    gather_logits,
    local_labels,
    loss,
    make_batch,
    num_label_tokens,
    pad_batch,
    shard,
    valid_positions,
)

NAME = "kimi_k3"
FRAMEWORK_CLASS = "nemo_automodel.components.models.kimi_k3.model.KimiK3ForCausalLM"

STANDINS = ("flex_backward_cpu",)  # lifts the CPU refusal no_cpu_backward quotes; docs/standins.md
FORWARD_ONLY_ON: dict[str, str] = {}
FORWARD_ONLY_WITHOUT_STANDIN = {"cpu": no_cpu_backward(NAME)}  # tests' forward-only fixtures

COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "sets model.cp_mesh (which K3's CP hook requires) and each MoE module's cp_mesh",
    "nemo_automodel.components.models.kimi_k3.model.KimiK3ForCausalLM.prepare_model_inputs_for_cp": "hands the CP mesh to every MLA module, returns the model-owned contiguous sharder",
    "nemo_automodel.components.models.kimi_k3.model.KimiMLAAttention.setup_cp_attention": "stores the CP mesh the latent all-gather uses",
    "nemo_automodel.components.models.kimi_k3.cp.shard_batch_for_kimi_cp": "global document map, pads to a multiple of cp, contiguous slices, kimi_packed_* batch fields",
    "nemo_automodel.components.models.kimi_k3.cp._global_doc_ids_from_batch": "document ids from _packed_seq_ids / attention_mask / seq_lens(_padded) / padding_mask",
    "nemo_automodel.components.models.kimi_k3.model.KimiMLAAttention._forward_with_cp": "local queries (query LoRA), gathered latent expanded to global K/V, output gate",
    "nemo_automodel.components.models.kimi_k3.cp.all_gather_sequence": "all-gathers the compressed latent along the sequence (autograd: all-reduce + slice)",
    "nemo_automodel.components.models.kimi_k3.cp.document_causal_flex_attention": "FlexAttention of local queries against global keys, causal per document",
    "nemo_automodel.components.models.kimi_k3.cp._document_causal_block_mask": "the block mask (global query offset = the shard start)",
    **_base.COVERS_GATHER_TRIMMED,
}


# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    mla_use_nope=True, mla_use_output_gate=True, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
    moe_intermediate_size=8, routed_expert_hidden_size=8, first_k_dense_replace=1,
    linear_attn_config={"kda_layers": [], "full_attn_layers": [1, 2, 3], "short_conv_kernel_size": 4,
                        "head_dim": 8, "num_heads": 2},
    attn_res_block_size=2, initializer_range=0.2, max_position_embeddings=256, pad_token_id=0, use_cache=False,
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> KimiK3TextConfig:
    """The framework's text config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    return KimiK3TextConfig(**_base.tiny(TINY, overrides), torch_dtype=_base.dtype_name(NAME, dtype))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model on CPU in ``train()`` mode, seeded; zero-initialised score-correction bias and gates redrawn."""
    cfg = config(dtype, **overrides)
    return _base.build_seeded(
        lambda: KimiK3ForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed, nonzero=True
    )


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """The model (or its CP twin) on this rank's shard, in ``ctx_factory()``; logits ``[B, S_local, V]``."""
    with flex_attention_for(local_batch.get(model_owned_cp.TWIN_KEY, model), k3_cp._COMPILED_FLEX_ATTENTION):
        return model_owned_cp.twin_forward(model, local_batch)


CP_KERNELS = (
    "MLA attention by FlexAttention (kimi_k3/cp.py document_causal_flex_attention) instead of "
    "matmul + float32 softmax + matmul"
)


def cp_kernels(model: torch.nn.Module) -> contextlib.AbstractContextManager[str]:
    """Inside: the one-device forward of ``model`` computes MLA with the kernel K3's CP path uses (the
    framework's ``kimi_k3.model.KimiMLAAttention._forward_with_cp`` over a world of one rank: the query LoRA and
    output gate as on one device, attention by FlexAttention under the one-device document map, no shard, no
    gather); its value names those kernels (``CP_KERNELS``). Exactly what changes:
    ``_kimi_mla.mla_cp_kernels`` (here with K3's own module, ``kimi_k3.model``, and its
    ``kimi_k3.cp.KimiPackedContext``)."""
    return mla_cp_kernels(model, KimiMLAAttention, k3_model, k3_cp.KimiPackedContext, CP_KERNELS)
