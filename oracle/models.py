"""The two miniature models, single device, exactly as ``docs/miniature_models.md``.

Both models run on global tensors with dense masks. The layout (``keep``,
``document_ids``, ``positions``) comes from :func:`oracle.layout.layout_from_batch`.
Everything is computed in the dtype of the parameters (float64 or float32; the
harness runs the oracle in float64 on parameters rounded to bfloat16/float16).

Batch keys read by the forwards:

* ``input_ids`` int ``[batch, sequence]`` (or ``inputs_embeds``
  ``[batch, sequence, hidden]`` instead of it);
* ``labels`` int ``[batch, sequence]`` (optional; without it the loss fields are 0);
* layout: ``seq_lens`` + ``seq_lens_padded``, or ``attention_mask``, or neither;
* ``image_mask`` bool ``[batch, sequence]`` and ``pixel_values`` (optional).

Choices where the model page is silent:

* every ``input_ids`` value, padding slots included, must lie in
  ``[0, vocab_size)`` (the page says ``embed[input_ids]``); padding slots may
  hold any valid id;
* without ``labels`` the loss fields are constant zeros (no autograd history);
  with labels but no counted position the loss is ``0 * loss_sum``;
* without images ``patch_proj`` / ``patch_bias`` take no part in the graph, so
  their ``.grad`` stays ``None`` after backward;
* ``pixel_values`` may take any of the three forms (one ``[C,H,W]`` image, a
  list of them, ``[N,C,H,W]``) for both models; it is cast to the parameter dtype;
* ``image_mask`` with no True slot and no ``pixel_values`` is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from oracle.attention import attention, rotary_embedding
from oracle.convolution import causal_depthwise_conv
from oracle.layout import Layout, layout_from_batch
from oracle.loss import aligned_cross_entropy, mean_loss, shifted_cross_entropy

__all__ = [
    "Inkling2Config",
    "MistralLarge4Config",
    "ModelOutput",
    "init_inkling2_params",
    "init_mistral_large4_params",
    "inkling2_param_shapes",
    "mistral_large4_param_shapes",
    "rms_norm",
    "patchify",
    "image_features",
    "splice_image_features",
    "inkling2_forward",
    "mistral_large4_forward",
]


@dataclass(frozen=True)
class Inkling2Config:
    """Inkling2-mini: embedding, one causal-conv mixer, one attention block, LM head."""

    vocab_size: int = 40
    hidden: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 4
    conv_width: int = 4
    patch_size: int = 2
    image_channels: int = 3
    rope_base: float = 10000.0


@dataclass(frozen=True)
class MistralLarge4Config:
    """MistralLarge4-mini: embedding, two attention blocks (block 1 windowed), soft-capped LM head."""

    vocab_size: int = 40
    hidden: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 4
    sliding_window: int = 8
    logit_softcap: float = 5.0
    patch_size: int = 2
    image_channels: int = 3
    rope_base: float = 10000.0


@dataclass
class ModelOutput:
    """What a miniature-model forward returns.

    Attributes:
        inputs_embeds: ``[batch, sequence, hidden]``, token embeddings after the
            image splice and *before* the multiplication by ``keep`` (call
            ``.retain_grad()`` on it to compare input-embedding gradients).
        logits: ``[batch, sequence, vocab]``, zero at padding slots.
        loss: 0-dim, ``loss_sum / count`` (``0 * loss_sum`` when ``count == 0``).
        loss_sum: 0-dim sum of cross-entropy over counted positions (nats).
        count: int64 0-dim number of counted positions.
    """

    inputs_embeds: Tensor
    logits: Tensor
    loss: Tensor
    loss_sum: Tensor
    count: Tensor


# --------------------------------------------------------------------------
# Parameters


_ParamSpec = tuple[str, tuple[int, ...], str]  # (name, shape, kind)


def _check_attention_config(config: Inkling2Config | MistralLarge4Config) -> None:
    if config.num_kv_heads < 1 or config.num_heads % config.num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({config.num_heads}) must be a positive multiple of num_kv_heads ({config.num_kv_heads})"
        )
    if config.head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for the rotary embedding, got {config.head_dim}")


def inkling2_param_shapes(config: Inkling2Config) -> list[_ParamSpec]:
    """``(name, shape, kind)`` of every Inkling2-mini parameter, in draw order.

    ``kind`` is one of ``"embed"``, ``"matrix"``, ``"bias"``, ``"conv"``, ``"norm"``.
    """
    c = config
    patch_dim = c.image_channels * c.patch_size * c.patch_size
    return [
        ("embed", (c.vocab_size, c.hidden), "embed"),
        ("patch_proj", (patch_dim, c.hidden), "matrix"),
        ("patch_bias", (c.hidden,), "bias"),
        ("conv_weight", (c.conv_width, c.hidden), "conv"),
        ("conv_out", (c.hidden, c.hidden), "matrix"),
        ("norm1", (c.hidden,), "norm"),
        ("wq", (c.hidden, c.num_heads * c.head_dim), "matrix"),
        ("wk", (c.hidden, c.num_kv_heads * c.head_dim), "matrix"),
        ("wv", (c.hidden, c.num_kv_heads * c.head_dim), "matrix"),
        ("wo", (c.num_heads * c.head_dim, c.hidden), "matrix"),
        ("norm2", (c.hidden,), "norm"),
        ("lm_head", (c.hidden, c.vocab_size), "matrix"),
    ]


def mistral_large4_param_shapes(config: MistralLarge4Config) -> list[_ParamSpec]:
    """``(name, shape, kind)`` of every MistralLarge4-mini parameter, in draw order."""
    c = config
    patch_dim = c.image_channels * c.patch_size * c.patch_size
    specs: list[_ParamSpec] = [
        ("embed", (c.vocab_size, c.hidden), "embed"),
        ("patch_proj", (patch_dim, c.hidden), "matrix"),
        ("patch_bias", (c.hidden,), "bias"),
    ]
    for i in (0, 1):
        specs += [
            (f"blocks.{i}.norm", (c.hidden,), "norm"),
            (f"blocks.{i}.wq", (c.hidden, c.num_heads * c.head_dim), "matrix"),
            (f"blocks.{i}.wk", (c.hidden, c.num_kv_heads * c.head_dim), "matrix"),
            (f"blocks.{i}.wv", (c.hidden, c.num_kv_heads * c.head_dim), "matrix"),
            (f"blocks.{i}.wo", (c.num_heads * c.head_dim, c.hidden), "matrix"),
        ]
    specs += [
        ("final_norm", (c.hidden,), "norm"),
        ("lm_head", (c.hidden, c.vocab_size), "matrix"),
    ]
    return specs


def _draw_params(specs: list[_ParamSpec], seed: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """Draw ``specs`` in order from one float64 generator, then cast to ``dtype``."""
    if dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float64, torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    generator = torch.Generator().manual_seed(int(seed))
    params: dict[str, Tensor] = {}
    for name, shape, kind in specs:
        draw = torch.randn(shape, generator=generator, dtype=torch.float64)
        if kind == "embed":
            value = draw * 1.0
        elif kind == "matrix":
            value = draw * shape[0] ** -0.5
        elif kind == "conv":
            value = draw * 0.5
        elif kind == "bias":
            value = draw * 0.1
        elif kind == "norm":
            value = 1 + 0.1 * draw
        else:  # pragma: no cover - specs are fixed above
            raise AssertionError(kind)
        params[name] = value.to(dtype).requires_grad_(True)
    return params


def init_inkling2_params(config: Inkling2Config, seed: int, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """Inkling2-mini parameters: leaf tensors (``requires_grad=True``) keyed by name.

    Drawn in the documented order from ``torch.Generator().manual_seed(seed)``
    in float64, then cast to ``dtype``.
    """
    _check_attention_config(config)
    return _draw_params(inkling2_param_shapes(config), seed, dtype)


def init_mistral_large4_params(
    config: MistralLarge4Config, seed: int, dtype: torch.dtype = torch.float64
) -> dict[str, Tensor]:
    """MistralLarge4-mini parameters: leaf tensors (``requires_grad=True``) keyed by name."""
    _check_attention_config(config)
    return _draw_params(mistral_large4_param_shapes(config), seed, dtype)


# --------------------------------------------------------------------------
# Shared pieces


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x * x, -1, keepdim) + eps) * weight``; ``x [..., hidden]``, ``weight [hidden]``."""
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def patchify(image: Tensor, patch_size: int) -> Tensor:
    """Cut an image into flattened patches.

    Args:
        image: ``[channels, height, width]``, height and width multiples of ``patch_size``.
        patch_size: patch side ``p`` in pixels.

    Returns:
        ``[(height/p) * (width/p), channels * p * p]``: patches in row-major
        (patch-row, patch-column) order, each flattened in (channel, dy, dx) order.
    """
    if image.dim() != 3:
        raise ValueError(f"patchify: image must be [channels, height, width], got shape {tuple(image.shape)}")
    channels, height, width = image.shape
    p = patch_size
    if p < 1 or height % p != 0 or width % p != 0:
        raise ValueError(f"patchify: image height {height} and width {width} must be multiples of the patch size {p}")
    rows, cols = height // p, width // p
    patches = image.reshape(channels, rows, p, cols, p)  # [c, row, dy, col, dx]
    patches = patches.permute(1, 3, 0, 2, 4)  # [row, col, c, dy, dx]
    return patches.reshape(rows * cols, channels * p * p)


