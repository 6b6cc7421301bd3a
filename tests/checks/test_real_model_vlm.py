"""The real-model check with images: nemo-automodel 0.7.0's Qwen3.5-MoE VLM (tiny config) through the VLM recipe's
CP path (``prepare_model_inputs_for_cp`` -> ``shard_batch_aux_only``, the splice of the vision tower's features
into the full row before the round-robin shard, torch's ring on the stand-in ``ring_sdpa_cpu``).

On the session's shared real-model pool (``tests/conftest.py``). A smoke whose images cross the shard boundaries must
pass with the vision tower's and the embeddings' gradients judged; an injected defect (the image features spliced
detached under CP, ``tests/fixtures/real_model_spec_qwen3_5_moe_vlm_vision_grad_detached.py``) must fail naming the
vision tower's gradients and nothing else; a second (the spliced embeddings sharded contiguously under round-robin
labels and positions, ``..._embeds_contiguous.py``) must fail from the first differing chunk on; the two findings are pinned as what they are (M7: one device drops the
mRoPE image positions; M8: the round-robin routers count the CP divisibility padding). Without ranks: the
reordered reference's ``reorder_rows`` and the drawn images. Deeper runs: ``docs/models/qwen3_5_moe_vlm.md``.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from real_model_cases import real_model_case

from cp_harness.judging.render import report_text

# The subjects whose CP path these tests run and judge (examples/automodel/tools/coverage.py reads it).
JUDGES = ("spec:qwen3_5_moe_vlm", "spec:qwen3_5_moe_vlm_mrope")

VLM = "examples.automodel.models.qwen3_5_moe_vlm"
MROPE = "examples.automodel.models.qwen3_5_moe_vlm_mrope"
DETACHED = "real_model_spec_qwen3_5_moe_vlm_vision_grad_detached"
CONTIGUOUS = "real_model_spec_qwen3_5_moe_vlm_embeds_contiguous"

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool

# Lengths that are multiples of 2 x CP (no divisibility padding, so M8 stays out; test_m8 pins it): at CP 2 the 16
# tokens are 4 chunks of 4 (rank 0: 0-3 and 12-15, rank 1: 4-11), at CP 3 the 18 tokens 6 chunks of 3.
SMOKE = [
    # Two rows, three images: row 0's 2 x 3 image (positions 2-7) crosses rank 0 -> rank 1, its 1 x 2 image (10-11)
    # sits in rank 1's second chunk; row 1's 2 x 2 image (4-7) is all rank 1's.
    real_model_case(MROPE, "float32", 2, kind="images", seq_len=16, batch_size=2, seed=3,
                    images=[[[2, 2, 3], [10, 1, 2]], [[4, 2, 2]]]),
    # One 3 x 3 image (positions 5-13) across three chunks of three ranks (chunks 1-4), bfloat16.
    real_model_case(MROPE, "bfloat16", 3, kind="images", seq_len=18, seed=5, images=[[[5, 3, 3]]]),
]  # fmt: skip


def _names(report) -> dict[str, object]:
    return {c.name.split(" (")[0]: c for c in report.comparisons}


def test_smoke_images_across_shards_judge_the_vision_tower_and_embeddings(real_models):
    started = time.perf_counter()
    for case in SMOKE:
        report = real_models.run(case)
        assert report.ok, report_text(report)
        names = _names(report)
        assert {"logits", "loss", "grad model.language_model.embed_tokens.weight"} <= set(names)
        vision = [n for n in names if n.startswith("grad model.visual.")]
        assert len(vision) >= 15, sorted(names)  # patch embedding, the block, the merger: every vision parameter
        assert report.standins, "the ring ran on its CPU stand-in and the report says so"
    print(f"qwen3_5_moe_vlm_mrope: {len(SMOKE)} smoke cases in {time.perf_counter() - started:.1f} s")


def test_vision_features_spliced_detached_fail_on_the_vision_gradients_only(real_models):
    case = {**SMOKE[0], "spec": DETACHED}
    report = real_models.run(case)
    text = report_text(report)
    assert not report.ok, text
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert failing and all(n.startswith("grad model.visual.") for n in failing), text  # forward and LM right
    assert "grad model.visual.patch_embed.proj.weight" in failing, text
    assert "parameter model.visual." in text and "CP 0" in text.replace("CP -0", "CP 0"), text  # CP's gradient is 0
    assert not report.problems, text


def test_spliced_embeddings_sharded_contiguously_under_round_robin_labels_fail_from_position_4(real_models):
    case = {**SMOKE[0], "spec": CONTIGUOUS}  # CP 2, 16 tokens: round robin gives rank 0 positions 0-3 and 12-15
    report = real_models.run(case)
    text = report_text(report)
    failing = {c.name.split(" (")[0]: c for c in report.failures()}
    assert "logits" in failing and failing["logits"].worst_index[1] >= 4, text  # rank 0's first chunk stays right
    assert "loss" in failing and "grad model.visual.patch_embed.proj.weight" in failing, text
    assert not report.problems, text


def test_m7_one_device_drops_the_mrope_image_positions(real_models):
    """Finding M7 (examples/automodel/repro/models/qwen3_5_moe_vlm_one_device_mrope.py): on the default collater's
    batch CP computes mRoPE positions, one device 0..S-1; the logits differ from the image's second token on."""
    case = real_model_case(VLM, "float32", 2, kind="images", seq_len=16, seed=3, images=[[[2, 2, 3]]])
    report = real_models.run(case)
    text = report_text(report)
    assert not report.ok, text
    failing = {c.name.split(" (")[0]: c for c in report.failures()}
    assert "logits" in failing and failing["logits"].worst_index[1] >= 3, text  # image tokens 3-7 and the text after
    assert report_text(real_models.run({**case, "spec": MROPE})).count("FAIL") == 0  # positions given: CP right


