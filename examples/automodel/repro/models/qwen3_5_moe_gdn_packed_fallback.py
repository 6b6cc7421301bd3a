"""Qwen3.5-MoE (nemo-automodel 0.7.0): the one-device Gated DeltaNet layer runs packed documents into each other when
its kernels fall back to transformers' torch functions. ``CPAwareGatedDeltaNet.__init__`` takes
``causal_conv1d.causal_conv1d_fn`` and ``fla``'s ``chunk_gated_delta_rule`` and, on ``ImportError``, transformers'
``causal_conv1d_fn`` / ``torch_chunk_gated_delta_rule``. ``_forward_no_cp`` then passes the packed batch's document
boundaries to them (``seq_idx=`` to the convolution, ``cu_seqlens=`` / ``cu_seqlens_cpu=`` to the delta rule), but both
fallbacks take them in ``**kwargs`` and ignore them: the convolution reads the previous document's last tokens and the
recurrent state carries over from one document into the next, silently (no error). Reached wherever
``causal_conv1d``'s CUDA extension or ``fla`` is missing (a CPU; a GPU install without the ``cuda`` / ``fla`` extras).

One process, no CP, no harness: the layer (the spec's tiny text config with one ``linear_attention`` layer, fla
hidden so the fallbacks are taken as on such an install) on one packed row of two documents (5 and 7 tokens,
``cu_seqlens = [0, 5, 12]``, the indexed mask ``1 1 1 1 1 2 ...``, as the framework's packed path passes them), against
the same layer on each document alone. Exit status 1 while the second document's output differs (the defect), 0 with
``--fixed`` (the fallbacks called once per document, which is what the boundaries ask for); 2 when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_gdn_packed_fallback.py [--fixed]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.modules["fla"] = None  # type: ignore[assignment]  # an install without fla: the framework's ImportError branch

import torch  # noqa: E402

from examples.automodel.models import qwen3_5_moe as spec  # noqa: E402  (spec.config: the tiny config)

LINEAR = dict(layer_types=["linear_attention"], linear_num_key_heads=1, linear_key_head_dim=4,
              linear_num_value_heads=2, linear_value_head_dim=4, linear_conv_kernel_dim=4)  # fmt: skip


def per_document(module) -> None:
    """The proposed fix's behaviour: each fallback called on each document (conv by ``seq_idx`` runs, the delta rule
    by ``cu_seqlens``), so no state crosses a boundary."""
    conv, rule = module.causal_conv1d_fn, module.chunk_gated_delta_rule

    def conv_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if seq_idx is None:
            return conv(x, weight=weight, bias=bias, activation=activation)
        ids = seq_idx[0]
        cuts = [0] + [int(i) + 1 for i in torch.nonzero(ids[1:] != ids[:-1]).flatten()] + [ids.numel()]
        return torch.cat([conv(x[:, :, a:b], weight=weight, bias=bias, activation=activation)
                          for a, b in zip(cuts[:-1], cuts[1:])], dim=2)  # fmt: skip

    def rule_fn(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        if cu_seqlens is None:
            return rule(q, k, v, g=g, beta=beta, **kwargs)
        bounds = cu_seqlens.tolist()
        outs = [rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kwargs)[0]
                for a, b in zip(bounds[:-1], bounds[1:])]  # fmt: skip
        return torch.cat(outs, dim=1), None

    module.causal_conv1d_fn, module.chunk_gated_delta_rule = conv_fn, rule_fn


def main(fixed: bool) -> int:
    from nemo_automodel.components.models.qwen3_5_moe.cp_linear_attn import CPAwareGatedDeltaNet
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    torch.manual_seed(0)
    module = CPAwareGatedDeltaNet(spec.config(torch.float32, num_hidden_layers=1, **LINEAR).text_config, layer_idx=0)
    used = (
        module.causal_conv1d_fn is hf.causal_conv1d_fn,
        module.chunk_gated_delta_rule is hf.torch_chunk_gated_delta_rule,
    )
    print(f"kernels: transformers' causal_conv1d_fn {used[0]}, torch_chunk_gated_delta_rule {used[1]}")
    if not all(used):
        print("could not run: the layer did not take both fallbacks")
        return 2
    if fixed:
        per_document(module)
    hidden = torch.randn(1, 12, module.hidden_size, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    mask = torch.tensor([[1] * 5 + [2] * 7])
    with torch.no_grad():
        packed = module._forward_no_cp(hidden, attention_mask=mask, cu_seqlens=cu, indices=torch.arange(12))
        alone = torch.cat([module._forward_no_cp(hidden[:, a:b]) for a, b in ((0, 5), (5, 12))], dim=1)
    worst = [float((packed[0, a:b] - alone[0, a:b]).abs().max()) for a, b in ((0, 5), (5, 12))]
    scale = float(alone.abs().max())
    print(f"packed row against each document alone: max |difference| document 1 {worst[0]:.3g}, document 2 "
          f"{worst[1]:.3g} (largest output {scale:.3g})")  # fmt: skip
    if max(worst) > 1e-5 * scale:
        print("WRONG: the packed row's second document differs from the document alone (state crossed the boundary)")
        return 1
    print("ok: every document as alone")
    return 0


if __name__ == "__main__":
    sys.exit(main("--fixed" in sys.argv[1:]))