def _image_list(pixel_values: Any) -> list[Tensor]:
    """``pixel_values`` as a list of ``[channels, height, width]`` images."""
    if isinstance(pixel_values, Tensor):
        if pixel_values.dim() == 3:
            return [pixel_values]
        if pixel_values.dim() == 4:
            return list(pixel_values.unbind(0))
        raise ValueError(
            f"pixel_values must be [channels, height, width], [images, channels, height, width] "
            f"or a list of [channels, height, width] tensors, got shape {tuple(pixel_values.shape)}"
        )
    if isinstance(pixel_values, Sequence):
        images = list(pixel_values)
        for index, image in enumerate(images):
            if not isinstance(image, Tensor) or image.dim() != 3:
                shape = tuple(image.shape) if isinstance(image, Tensor) else type(image).__name__
                raise ValueError(f"pixel_values[{index}] must be a [channels, height, width] tensor, got {shape}")
        return images
    raise ValueError(f"pixel_values must be a tensor or a list of tensors, got {type(pixel_values).__name__}")


def image_features(
    params: Mapping[str, Tensor], config: Inkling2Config | MistralLarge4Config, pixel_values: Any
) -> Tensor:
    """Patch features of all images, concatenated in order.

    Args:
        params: needs ``patch_proj [channels*p*p, hidden]`` and ``patch_bias [hidden]``.
        config: gives ``patch_size`` and ``image_channels``.
        pixel_values: one ``[channels, height, width]`` image, a list of them,
            or ``[images, channels, height, width]``.

    Returns:
        ``[total patches, hidden]`` = ``patches @ patch_proj + patch_bias``, in
        the dtype of ``patch_proj``.
    """
    proj = params["patch_proj"]
    images = _image_list(pixel_values)
    features = []
    for index, image in enumerate(images):
        if image.shape[0] != config.image_channels:
            raise ValueError(
                f"pixel_values image {index} has {image.shape[0]} channels, the config expects "
                f"image_channels = {config.image_channels}"
            )
        patches = patchify(image.to(proj.dtype), config.patch_size)
        features.append(patches @ proj + params["patch_bias"])
    if not features:
        return proj.new_zeros(0, proj.shape[1])
    return torch.cat(features, dim=0)


