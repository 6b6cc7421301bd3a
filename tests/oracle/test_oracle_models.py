"""Oracle miniature models: parameters, shared pieces, padding invariance,
packing invariance, image splice, dtype agreement."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.layout import FILLER, IGNORE_INDEX
from oracle.models import (
    Inkling2Config,
    MistralLarge4Config,
    ModelOutput,
    image_features,
    init_inkling2_params,
    init_mistral_large4_params,
    inkling2_forward,
    mistral_large4_forward,
    patchify,
    rms_norm,
    splice_image_features,
)

INK = Inkling2Config()
MIS = MistralLarge4Config()
MODELS = {
    "inkling2": (INK, init_inkling2_params, inkling2_forward),
    "mistral_large4": (MIS, init_mistral_large4_params, mistral_large4_forward),
}


def _ids(shape, seed, vocab=40):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------- parameters


def _documented_specs(name):
    """(name, shape, scale rule) in the order of docs/miniature_models.md, written out by hand."""
    D, V, Hq, Hkv, Dh = 16, 40, 4, 2, 4
    attn = lambda prefix: [  # noqa: E731
        (prefix + "wq", (D, Hq * Dh), "m"), (prefix + "wk", (D, Hkv * Dh), "m"),
        (prefix + "wv", (D, Hkv * Dh), "m"), (prefix + "wo", (Hq * Dh, D), "m"),
    ]
    head = [("embed", (V, D), "e"), ("patch_proj", (12, D), "m"), ("patch_bias", (D,), "b")]
    if name == "inkling2":
        return head + [("conv_weight", (4, D), "c"), ("conv_out", (D, D), "m"), ("norm1", (D,), "n")] + attn("") + [
            ("norm2", (D,), "n"), ("lm_head", (D, V), "m")]
    blocks = []
    for i in (0, 1):
        blocks += [(f"blocks.{i}.norm", (D,), "n")] + attn(f"blocks.{i}.")
    return head + blocks + [("final_norm", (D,), "n"), ("lm_head", (D, V), "m")]


@pytest.mark.parametrize("name", list(MODELS))
def test_params_follow_the_documented_draw(name):
    config, init, _ = MODELS[name]
    params = init(config, seed=1234)
    specs = _documented_specs(name)
    assert list(params) == [s[0] for s in specs]
    g = torch.Generator().manual_seed(1234)
    for pname, shape, rule in specs:
        draw = torch.randn(shape, generator=g, dtype=torch.float64)
        expected = {"e": draw, "m": draw / shape[0] ** 0.5, "c": draw * 0.5, "b": draw * 0.1, "n": 1 + 0.1 * draw}[rule]
        p = params[pname]
        assert p.is_leaf and p.requires_grad and p.dtype == torch.float64 and p.shape == shape
        torch.testing.assert_close(p.detach(), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_params_seed_and_dtype(name):
    config, init, _ = MODELS[name]
    a, b, c = init(config, 7), init(config, 7), init(config, 8)
    f32 = init(config, 7, dtype=torch.float32)
    for key in a:
        assert torch.equal(a[key], b[key])
        assert not torch.equal(a[key], c[key])
        assert f32[key].dtype == torch.float32 and f32[key].is_leaf and f32[key].requires_grad
        assert torch.equal(f32[key], a[key].detach().to(torch.float32))
    for low in (torch.bfloat16, torch.float16):  # the rounded float64 draws, as for float32
        params = init(config, 7, dtype=low)
        assert all(torch.equal(params[k], a[k].detach().to(low)) and params[k].dtype == low for k in a)
    with pytest.raises(ValueError, match="dtype"):
        init(config, 7, dtype=torch.int64)


def test_config_defaults():
    assert dataclasses.asdict(INK) == dict(vocab_size=40, hidden=16, num_heads=4, num_kv_heads=2, head_dim=4,
                                           conv_width=4, patch_size=2, image_channels=3, rope_base=10000.0)
    assert dataclasses.asdict(MIS) == dict(vocab_size=40, hidden=16, num_heads=4, num_kv_heads=2, head_dim=4,
                                           sliding_window=8, logit_softcap=5.0, patch_size=2, image_channels=3,
                                           rope_base=10000.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        INK.hidden = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        init_inkling2_params(dataclasses.replace(INK, num_kv_heads=3), 0)


# ----------------------------------------------------------- shared pieces


def test_rms_norm_hand_value():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    scale = (12.5 + 1e-6) ** -0.5
    torch.testing.assert_close(rms_norm(x, w), torch.tensor([[3.0 * scale, 8.0 * scale]], dtype=torch.float64),
                               rtol=1e-15, atol=0)


def test_patchify_order():
    image = torch.arange(2 * 4 * 6, dtype=torch.float64).reshape(2, 4, 6)  # [C=2, H=4, W=6]
    patches = patchify(image, 2)
    assert patches.shape == (6, 8)
    for index in range(6):
        row, col = divmod(index, 3)  # row-major over the 2 x 3 patch grid
        expected = [image[c, 2 * row + dy, 2 * col + dx].item() for c in range(2) for dy in range(2) for dx in range(2)]
        assert patches[index].tolist() == expected
    with pytest.raises(ValueError, match="multiples of the patch size"):
        patchify(torch.zeros(3, 3, 4), 2)


def test_image_features_forms_agree():
    params = init_inkling2_params(INK, 0)
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, 4, 2, generator=g, dtype=torch.float64) for _ in range(2)]
    from_list = image_features(params, INK, images)
    from_stack = image_features(params, INK, torch.stack(images))
    one = image_features(params, INK, images[0])
    assert from_list.shape == (4, 16)
    assert torch.equal(from_list, from_stack)
    assert torch.equal(from_list[:2], one)
    expected = patchify(images[1], 2) @ params["patch_proj"] + params["patch_bias"]
    assert torch.equal(from_list[2:], expected)
    assert image_features(params, INK, []).shape == (0, 16)
    with pytest.raises(ValueError, match="channels"):
        image_features(params, INK, torch.zeros(2, 2, 2))


def test_splice_places_features_in_row_major_order():
    embeds = torch.zeros(2, 3, 2, dtype=torch.float64)
    mask = torch.tensor([[False, True, True], [True, False, False]])
    features = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]], dtype=torch.float64)
    out = splice_image_features(embeds, features, mask)
    assert torch.equal(embeds, torch.zeros(2, 3, 2, dtype=torch.float64))  # out of place
    assert out[0, 1].tolist() == [1.0, 1.5] and out[0, 2].tolist() == [2.0, 2.5] and out[1, 0].tolist() == [3.0, 3.5]
    assert out[0, 0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="3 True slots but the images give 2 patches"):
        splice_image_features(embeds, features[:2], mask)


# ------------------------------------------------------------------ models

# Packed batch: row 0 holds documents of 5, 11 (longer than the window) and 3
# real tokens with per-document padding; row 1 one document and a tail.
SEQ = 24
PACKED_LENS = [[5, 11, 3], [9, FILLER, FILLER]]
PACKED_PADDED = [[6, 12, 3], [10, FILLER, FILLER]]


def _packed_batch(seed=0):
    return {
        "input_ids": _ids((2, SEQ), seed),
        "labels": _ids((2, SEQ), seed + 1).masked_fill(torch.rand(2, SEQ, generator=torch.Generator().manual_seed(seed)) < 0.15,
                                                       IGNORE_INDEX),
        "seq_lens": torch.tensor(PACKED_LENS),
        "seq_lens_padded": torch.tensor(PACKED_PADDED),
    }


def _real_spans(lens, padded):
    """[(row, start, length)] of every document's real tokens."""
    spans = []
    for b, (real_row, padded_row) in enumerate(zip(lens, padded)):
        start = 0
        for real, pad in zip(real_row, padded_row):
            if real == FILLER:
                break
            spans.append((b, start, real))
            start += pad
    return spans


