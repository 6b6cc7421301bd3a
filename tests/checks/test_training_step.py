"""The training-step check (``cp_harness.checks.training_step``) on nemo-automodel 0.7.0's DeepSeek V4.1 (tiny
config): one step as ``recipes/llm/train_ft.py`` runs it on ``dp_shard x cp = 2 x 2`` (the framework's mesh and
parallelizer, FSDP2 over ``dp_shard_cp`` on gloo), against one device on the whole global batch.

One pool of 4 ranks for the module (the framework's mesh covers the whole default group). The smoke must pass,
judging the loss, the logits, every parameter gradient and the gradient norm; two one-line regressions of the
recipe's step (``tests/fixtures/training_step_driver_*``) must fail naming what they corrupt; a case whose global
rows do not split over dp must say which field and how to fix it, on every rank. Skipped without the framework.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import pytest

from cp_harness.checks.training_step import smoke_cases
from cp_harness.judging.render import report_text

JUDGES = (
    "spec:deepseek_v41",
    "spec:qwen3_5_moe",
    "spec:glm_moe_dsa",
    "training:deepseek_v41",
    "training:qwen3_5_moe",
    "training:glm_moe_dsa",
    "spec:qwen3_5_moe_vlm_mrope",
    "training:qwen3_5_moe_vlm_mrope",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SPEC = "examples.automodel.models.deepseek_v41"
QWEN = "examples.automodel.models.qwen3_5_moe"  # NEAT packing (_packed_seq_ids, 4-D mask), a router aux loss
GLM = "examples.automodel.models.glm_moe_dsa"  # packed THD through process_input_for_thd, bfloat16, a stand-in
# The VLM recipe's step with images (shard_batch_aux_only, the splice inside the forward); the loader's mRoPE positions
# in the batch, so that finding M7 (one device drops them) stays out of the smoke.
VLM = "examples.automodel.models.qwen3_5_moe_vlm_mrope"
# 16 tokens per row (a multiple of 2 x CP: no divisibility padding, finding M8 stays out), one row per dp rank. dp rank
# 0's row: a 2 x 3 image at 2-7 crossing CP rank 0's first chunk (0-3) into rank 1's (4-11), a 1 x 2 image at 10-11;
# dp rank 1's row: a 2 x 2 image at 4-7. Then the same with dp rank 1's row text only (no media in its micro-batch).
IMAGES = {"kind": "images", "seq_len": 16, "batch_size": 2, "seed": 3, "images": [[[2, 2, 3], [10, 1, 2]], [[4, 2, 2]]]}
IMAGES_ONE_RANK = {**IMAGES, "images": [[[2, 2, 3], [10, 1, 2]], []]}
# One 2 x 2 image per dp rank (same sizes: a dp rank handed the other's pixels raises nothing).
IMAGES_SAME_SIZE = {**IMAGES, "images": [[[2, 2, 2]], [[9, 2, 2]]]}
# Different label counts on the two dp ranks (15 and 10): a count not summed over dp changes the result.
UNEVEN = {"kind": "packed", "seq_len": 19, "batch_size": 2, "documents": [[7, 5, 6], [3, 1, 9]], "seed": 1}

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None or importlib.util.find_spec("nemo_automodel") is None,
        reason="the training-step check needs transformers and nemo-automodel (the 'models' extra)",
    ),
    pytest.mark.xdist_group("training_step"),
]


@pytest.fixture(scope="module")
def step_runner():
    """A ``CaseRunner`` on a pool of 4 ranks, DeepSeek V4.1 preloaded, the fixtures importable, the framework's MoE
    activations eager (as the shared real-model pool runs them, ``tests/conftest.py``)."""
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "TORCHDYNAMO_DISABLE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIXTURES), str(ROOT), saved["PYTHONPATH"]) if p)
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    runner = CaseRunner(
        PoolConfig(
            world_size=4, impl="cp_impl", case_timeout=240.0, collective_timeout=120.0, preload=(SPEC, QWEN, VLM)
        )
    )
    try:
        runner.pool.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield runner
    finally:
        runner.close()


def _case(batch: dict, driver: str | None = None, spec: str = SPEC) -> dict:
    case = {
        "check": "training_step",
        "spec": spec,
        "dtype": "float32",
        "seed": 0,
        "batch": batch,
        "world_size": 4,
        "dp_shard": 2,
        "cp": 2,
    }
    return {**case, "driver": driver} if driver else case


def test_smoke_deepseek_v41_dp2_cp2(step_runner):
    cases = smoke_cases(SPEC)
    assert any(c["batch"].get("documents") == UNEVEN["documents"] for c in cases)
    started = time.perf_counter()
    for case in cases:
        report = step_runner.run(case)
        assert report.ok, report_text(report)
        names = {c.name.split(" (")[0] for c in report.comparisons}
        assert {"logits", "loss", "grad_norm"} <= names, names
        assert sum(n.startswith("grad model.") for n in names) > 50  # every parameter gradient
        assert any("D2" in why for why in report.not_judged.values())  # the gloo stand-in is said
    print(f"training-step smoke: {len(cases)} cases in {time.perf_counter() - started:.1f} s")


def test_smoke_qwen3_5_moe_neat_packing_and_router_aux_loss(step_runner):
    """One NEAT-packed case (``_packed_seq_ids``, the block-diagonal CP path; label counts 15 and 10 on the two dp
    ranks): the router's load-balancing loss is judged through the recipe's aux-loss scale, against one device's
    gradient accumulation over the same two micro-batches."""
    report = step_runner.run(_case(UNEVEN, spec=QWEN))
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    assert "grad model.language_model.layers.0.mlp.gate.weight" in names and "grad_norm" in names, names
    assert report.info["dp_label_counts"] == [15, 10], report.info


def test_smoke_glm_moe_dsa_bfloat16_thd_batches_on_its_stand_in(step_runner):
    """The bfloat16 row's one spec (``TRAINING_DTYPES``): GLM DSA's packed THD CP inside the recipe's step, its hook
    turning each dp rank's rows into ``process_input_for_thd`` batches (label counts 15 and 10), FSDP2 over
    ``dp_shard_cp``, the TileLang kernels on ``glm_dsa_kernels_cpu`` (named in the report); every gradient judged."""
    report = step_runner.run({**_case(UNEVEN, spec=GLM), "dtype": "bfloat16"})
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    assert {"logits", "loss", "grad_norm"} <= names and sum(n.startswith("grad model.") for n in names) > 50, names
    assert report.info["dp_label_counts"] == [15, 10], report.info
    assert set(report.standins) == {"glm_dsa_kernels_cpu"}, report.standins


def test_glm_moe_dsa_kv_gather_backward_not_reduced_fails_the_step_on_gradients(step_runner):
    """The real-model check's gradient-only GLM fixture (the K/V all-gather's backward keeps the rank's own slice) in
    the training step: one document per row over both CP ranks (24 tokens, 12 per rank); the loss and logits pass,
    the latent K/V projections' gradients (FSDP2-reduced over ``dp_shard_cp``) fail."""
    batch = {"kind": "plain", "seq_len": 24, "batch_size": 2, "seed": 1}
    case = {**_case(batch, spec="real_model_spec_glm_moe_dsa_kv_gather_grad_not_reduced"), "dtype": "bfloat16"}
    text, failing = _failures(case, step_runner)
    assert any("kv_a_proj_with_mqa" in n for n in failing), text
    assert "loss" not in failing and "logits" not in failing, text  # the forward is untouched


