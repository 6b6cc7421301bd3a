"""The coverage table of ``scripts/real_clients`` (``examples/automodel/tools/coverage.py``): generated from the
framework's sources, the adapters' ``SERVES`` / ``ALSO_USES``, the specs' ``COVERS``, the tests' ``JUDGES`` and the
nightly workflow; no ranks."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool


def _summary(**outcomes) -> dict:
    subjects = {s: {"failed_rows": rows} for s, rows in outcomes.items()}
    return {"subjects": subjects, "skipped": {"spec:nemotron_v3_mamba": "needs mamba_ssm: the mixer"}, "findings": [
        {"subject": "adapter:deepseek_v41_gather", "row": "model: MistralLarge4-mini (float64)", "defect": "D1"}]}


@pytest.fixture(scope="module")
def table():
    from examples.automodel.tools import coverage

    return coverage.build(_summary(**{"adapter:deepseek_v41_gather": ["model: MistralLarge4-mini (float64)"],
                                      "adapter:shard_batch_contiguous": []}), [])


def test_every_public_cp_function_of_the_framework_is_a_row(table):
    from examples.automodel.tools import coverage

    functions = coverage.framework_functions()
    assert len(functions) > 100 and len({r.function for r in table.rows}) == len(table.rows)
    assert set(functions) <= {r.function for r in table.rows}
    assert "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_load_balanced" in functions


def test_what_an_adapter_serves_is_exercised_by_it_and_says_where(table):
    from examples.automodel.adapters import ADAPTERS

    rows = {r.function: r for r in table.rows}
    for adapter in ADAPTERS:
        module = importlib.import_module(f"examples.automodel.adapters.{adapter}")
        for dotted in module.SERVES.values():
            assert f"adapter:{adapter}" in {s for s, _ in rows[dotted].exercised_by}, (adapter, dotted)
    gather = rows["nemo_automodel.components.models.deepseek_v41.cp.gather_sequence"]
    assert "tests/examples/test_real_clients.py" in gather.default_command  # its JUDGES name the adapter
    assert gather.real_clients == ["adapter:deepseek_v41_gather: failed as documented (D1)"]
    assert gather.nightly == ["adapter:deepseek_v41_gather"]  # real_clients --backend nccl in the nightly


def test_a_spec_that_cannot_run_here_says_why_and_runs_in_the_nightly(table):
    mamba = next(r for r in table.rows if r.function.endswith("context_parallel.mamba._AllToAll"))
    assert any(o.startswith("spec:nemotron_v3_mamba: skipped here (needs mamba_ssm") for o in mamba.real_clients)
    assert "spec:nemotron_v3_mamba" in mamba.nightly
    # the default command judges it on the CPU stand-ins (tests/checks/test_real_model_mamba.py's JUDGES)
    assert "tests/checks/test_real_model_mamba.py" in mamba.default_command


def test_a_spec_on_a_cpu_stand_in_is_in_the_default_command(table):
    """The ring SDPA specs run on the CPU stand-in: their ring is judged by the default command's tests."""
    ring = next(r for r in table.rows if r.function.endswith("_templated_ring_attention_backward"))
    assert "tests/checks/test_real_model_standins.py" in ring.default_command
    assert "spec:load_balanced_sdpa" in ring.nightly


def test_the_on_cpu_column_tells_stand_in_runs_from_real_kernel_runs(table):
    """The ring is judged on CPU only on the stand-in; an adapter's functions run on the framework's own code; a
    spec's forward-only CPU judging and a GPU-only spec say so."""
    from cp_harness.usage.model_specs import spec_traits
    from examples.automodel.models import SPECS
    from examples.automodel.tools import coverage

    rows = {r.function: r for r in table.rows}
    ring = next(r for r in table.rows if r.function.endswith("_templated_ring_attention_backward"))
    assert "spec:load_balanced_sdpa: CPU, stand-in: ring SDPA" in "; ".join(ring.on_cpu), ring.on_cpu
    gather = rows["nemo_automodel.components.models.deepseek_v41.cp.gather_sequence"]
    assert "adapter:deepseek_v41_gather: real kernels" in gather.on_cpu
    mamba = next(r for r in table.rows if r.function.endswith("context_parallel.mamba._AllToAll"))
    installed = importlib.util.find_spec("mamba_ssm") is not None  # constraints/mamba.txt (scripts/bootstrap.sh)
    on_cpu = "; ".join(mamba.on_cpu)
    if installed:  # both stand-ins' report lines
        assert "spec:nemotron_v3_mamba: CPU, stand-in: ring SDPA" in on_cpu, mamba.on_cpu
        assert "CPU, stand-in: Mamba2 conv + SSD scan" in on_cpu, mamba.on_cpu
    else:
        assert "spec:nemotron_v3_mamba: not on CPU (needs mamba_ssm" in on_cpu, mamba.on_cpu
    for spec in SPECS:
        traits = spec_traits(f"examples.automodel.models.{spec}")
        mode = coverage.cpu_mode(f"spec:{spec}")
        assert ("stand-in" in mode) == bool(traits.standins and not traits.unmet()), (spec, mode)
        assert ("forward only" in mode) == bool(traits.forward_only("cpu") and not traits.unmet()), (spec, mode)
    assert "| on CPU |" in table.markdown() and "on CPU: spec:load_balanced_sdpa: CPU, stand-in" in table.text()