def _keep(lens, padded, sequence):
    keep = torch.zeros(len(lens), sequence, dtype=torch.bool)
    for b, start, real in _real_spans(lens, padded):
        keep[b, start : start + real] = True
    return keep


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_rows_equal_documents_run_alone(name):
    config, init, forward = MODELS[name]
    params = init(config, 3)
    batch = _packed_batch(seed=5)
    packed = forward(params, config, batch)
    assert isinstance(packed, ModelOutput)
    total, count = 0.0, 0
    for b, start, real in _real_spans(PACKED_LENS, PACKED_PADDED):
        alone = forward(params, config, {
            "input_ids": batch["input_ids"][b : b + 1, start : start + real],
            "labels": batch["labels"][b : b + 1, start : start + real],
        })
        torch.testing.assert_close(packed.logits[b, start : start + real], alone.logits[0], rtol=1e-12, atol=1e-12)
        total += alone.loss_sum.item()
        count += int(alone.count)
    assert int(packed.count) == count
    assert packed.loss_sum.item() == pytest.approx(total, rel=1e-12)
    keep = _keep(PACKED_LENS, PACKED_PADDED, SEQ)
    assert torch.equal(packed.logits[~keep], torch.zeros_like(packed.logits[~keep]))


@pytest.mark.parametrize("name", list(MODELS))
def test_left_and_two_sided_padding_equal_unpadded_rows(name):
    config, init, forward = MODELS[name]
    params = init(config, 4)
    ids = _ids((1, 10), 6)
    labels = _ids((1, 10), 7)
    alone = forward(params, config, {"input_ids": ids, "labels": labels})
    for left, right in ((3, 0), (2, 2), (0, 4)):
        padded_ids = torch.cat([torch.zeros(1, left, dtype=torch.int64), ids, torch.zeros(1, right, dtype=torch.int64)], 1)
        padded_labels = torch.cat([torch.full((1, left), 5), labels, torch.full((1, right), 5)], 1)
        mask = torch.tensor([[0] * left + [1] * 10 + [0] * right])
        out = forward(params, config, {"input_ids": padded_ids, "labels": padded_labels, "attention_mask": mask})
        torch.testing.assert_close(out.logits[0, left : left + 10], alone.logits[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.loss, alone.loss, rtol=1e-12, atol=0)
        assert int(out.count) == int(alone.count)


@pytest.mark.parametrize("name", list(MODELS))
def test_padding_ids_and_padding_embeddings_do_not_matter(name):
    config, init, forward = MODELS[name]
    params = init(config, 5)
    batch = _packed_batch(seed=8)
    keep = _keep(PACKED_LENS, PACKED_PADDED, SEQ)
    base = forward(params, config, batch)

    other_ids = dict(batch, input_ids=batch["input_ids"].masked_fill(~keep, 17))
    changed = forward(params, config, other_ids)
    assert torch.equal(changed.logits, base.logits)
    assert torch.equal(changed.loss, base.loss)

    embeds = params["embed"].detach()[batch["input_ids"]].clone()
    embeds[~keep] = 1e6
    with_embeds = {k: v for k, v in batch.items() if k != "input_ids"}
    with_embeds["inputs_embeds"] = embeds
    from_embeds = forward(params, config, with_embeds)
    assert torch.equal(from_embeds.logits[keep], base.logits[keep])
    assert torch.equal(from_embeds.loss, base.loss)

    other_labels = dict(batch, labels=batch["labels"].masked_fill(~keep, 3))
    if name == "inkling2":  # aligned: a padding slot's label is never a target
        assert torch.equal(forward(params, config, other_labels).loss, base.loss)


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_at_padding_are_exactly_zero(name):
    config, init, forward = MODELS[name]
    params = init(config, 6)
    batch = _packed_batch(seed=9)
    keep = _keep(PACKED_LENS, PACKED_PADDED, SEQ)
    out = forward(params, config, batch)
    out.inputs_embeds.retain_grad()
    out.loss.backward()
    grad = out.inputs_embeds.grad
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    assert grad[keep].abs().sum() > 0
    for key, p in params.items():
        if key.startswith("patch_"):
            assert p.grad is None, key  # no image: the patch projection is not used
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, key


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_agrees_with_float64(name):
    config, init, forward = MODELS[name]
    batch = _packed_batch(seed=10)
    out64 = forward(init(config, 7), config, batch)
    out32 = forward(init(config, 7, dtype=torch.float32), config, batch)
    assert out32.logits.dtype == torch.float32 and out32.loss.dtype == torch.float32
    assert out64.logits.dtype == torch.float64 and out64.loss.dtype == torch.float64
    torch.testing.assert_close(out32.logits.double(), out64.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out32.loss.double(), out64.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_image_splice_in_the_model(name):
    config, init, forward = MODELS[name]
    params = init(config, 8)
    g = torch.Generator().manual_seed(11)
    image = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)  # 4 patches
    ids = _ids((2, 8), 12)
    image_mask = torch.zeros(2, 8, dtype=torch.bool)
    image_mask[0, 6:] = True
    image_mask[1, 1:3] = True
    batch = {"input_ids": ids, "labels": _ids((2, 8), 13), "image_mask": image_mask, "pixel_values": image}
    out = forward(params, config, batch)
    features = image_features(params, config, image)
    assert torch.equal(out.inputs_embeds[0, 6:], features[:2])
    assert torch.equal(out.inputs_embeds[1, 1:3], features[2:])
    assert torch.equal(out.inputs_embeds[~image_mask], params["embed"][ids][~image_mask])
    out.loss.backward()
    assert params["patch_proj"].grad.abs().sum() > 0
    if name == "inkling2":  # a list of images and one [N, C, H, W] tensor
        two = [image[:, :2], image[:, 2:]]  # the two patch rows as two images
        for pixel_values in (two, torch.stack(two)):
            again = forward(params, config, dict(batch, pixel_values=pixel_values))
            torch.testing.assert_close(again.logits, out.logits, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="True slots"):
        forward(params, config, dict(batch, pixel_values=image[:, :2]))
    with pytest.raises(ValueError, match="no image_mask"):
        forward(params, config, {"input_ids": ids, "pixel_values": image})
    with pytest.raises(ValueError, match="no pixel_values"):
        forward(params, config, {"input_ids": ids, "image_mask": image_mask})


@pytest.mark.parametrize("name", list(MODELS))
def test_no_labels_and_no_counted_labels(name):
    config, init, forward = MODELS[name]
    params = init(config, 9)
    ids = _ids((2, 6), 14)
    out = forward(params, config, {"input_ids": ids})
    assert out.loss.item() == 0.0 and out.loss_sum.item() == 0.0 and int(out.count) == 0
    assert out.count.dtype == torch.int64
    out = forward(params, config, {"input_ids": ids, "labels": torch.full((2, 6), IGNORE_INDEX)})
    assert out.loss.item() == 0.0 and int(out.count) == 0
    out.loss.backward()
    for p in params.values():
        assert p.grad is None or torch.equal(p.grad, torch.zeros_like(p.grad))


def test_mistral_window_and_softcap_take_effect():
    params = init_mistral_large4_params(MIS, 10)
    batch = {"input_ids": _ids((1, 14), 15)}
    out = mistral_large4_forward(params, MIS, batch)
    assert out.logits.abs().max() < MIS.logit_softcap
    wide = mistral_large4_forward(params, dataclasses.replace(MIS, sliding_window=100), batch)
    assert torch.equal(wide.logits[0, :8], out.logits[0, :8])  # window not reached yet
    assert not torch.allclose(wide.logits[0, 8:], out.logits[0, 8:])


def test_inkling2_loss_is_aligned_and_mistral_loss_is_shifted():
    ids = _ids((1, 5), 16)
    labels = torch.full((1, 5), IGNORE_INDEX)
    labels[0, 0] = 7  # target of position 0 (aligned); never a target when shifted
    ink = inkling2_forward(init_inkling2_params(INK, 0), INK, {"input_ids": ids, "labels": labels})
    assert int(ink.count) == 1
    torch.testing.assert_close(ink.loss, -torch.log_softmax(ink.logits[0, 0], -1)[7])
    mis = mistral_large4_forward(init_mistral_large4_params(MIS, 0), MIS, {"input_ids": ids, "labels": labels})
    assert int(mis.count) == 0
    labels[0, 0], labels[0, 1] = IGNORE_INDEX, 7
    mis = mistral_large4_forward(init_mistral_large4_params(MIS, 0), MIS, {"input_ids": ids, "labels": labels})
    assert int(mis.count) == 1
    torch.testing.assert_close(mis.loss, -torch.log_softmax(mis.logits[0, 0], -1)[7])


@pytest.mark.parametrize("name", list(MODELS))
def test_gradcheck_inputs_embeds(name):
    config, init, forward = MODELS[name]
    params = {k: v.detach() for k, v in init(config, 11).items()}
    batch = {"labels": _ids((1, 5), 17), "seq_lens": torch.tensor([[2, 2]]), "seq_lens_padded": torch.tensor([[2, 3]])}
    embeds = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(18), dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: forward(params, config, dict(batch, inputs_embeds=e)).loss, (embeds,))