def test_smoke_vlm_images_the_vlm_recipes_step(step_runner):
    """The VLM recipe's step with images on ``dp_shard x cp = 2 x 2``: each dp rank gets its rows *with their images*
    (``model_specs.select_rows``), the vision tower runs inside the forward and its features are spliced before the
    round-robin shard, FSDP2 reduces every gradient over ``dp_shard_cp``; one device accumulates the same two
    micro-batches. The loss, the logits, every gradient (the vision tower's and the embeddings' included) and the norm
    are judged; the label counts per dp rank are the text targets of its rows (-100 where the target is an image)."""
    report = step_runner.run(_case(IMAGES, spec=VLM))
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    vision = {n for n in names if n.startswith("grad model.visual.")}
    assert len(vision) >= 15 and "grad model.visual.patch_embed.proj.weight" in vision, sorted(names)
    assert {"logits", "loss", "grad_norm", "grad model.language_model.embed_tokens.weight"} <= names, names
    assert report.info["dp_image_counts"] == [2, 1], report.info
    assert report.info["dp_label_counts"] == _labels(IMAGES), report.info


def test_vlm_dp_rank_images_cut_from_the_global_start_fail_on_vision_and_its_rows(step_runner):
    """The fixture hands dp rank 1 dp rank 0's pixels (the flat media sliced from the start, not by its rows): the
    loss, the logits and the vision tower's gradients fail; the gradient norm with them."""
    assert step_runner.run(_case(IMAGES_SAME_SIZE, spec=VLM)).ok  # the same case passes with the right images
    case = _case(IMAGES_SAME_SIZE, "training_step_driver_vlm_images_from_start", spec=VLM)
    text, failing = _failures(case, step_runner)
    assert {"loss", "logits", "grad model.visual.patch_embed.proj.weight"} <= failing, text
    assert "worst at row 1," in text.split("FAIL logits", 1)[1].split("\n", 1)[0], text  # in dp rank 1's row