def test_a_function_nothing_exercises_says_why_and_the_text_forms_count_them(table):
    rows = {r.function: r for r in table.rows}
    halo = rows["nemo_automodel.components.distributed.blockdiag_cp.exchange._LeftHaloExchange"]
    assert not halo.exercised_by and halo.why_not.startswith("one neighbour only")
    unjudged = [r for r in table.rows if not r.exercised_by]
    assert unjudged and all(r.why_not for r in unjudged)
    judged = sum(1 for r in table.rows if r.exercised_by and r.part == "CP")
    cp_rows = sum(1 for r in table.rows if r.part == "CP")
    assert table.markdown().startswith(f"{judged} of {cp_rows} framework CP functions, ")
    assert f"{judged} of {cp_rows} framework CP functions" in table.text()
    assert table.as_dict()["by_part"]["CP"] == {"judged": judged, "functions": cp_rows}
    assert table.as_dict()["judged"] == sum(1 for r in table.rows if r.exercised_by)


def test_the_training_step_code_is_its_own_part_with_what_runs_it(table):
    """Issue 34 item 5: the CP-relevant training-step modules are rows of part "training step"; what the driver
    calls is exercised by the ``training:<spec>`` subjects in the default command on the gloo stand-in; the recipe's
    step methods, rebuilt because the recipe does not import here, are not counted as judged."""
    from examples.automodel.training import covers
    from examples.automodel.tools import coverage

    rows = {r.function: r for r in table.rows}
    training = coverage.framework_functions(coverage.TRAINING_SOURCES)
    assert "nemo_automodel.components.distributed.thd_utils.process_input_for_thd" in training
    assert len(training) == len(set(training))  # typing.overload repeats calculate_mtp_loss: one row
    assert all(rows[f].part == "training step" for f in training)
    for dotted in {**covers.covers("masked"), **covers.covers("linear_ce"), **covers.covers("mtp", "qwen3_5_moe")}:
        row = rows[dotted]
        assert row.part == "training step" and "training:qwen3_5_moe" in {s for s, _ in row.exercised_by}, dotted
        assert "tests/checks/test_training_step.py" in row.default_command, dotted
        assert any("stand-in" in mode and "all_gather" in mode for mode in row.on_cpu), row.on_cpu
    linear = rows["nemo_automodel.components.loss.utils.prepare_lm_weight"]
    assert "training:deepseek_v41" not in {s for s, _ in linear.exercised_by}  # its linear-CE rows do not run
    mtp = rows["nemo_automodel.components.loss.mtp.calculate_mtp_loss"]
    assert {s for s, _ in mtp.exercised_by} == {"training:qwen3_5_moe"}  # DeepSeek: supports_mtp_cp=False
    for dotted in covers.REBUILT:
        assert not rows[dotted].exercised_by and rows[dotted].why_not.startswith("rebuilt"), dotted
    counts = table.counts()
    assert counts["training step"][0] >= len(covers.COVERS) and counts["training step"][1] >= len(training)
    assert f"{counts['training step'][0]} of {counts['training step'][1]} framework training step functions" in (
        table.markdown().splitlines()[0]
    )


def test_the_eagle_attention_is_exercised_by_its_subjects_on_the_flash_attn_stand_in(table):
    """Issue 35 item 4: the EAGLE-3 ring, zig-zag ring and Ulysses attention are rows exercised by the attention
    subjects, judged by the default command's test on the CPU stand-in of flash-attn's kernels."""
    rows = {r.function: r for r in table.rows}
    eagle = "nemo_automodel.components.speculative.eagle"
    for subject, function in (
        ("eagle_ring", f"{eagle}.ring_attention.ring_flash_attn_backward"),
        ("eagle_zigzag", f"{eagle}.zigzag_ring_attention.zigzag_ring_flash_attn_varlen_forward"),
        ("eagle_ulysses", f"{eagle}.ulysses_attention._gather_seq_scatter_heads"),
    ):
        row = rows[function]
        assert {s for s, _ in row.exercised_by} == {f"attention:{subject}"}
        assert row.default_command == ["tests/checks/test_cp_attention.py"]
        assert row.on_cpu == [f"attention:{subject}: CPU, stand-in: flash-attn per-block kernels (dense and varlen, "
                              "forward and backward against the given out/LSE) = dense masked softmax attention and "
                              "its closed-form backward (float32 for bf16/fp16)"]