def test_errors():
    params = init_inkling2_params(INK, 0)
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\] = 40"):
        inkling2_forward(params, INK, {"input_ids": torch.tensor([[1, 40]])})
    with pytest.raises(ValueError, match="labels must be"):
        inkling2_forward(params, INK, {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[1]])})


@st.composite
def packings(draw):
    count = draw(st.integers(1, 3))
    lens = [draw(st.integers(0, 9)) for _ in range(count)]
    padded = [r + draw(st.integers(0, 2)) for r in lens]
    tail = draw(st.integers(0, 2))
    return lens, padded, sum(padded) + tail, draw(st.integers(0, 2**16)), draw(st.sampled_from(list(MODELS)))


@settings(max_examples=8, deadline=None)
@given(packings())
def test_property_packing_invariance(case):
    lens, padded, sequence, seed, name = case
    config, init, forward = MODELS[name]
    params = init(config, 12)
    ids = _ids((1, sequence), seed)
    packed = forward(params, config, {"input_ids": ids, "seq_lens": torch.tensor([lens]), "seq_lens_padded": torch.tensor([padded])})
    for _, start, real in _real_spans([lens], [padded]):
        if real:
            alone = forward(params, config, {"input_ids": ids[:, start : start + real]})
            torch.testing.assert_close(packed.logits[0, start : start + real], alone.logits[0], rtol=1e-12, atol=1e-12)