def test_vlm_dp_rank_without_images_is_refused_on_every_rank_naming_the_fake_image(step_runner):
    """A dp rank whose rows hold no image would skip the vision tower's FSDP2 all-gathers (measured: gloo aborts
    the step); the case is refused on every rank before any collective, naming the field and the framework's fix."""
    report = step_runner.run(_case(IMAGES_ONE_RANK, spec=VLM))
    text = report_text(report)
    assert not report.ok and "dp rank 1's rows hold no image" in text and "batch.fake_images" in text, text
    assert "failed on rank(s) [0, 1, 2, 3]" in text, text


def test_m9_text_only_dp_rank_with_the_frameworks_fake_image_differs_under_cp(step_runner):
    """Finding M9 (examples/automodel/repro/models/qwen3_5_moe_vlm_fake_image_cp.py): dp rank 1's text-only row
    carries the framework's fake image, masked by attention_mask 0; under CP the mask is dropped, so its text attends
    to the image: the logits of that row, the loss and the gradients differ from one device."""
    report = step_runner.run(_case({**IMAGES_ONE_RANK, "fake_images": True}, spec=VLM))
    failing = {c.name.split(" (")[0] for c in report.failures()}
    text = report_text(report)
    assert report.info["dp_image_counts"] == [2, 1], report.info  # dp rank 1: the fake image
    assert {"logits", "loss"} <= failing and not report.problems, text


def test_select_rows_gives_each_dp_rank_its_own_images_and_none_to_text_rows():
    """No ranks: ``model_specs.select_rows`` (the dp ranks' rows and the one-device micro-batches) takes each row's
    images with it from the flat media (``pixel_values [P, 12]``, ``image_grid_thw [I, 3]``); rows holding none give a
    batch without media keys, which the reordered reference can still reverse."""
    from cp_harness.usage import model_specs

    spec = model_specs.load_spec(VLM)
    images = [[[2, 2, 3], [10, 1, 2]], [[4, 2, 2]], [], []]
    batch = model_specs.make_batch(spec, {**IMAGES, "batch_size": 4, "images": images})
    first, second = (model_specs.select_rows(spec, batch, range(d * 2, d * 2 + 2)) for d in (0, 1))
    assert first["image_grid_thw"].tolist() == batch["image_grid_thw"].tolist()  # rows 0, 1 hold all three images
    assert "pixel_values" not in second and "image_grid_thw" not in second, sorted(second)
    assert second["input_ids"].equal(batch["input_ids"][2:]) and second["labels"].equal(batch["labels"][2:])
    one = model_specs.select_rows(spec, batch, [1])  # row 1 alone: its 2 x 2 image, patches 8..11 of the flat tensor
    assert one["image_grid_thw"].tolist() == [[1, 2, 2]] and one["pixel_values"].equal(batch["pixel_values"][8:12])
    assert model_specs._row_order(spec, second, [1, 0])["input_ids"].equal(batch["input_ids"][[3, 2]])