def splice_image_features(embeds: Tensor, features: Tensor, image_mask: Tensor) -> Tensor:
    """Replace the embeddings at the image slots by the image features (out of place).

    Args:
        embeds: ``[batch, sequence, hidden]``.
        features: ``[n, hidden]``, in order.
        image_mask: bool ``[batch, sequence]`` with exactly ``n`` True slots; the
            ``i``-th True slot in row-major order (batch, then sequence) gets
            ``features[i]``.

    Returns:
        A new ``[batch, sequence, hidden]`` tensor (``embeds`` is not modified).
    """
    if embeds.dim() != 3:
        raise ValueError(f"embeds must be [batch, sequence, hidden], got shape {tuple(embeds.shape)}")
    if tuple(image_mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(
            f"image_mask must be [batch, sequence] = {list(embeds.shape[:2])}, got shape {tuple(image_mask.shape)}"
        )
    if features.dim() != 2 or features.shape[1] != embeds.shape[2]:
        raise ValueError(f"image features must be [n, hidden={embeds.shape[2]}], got shape {tuple(features.shape)}")
    mask = image_mask.to(torch.bool)
    slots = int(mask.sum())
    if slots != features.shape[0]:
        raise ValueError(
            f"image_mask has {slots} True slots but the images give {features.shape[0]} patches; "
            f"mark exactly one slot per patch"
        )
    out = embeds.clone()
    out[mask] = features.to(out.dtype)
    return out


def _embed(params: Mapping[str, Tensor], config: Any, batch: Mapping) -> Tensor:
    """``splice(embed[input_ids], image_features(pixel_values), image_mask)``, ``[batch, sequence, hidden]``."""
    embed = params["embed"]
    input_ids = batch.get("input_ids")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}")
        bad = (input_ids < 0) | (input_ids >= config.vocab_size)
        if bool(bad.any()):
            b, s = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"input_ids[{b}, {s}] = {int(input_ids[b, s])} is outside the vocabulary "
                f"[0, {config.vocab_size}); padding slots need a valid id too (any id: padding "
                f"is decided from the layout)"
            )
        embeds = embed[input_ids]
    elif batch.get("inputs_embeds") is not None:
        embeds = batch["inputs_embeds"].to(embed.dtype)
    else:
        raise ValueError("batch needs input_ids (or inputs_embeds)")

    image_mask = batch.get("image_mask")
    pixel_values = batch.get("pixel_values")
    if image_mask is None:
        if pixel_values is not None:
            raise ValueError("batch has pixel_values but no image_mask; mark the image slots with image_mask")
        return embeds
    if pixel_values is None:
        if bool(torch.as_tensor(image_mask).any()):
            raise ValueError("batch has image_mask slots but no pixel_values; pass the images")
        return embeds
    return splice_image_features(embeds, image_features(params, config, pixel_values), torch.as_tensor(image_mask))