def test_m8_round_robin_routers_count_the_divisibility_padding(real_models):
    """Finding M8 (examples/automodel/repro/models/qwen3_5_moe_round_robin_router_padding.py): 13 tokens at CP 2 are
    padded to 16; only the routers' gradients fail (their load-balancing loss counts the padded positions)."""
    case = real_model_case(MROPE, "float32", 2, kind="images", seq_len=13, seed=3, images=[[[2, 2, 3]]])
    report = real_models.run(case)
    text = report_text(report)
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert failing and failing <= {f"grad model.language_model.layers.{i}.mlp.gate.weight" for i in (0, 1)}, text
    assert not report.problems, text


# ---- without ranks -------------------------------------------------------------------------------------------
def test_reorder_rows_moves_each_rows_images_with_it():
    from examples.automodel.models import qwen3_5_moe_vlm as spec

    batch = spec.make_batch("images", 12, batch_size=2, seed=1, images=[[[1, 1, 2], [5, 2, 2]], [[3, 1, 3]]])
    back = spec.reorder_rows(batch, [1, 0])
    assert back["image_grid_thw"].tolist() == [[1, 1, 3], [1, 1, 2], [1, 2, 2]]
    assert torch.equal(back["pixel_values"][:3], batch["pixel_values"][6:9])  # row 1's image first
    assert torch.equal(back["pixel_values"][3:], batch["pixel_values"][:6])
    again = spec.reorder_rows(back, [1, 0])
    assert all(torch.equal(again[k], batch[k]) for k in batch)


def test_a_media_batch_without_reorder_rows_is_refused_not_reversed_by_shape():
    from cp_harness.usage import model_specs
    from examples.automodel.models import qwen3_5_moe_vlm as spec

    batch = spec.make_batch("images", 6, batch_size=2, seed=0, images=[[[1, 1, 1]], [[2, 1, 1]]])  # 2 patches, 2 rows
    plain = type("Spec", (), {"NAME": "no_reorder"})()
    with pytest.raises(ValueError, match="reorder_rows"):
        model_specs._row_order(plain, batch, [1, 0])


@pytest.mark.parametrize(
    "images, match",
    [([[[0, 2, 2]], [[3, 1, 1]]], "touches"), ([[[5, 2, 2]]], "exceeds"), ([[[0, 1, 1], [1, 1, 1]]], "touches")],
)
def test_bad_images_are_refused_naming_what_is_wrong(images, match):
    from examples.automodel.models import qwen3_5_moe_vlm as spec

    rows = len(images)
    images = images if rows == 1 else [images[0] + images[1]]
    with pytest.raises(ValueError, match=match):
        spec.make_batch("images", 6, batch_size=1, images=images)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_drawn_images_fit_the_row_apart_with_a_text_target_after_each(data):
    from cp_harness.checks.real_model import _batches  # its images: cases.strategies.row_images

    batch = data.draw(_batches(("images",)))
    seq_len = batch["seq_len"]
    assert len(batch["images"]) == batch["batch_size"]
    for row in batch["images"]:
        assert 1 <= len(row) <= 2
        end = -1
        for start, h, w in row:
            assert start > end and 1 <= h <= 3 and 1 <= w <= 3
            end = start + h * w
            assert end <= seq_len - 1  # a text token after the image