def test_training_rows_draw_images_for_the_vlm_spec_with_a_text_only_dp_rank_carrying_the_fake_image():
    """The rows draw the ``images`` kind for a spec that declares it; half of the time one dp rank's rows are text
    only and then carry the framework's fake image (``batch.fake_images``), so every dp rank runs the vision tower."""
    from hypothesis import HealthCheck, find, settings

    from cp_harness.cases.profiles import CaseSpace
    from cp_harness.checks.training_step import _image_counts, training_step_cases
    from cp_harness.usage import model_specs

    space = CaseSpace(world_sizes=(4,), models=(VLM,))
    quick = settings(max_examples=200, database=None, suppress_health_check=list(HealthCheck))
    case = find(training_step_cases("float32")(space), lambda c: c["batch"].get("fake_images"), settings=quick)
    assert case["batch"]["kind"] == "images" and "pad_content" not in case["batch"], case
    spec = model_specs.load_spec(VLM)
    batch = model_specs.make_batch(spec, case["batch"])
    rows = case["batch"]["batch_size"] // 2
    assert 0 not in _image_counts(batch, spec, 2, rows), case  # the text-only rank holds its fake image
    assert any(not placed for placed in case["batch"]["images"]), case
    assert not batch["attention_mask"].all()  # the fake image's placeholders are masked
    plain = find(training_step_cases("float32")(space), lambda c: not c["batch"].get("fake_images"), settings=quick)
    assert all(plain["batch"]["images"]), plain  # both are drawn


def _labels(batch: dict) -> list[int]:
    """Each dp rank's label count (one row each), read off the batch the spec builds: text targets only."""
    from cp_harness.usage import model_specs

    labels = model_specs.make_batch(model_specs.load_spec(VLM), batch)["labels"]
    return [int((row != -100).sum()) for row in labels]


def test_aux_loss_scale_left_at_one_fails_on_the_routers(step_runner):
    text, failing = _failures(_case(UNEVEN, "training_step_driver_aux_scale", spec=QWEN), step_runner)
    assert {
        "grad model.language_model.layers.0.mlp.gate.weight",
        "grad model.language_model.layers.1.mlp.gate.weight",
    } <= failing, text
    assert "loss" not in failing and "logits" not in failing, text  # the forward is untouched
    assert not any(".self_attn." in n for n in failing), text  # only what the aux loss reaches


def _failures(case: dict, runner) -> tuple[str, set[str]]:
    report = runner.run(case)
    assert not report.ok, report_text(report)
    return report_text(report), {c.name.split(" (")[0] for c in report.failures()}


def test_loss_scale_forgetting_the_dp_factor_fails_on_the_gradients(step_runner):
    text, failing = _failures(_case(UNEVEN, "training_step_driver_no_dp_scale"), step_runner)
    grads = {n for n in failing if n.startswith("grad model.")}
    assert len(grads) > 50 and "grad_norm" in failing, text  # every gradient halved, and the norm with them
    assert "loss" not in failing and "logits" not in failing, text  # the forward is untouched
    assert "parameter model." in text and "worst at" in text, text


def test_label_count_not_summed_over_dp_fails_on_the_loss_and_gradients(step_runner):
    text, failing = _failures(_case(UNEVEN, "training_step_driver_local_count"), step_runner)
    assert "loss" in failing and "grad_norm" in failing, text
    assert any(n.startswith("grad model.") for n in failing) and "logits" not in failing, text


def test_global_rows_that_do_not_split_over_dp_are_refused_on_every_rank(step_runner):
    """Each rank refuses the case before any collective of the step and says so; the pool stays up (a refusal is an
    answer, not a rank failure: the next case does not wait for a restart)."""
    report = step_runner.run(_case({"kind": "plain", "seq_len": 9, "batch_size": 1, "seed": 0}))
    starts = step_runner.pool.starts  # a pool torn down by an earlier test started again for this case
    assert not report.ok
    text = report_text(report)
    assert "batch.batch_size=1" in text and "multiple of dp_shard=2" in text, text
    assert "failed on rank(s) [0, 1, 2, 3]" in text, text  # every rank raised it, before any collective
    assert all(f"rank {r} raised: RuntimeError: building the model or batch" in text for r in range(4)), text
    report = step_runner.run({**_case(UNEVEN, spec=QWEN), "loss": "mtpp"})
    text = report_text(report)
    assert not report.ok and "loss='mtpp'" in text and "'mtp'" in text, text
    assert "failed on rank(s) [0, 1, 2, 3]" in text, text
    assert step_runner.pool.starts == starts  # refused twice, never restarted