def _project_heads(a: Tensor, weight: Tensor, heads: int, head_dim: int) -> Tensor:
    """``a @ weight`` viewed as ``[batch, sequence, heads, head_dim]``."""
    batch, sequence, _ = a.shape
    return (a @ weight).reshape(batch, sequence, heads, head_dim)


def _attention_block(
    a: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    config: Any,
    layout: Layout,
    window: int | None,
) -> Tensor:
    """``attention(rope(a@wq), rope(a@wk), a@wv) as [B,S,Hq*Dh] @ wo``."""
    batch, sequence, _ = a.shape
    q = _project_heads(a, wq, config.num_heads, config.head_dim)  # [B, S, Hq, Dh]
    k = _project_heads(a, wk, config.num_kv_heads, config.head_dim)  # [B, S, Hkv, Dh]
    v = _project_heads(a, wv, config.num_kv_heads, config.head_dim)  # [B, S, Hkv, Dh]
    q = rotary_embedding(q, layout.positions, config.rope_base)
    k = rotary_embedding(k, layout.positions, config.rope_base)
    out = attention(q, k, v, layout.keep, layout.document_ids, window=window)
    return out.reshape(batch, sequence, config.num_heads * config.head_dim) @ wo


def _check_labels(batch: Mapping, shape: tuple[int, ...]) -> Tensor | None:
    labels = batch.get("labels")
    if labels is not None and tuple(labels.shape) != shape:
        raise ValueError(f"labels must be [batch, sequence] = {list(shape)}, got shape {tuple(labels.shape)}")
    return labels