def test_the_mtp_row_skips_the_deepseek_specs_saying_why():
    """DeepSeek V4 / V4.1 have MTP heads but declare supports_mtp_cp=False: their MTP rows are skipped with that
    reason; qwen3_5_moe runs them."""
    from cp_harness.checks.training_step import _runnable

    runnable, skipped = _runnable((SPEC, QWEN), "float32", "mtp")
    assert runnable == [QWEN], (runnable, skipped)
    assert "supports_mtp_cp=False" in skipped[SPEC], skipped


def test_the_bfloat16_rows_skip_the_deepseek_specs_saying_why():
    """DeepSeek V4.1's bfloat16 build mixes float32 parameters into bfloat16 FSDP2 units (refused); DeepSeek V4's
    bfloat16 step fails on its hyper-connection gradients, undiagnosed: both skipped, each with its reason, while
    qwen3_5_moe runs the bfloat16 rows and the DeepSeek specs the float32 ones."""
    from cp_harness.checks.training_step import _runnable

    v4 = "examples.automodel.models.deepseek_v4"
    runnable, skipped = _runnable((SPEC, v4, QWEN), "bfloat16")
    assert runnable == [QWEN], (runnable, skipped)
    assert "uniform original parameter dtype" in skipped[SPEC] and "not diagnosed" in skipped[v4], skipped
    assert _runnable((SPEC, v4, QWEN), "float32")[0] == [SPEC, v4, QWEN]


def test_smoke_qwen3_5_moe_bfloat16(step_runner):
    """The bfloat16 row on the uneven NEAT-packed case: the spec's bfloat16 model under FSDP2 (float32 reduction)
    against one device's bfloat16 gradient accumulation, every parameter gradient and the norm judged."""
    report = step_runner.run({**_case(UNEVEN, spec=QWEN), "dtype": "bfloat16"})
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    assert "grad model.language_model.layers.0.mlp.gate.weight" in names and "grad_norm" in names, names
    assert {c.dtype for c in report.comparisons} == {"bfloat16"}, {c.name: c.dtype for c in report.comparisons}


def test_the_rows_are_skipped_saying_why_without_a_pool_of_four():
    from cp_harness.cases.profiles import CaseSpace
    from cp_harness.checks.training_step import TRAINING_STEP

    row = TRAINING_STEP.rows[0]
    assert row.step == "training" and row.needs_model
    why = row.skip(CaseSpace(world_sizes=(1, 2, 3), models=(SPEC,)))
    assert why is not None and "--world-sizes 4" in why, why
    why = row.skip(CaseSpace(world_sizes=(4,), models=(SPEC,), pool_size=8))  # a larger pool: the mesh would not fit
    assert why is not None and "pool 8" in why, why


def test_step_option_selects_the_training_rows_only():
    import argparse

    from cp_harness.options import add_cli_options, from_cli
    from cp_harness.verify.result import VerifySettings

    parser = argparse.ArgumentParser()
    add_cli_options(parser, "verify")
    settings = VerifySettings.from_options(from_cli(parser.parse_args(["--model", SPEC, "--step", "training"])))
    assert settings.step == "training"
    from cp_harness.verify.rows import default_rows

    modes = {row.id: row.spec.step for row in default_rows() if row.spec.needs_model}
    assert {i for i, mode in modes.items() if mode == "training"} == {
        "training_step.float32",
        "training_step.float32.linear_ce",
        "training_step.float32.mtp",
        "training_step.bfloat16",
        "training_step.bfloat16.linear_ce",
        "training_step.bfloat16.mtp",
    }, modes
    assert modes["real_model.float32"] == "forward-backward", modes
    with pytest.raises(SystemExit):
        parser.parse_args(["--step", "optimizer"])  # argparse names the choices


def test_real_clients_runs_the_training_step_subjects_on_four_ranks():
    import argparse

    from examples.automodel.tools import run

    every = run._subjects([])
    assert {f"training:{s}" for s in ("deepseek_v41", "deepseek_v4", "qwen3_5_moe")} <= set(every), every
    assert run._subjects(["training:qwen3_5_moe"]) == ["training:qwen3_5_moe"]
    args = argparse.Namespace(world_sizes="1,2,3", examples=1, seed=0, backend="gloo", shrink_seconds=1.0)
    assert run.subject_settings("training", "qwen3_5_moe", args) is None  # no pool of 4: not run (main says so)
    settings = run.subject_settings("training", "qwen3_5_moe", argparse.Namespace(**{**vars(args), "world_sizes": "2,4"}))
    assert (settings.world_sizes, settings.step, settings.model) == ((4,), "training", ("examples.automodel.models.qwen3_5_moe",))
    # its own pool of exactly 4 ranks, never one a model spec's rows share (FSDP2 wraps the model it builds)
    assert run.pool_key("training", settings) == ("training", 4)
    spec = run.subject_settings("spec", "qwen3_5_moe", argparse.Namespace(**{**vars(args), "world_sizes": "1,2,3,4"}))
    assert run.pool_key("spec", spec) == ("models", 4)
    assert "--step training" in " ".join(run.command_line(settings, pathlib.Path("x.json")))


def test_linear_ce_qwen3_5_moe_passes_without_logits(step_runner):
    """The recipe's linear-CE branch (``ChunkedCrossEntropy``: the FSDP-sharded LM head gathered outside its
    module): loss, every gradient and the norm judged; the logits are never computed, and the report says so."""
    report = step_runner.run({**_case(UNEVEN, spec=QWEN), "loss": "linear_ce"})
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    assert {"loss", "grad_norm", "grad lm_head.weight"} <= names and "logits" not in names, names
    assert report.info["loss"] == "linear_ce"


def test_drawn_cases_hold_the_pad_id_as_content_inside_and_ending_documents():
    """The training-step rows draw batches whose documents hold the pad id (0: the recipe's ``padding_token_id``
    without a tokenizer) as real tokens, inside a document and as its last token (an EOS equal to pad), and say so
    in the case key (``batch.pad_content``); a mask derived from ``input_ids == pad_id`` would be caught."""
    from hypothesis import HealthCheck, find, settings

    from cp_harness.cases.profiles import CaseSpace
    from cp_harness.checks.training_step import training_step_cases
    from cp_harness.usage import model_specs

    space = CaseSpace(world_sizes=(4,), models=(QWEN,))
    quick = settings(max_examples=200, database=None, suppress_health_check=list(HealthCheck))
    case = find(
        training_step_cases("float32")(space),
        lambda c: c["batch"].get("pad_content") and any(max(d) >= 3 for d in c["batch"]["documents"]),
        settings=quick,
    )
    batch = model_specs.make_batch(model_specs.load_spec(QWEN), case["batch"])
    real = batch["_packed_seq_ids"] > 0
    assert bool(((batch["input_ids"] == 0) & real).any()), batch  # the pad id on real tokens
    for row, lengths in enumerate(case["batch"]["documents"]):
        ends = [sum(lengths[: k + 1]) - 1 for k, n in enumerate(lengths) if n >= 2]
        assert all(int(batch["input_ids"][row, e]) == 0 for e in ends), (lengths, batch["input_ids"][row])
        assert all(bool(real[row, e]) for e in ends)  # ... and still a real token of its document
    plain = find(training_step_cases("float32")(space), lambda c: not c["batch"].get("pad_content"), settings=quick)
    assert "pad_content" not in plain["batch"]  # both are drawn


def test_pad_id_as_content_qwen3_5_moe_passes_masked_and_mtp(step_runner):
    """The smoke's pad-as-content batch (the pad id ending and inside documents, one document over every shard
    boundary, a single-token one) on the NEAT/block-diagonal path, with the masked loss and with MTP (aux loss
    off, finding T4): nothing of the step treats a pad-id token as padding."""
    from cp_harness.checks.training_step import smoke_cases

    (batch,) = [c["batch"] for c in smoke_cases(QWEN) if c["batch"].get("pad_content")]
    for case in (_case(batch, spec=QWEN), _mtp(_case(batch, spec=QWEN), aux=False)):
        report = step_runner.run(case)
        assert report.ok, report_text(report)
        assert report.info["dp_label_counts"] == [20, 13], report.info  # every pad-id token kept as a label


# The MTP smoke's case with the routers' load-balancing loss off: what remains of the objective (main CE + MTP CE)
# must match one device exactly; with it on, finding T4 (docs/training_step.md).
def _mtp(case: dict, aux: bool = True) -> dict:
    from cp_harness.checks.training_step import mtp_case

    case = mtp_case(case)
    return case if aux else {**case, "overrides": {**case["overrides"], "router_aux_loss_coef": 0.0}}