def _no_loss(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dtype = logits.dtype if logits.dtype == torch.float64 else torch.float32
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    return zero, zero.clone(), torch.zeros((), dtype=torch.int64, device=logits.device)


# --------------------------------------------------------------------------
# Models


def inkling2_forward(params: Mapping[str, Tensor], config: Inkling2Config, batch: Mapping) -> ModelOutput:
    """Inkling2-mini forward (``docs/miniature_models.md``).

    ``loss`` is the aligned cross-entropy (label ``t`` is the target of
    position ``t``) over ``keep & labels != -100``, divided by that count.
    """
    layout = layout_from_batch(batch)
    inputs_embeds = _embed(params, config, batch)  # [B, S, D]
    labels = _check_labels(batch, tuple(inputs_embeds.shape[:2]))
    keep = layout.keep[..., None].to(inputs_embeds.dtype)

    x = inputs_embeds * keep
    mixed = causal_depthwise_conv(x, params["conv_weight"], layout.keep, layout.document_ids)
    x = x + F.silu(mixed) @ params["conv_out"]
    a = rms_norm(x, params["norm1"])
    x = x + _attention_block(a, params["wq"], params["wk"], params["wv"], params["wo"], config, layout, None)
    logits = (rms_norm(x, params["norm2"]) @ params["lm_head"]) * keep  # [B, S, V]

    if labels is None:
        loss, loss_sum, count = _no_loss(logits)
    else:
        loss_sum, count = aligned_cross_entropy(logits, labels, layout.keep)
        loss = mean_loss(loss_sum, count)
    return ModelOutput(inputs_embeds=inputs_embeds, logits=logits, loss=loss, loss_sum=loss_sum, count=count)


def mistral_large4_forward(params: Mapping[str, Tensor], config: MistralLarge4Config, batch: Mapping) -> ModelOutput:
    """MistralLarge4-mini forward (``docs/miniature_models.md``).

    Block 0 attends the whole document, block 1 uses ``config.sliding_window``.
    Logits are soft-capped (``logit_softcap * tanh(z / logit_softcap)``) and
    zeroed at padding; ``loss`` is the Hugging Face shifted cross-entropy that
    never predicts across a document boundary.
    """
    layout = layout_from_batch(batch)
    inputs_embeds = _embed(params, config, batch)
    labels = _check_labels(batch, tuple(inputs_embeds.shape[:2]))
    keep = layout.keep[..., None].to(inputs_embeds.dtype)

    x = inputs_embeds * keep
    for i in (0, 1):
        block = f"blocks.{i}."
        a = rms_norm(x, params[block + "norm"])
        window = None if i == 0 else config.sliding_window
        x = x + _attention_block(
            a,
            params[block + "wq"],
            params[block + "wk"],
            params[block + "wv"],
            params[block + "wo"],
            config,
            layout,
            window,
        )
    cap = config.logit_softcap
    logits = cap * torch.tanh((rms_norm(x, params["final_norm"]) @ params["lm_head"]) / cap) * keep

    if labels is None:
        loss, loss_sum, count = _no_loss(logits)
    else:
        loss_sum, count = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
        loss = mean_loss(loss_sum, count)
    return ModelOutput(inputs_embeds=inputs_embeds, logits=logits, loss=loss, loss_sum=loss_sum, count=count)