def test_mtp_qwen3_5_moe_cross_entropy_terms_pass_against_one_device(step_runner):
    """The recipe's MTP step at CP 2 (``prepare_mtp_inputs_for_cp`` on each dp rank's global rows,
    ``shard_token_tensor`` of the per-depth ids, positions, masks and targets, ``calculate_mtp_loss`` added to the
    main loss) against one device's MTP on the whole sequence (targets shifted by ``calculate_mtp_loss`` itself,
    masked across documents with ``_packed_seq_ids``), router aux loss off: the loss, the logits, every gradient
    (the MTP head's included) and the norm pass."""
    case = _mtp(_case(UNEVEN, spec=QWEN), aux=False)
    assert case["loss"] == "mtp" and case["overrides"]["mtp_num_hidden_layers"] == 1, case
    report = step_runner.run(case)
    assert report.ok, report_text(report)
    names = {c.name.split(" (")[0] for c in report.comparisons}
    mtp = {n for n in names if n.startswith("grad mtp.")}
    assert any("eh_proj" in n for n in mtp) and {"loss", "logits", "grad_norm"} <= names, names
    assert report.info["loss"] == "mtp" and any("T2" in k for k in report.not_judged), report.not_judged


def test_mtp_qwen3_5_moe_router_aux_loss_differs_from_one_device(step_runner):
    """Finding T4: with the framework's default aux-loss coefficient only the MTP sublayer's router (and what its
    load-balancing loss reaches) differs from one device; the loss, the logits and the main model pass."""
    report = step_runner.run(_mtp(_case(UNEVEN, spec=QWEN)))
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert "grad mtp.layers.0.mlp.gate.weight" in failing, report_text(report)
    assert all(n.startswith("grad mtp.layers.0.") for n in failing), report_text(report)


def test_mtp_passes_with_the_aux_loss_once_one_device_masks_the_mtp_inputs_as_cp_does(step_runner):
    """T4's mechanism: the same MTP case as the failing one, router aux loss on, against a one-device reference whose
    MTP inputs are masked where the future token leaves the document, as the model's CP forward masks them
    (``training_step_driver_mtp_masked_reference``): every quantity passes, the MTP router's gradient included."""
    report = step_runner.run(_mtp(_case(UNEVEN, "training_step_driver_mtp_masked_reference", spec=QWEN)))
    assert report.ok, report_text(report)
    assert "grad mtp.layers.0.mlp.gate.weight" in {c.name.split(" (")[0] for c in report.comparisons}


def test_mtp_targets_sharded_with_the_ids_fill_fail_on_the_reported_loss(step_runner):
    """Targets padded with token 0 instead of ``ignore_index``: each CP padding position adds ``log V`` x
    ``scaling / depths / count`` to the loss (measured: 5.3027 against 5.2694, two padded positions, 64 tokens,
    25 labels); the gradients pass, the padding positions' MTP hidden states being constant zeros."""
    case = _mtp(_case(UNEVEN, "training_step_driver_mtp_target_fill", spec=QWEN), aux=False)
    text, failing = _failures(case, step_runner)
    assert failing == {"loss"}, text


def test_mtp_targets_shifted_on_the_local_shard_fail_on_the_loss_and_mtp_gradients(step_runner):
    case = _mtp(_case(UNEVEN, "training_step_driver_mtp_local_targets", spec=QWEN), aux=False)
    text, failing = _failures(case, step_runner)
    assert "loss" in failing and "grad mtp.layers.0.eh_proj.weight" in failing, text
    assert "logits" not in failing, text  # the forward is untouched: only the MTP targets are


def test_mtp_with_train_ft_lines_alone_raises_on_every_rank_naming_the_masks(step_runner):
    """Finding T2 (last in the module: the forward raises inside FSDP2's hooks): ``train_ft.py``'s MTP inputs
    under CP do not carry the validity masks ``Qwen3_5MoeForConditionalGeneration``'s CP forward needs."""
    report = step_runner.run(_mtp(_case(UNEVEN, "training_step_driver_mtp_train_ft", spec=QWEN), aux=False))
    text = report_text(report)
    assert not report.ok and "positions, and masks" in text, text
