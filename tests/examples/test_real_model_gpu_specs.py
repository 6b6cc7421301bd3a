"""The GPU-only model specs (``docs/models/gpu_only.md``) as far as a CPU can check them, without ranks.

Every GPU-only spec loads through the harness's ``load_spec`` (the interface is complete), declares ``REQUIRES``
with a reason per entry (``"cuda"`` or a module the framework really imports), ``WORLD_SIZES``, ``BATCH_KINDS`` and
``COVERS`` naming callables that exist in the pinned framework; it builds on the CPU where its packages allow, and
where they do not, ``build`` fails with the error its ``REQUIRES`` quotes. The SDPA model also runs one device
on the CPU (SDPA has a CPU kernel; only the ring has not). The CUDA checks (build and one-device step on the GPU)
carry the ``gpu`` marker: they run under ``--cp-backend nccl`` (the nightly) and skip, naming the reason, where a
spec's ``REQUIRES`` is unmet. The CP paths themselves run only in the nightly's ``verify --model`` rows, except the
ring SDPA specs' on the CPU stand-in (``tests/checks/test_real_model_standins.py``).
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from cp_harness.usage.spec_contract import KNOWN_BATCH_KINDS

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool

PACKAGE = "examples.automodel.models"


def _gpu_specs() -> tuple[str, ...]:
    """The specs whose ``REQUIRES`` names ``"cuda"`` (none without the models extra: the module is skipped then)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("nemo_automodel") is None:
        return ()
    from examples.automodel.models import SPECS, needs_cuda

    return tuple(name for name in SPECS if needs_cuda(name))


GPU_SPECS = _gpu_specs()
REQUIREMENT_KEYS = {"cuda", "fla", "transformer_engine", "mamba_ssm", "causal_conv1d"}


def _spec(name: str):
    from cp_harness.usage.model_specs import load_spec

    return load_spec(f"{PACKAGE}.{name}")


def _resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


@pytest.mark.parametrize("name", GPU_SPECS)
def test_spec_declares_what_the_harness_reads(name):
    spec = _spec(name)
    assert spec.REQUIRES and set(spec.REQUIRES) <= REQUIREMENT_KEYS, spec.REQUIRES
    assert all(isinstance(reason, str) and len(reason) > 40 for reason in spec.REQUIRES.values()), spec.REQUIRES
    assert "cuda" in spec.REQUIRES  # every one of them is GPU-only
    assert spec.WORLD_SIZES and all(isinstance(n, int) and n >= 1 for n in spec.WORLD_SIZES) and 1 in spec.WORLD_SIZES
    assert spec.BATCH_KINDS and set(spec.BATCH_KINDS) <= set(KNOWN_BATCH_KINDS)
    assert spec.COVERS and all(words for words in spec.COVERS.values())
    for dotted in spec.COVERS:  # every covered callable exists in the pinned framework / torch
        assert callable(_resolve(dotted)), dotted


def test_needs_cuda_reads_from_each_specs_source_what_importing_it_gives():
    """``needs_cuda`` reads ``REQUIRES`` from the source (collection imported no spec for it), following the imports
    that carry it from another spec; it must agree with the imported modules for every spec."""
    from examples.automodel.models import SPECS, _declared_requirements, needs_cuda

    for name in SPECS:
        imported = set(getattr(importlib.import_module(f"{PACKAGE}.{name}"), "REQUIRES", {}))
        assert _declared_requirements(name) == imported, name
        assert needs_cuda(name) == ("cuda" in imported), name


def test_load_balanced_sdpa_quotes_the_cpu_error_it_was_seen_with():
    spec = _spec("load_balanced_sdpa")
    assert "_scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" in (
        spec.REQUIRES["cuda"])
    assert _spec("load_balanced_sdpa_alltoall").ROTATE_METHOD == "alltoall" and spec.ROTATE_METHOD is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_balanced_sdpa_builds_and_runs_one_device_on_cpu(dtype):
    """The model a CP user trains, one device, the batch as given (plain and right padded), on the CPU."""
    spec = _spec("load_balanced_sdpa")
    model = spec.build(dtype, 0)
    assert model.config._attn_implementation == "sdpa" and {p.dtype for p in model.parameters()} == {dtype}
    for kind, keywords in (("plain", {}), ("right_padded", {"pad": 3})):
        batch = spec.make_batch(kind, 13, batch_size=2, seed=5, **keywords)
        before = {k: v.clone() for k, v in batch.items()}
        ctx_factory, local, sharder = spec.shard(model, None, batch)
        with ctx_factory():
            logits = spec.forward(model, local)
            value = spec.loss(logits, spec.local_labels(local), spec.num_label_tokens(batch))
        value.backward()
        assert spec.gather_logits(sharder, logits.detach()).shape == (2, 13, 64)
        assert torch.isfinite(value) and all(torch.equal(batch[k], before[k]) for k in batch)
        assert all(not module._forward_pre_hooks for n, module in model.named_modules() if n.endswith("self_attn"))
        model.zero_grad(set_to_none=True)


def test_nemotron_v3_builds_on_cpu_without_mamba_ssm():
    spec = _spec("nemotron_v3_mamba")
    model = spec.build(torch.float32, 0)
    assert [layer.block_type for layer in model.model.layers.values()] == spec.TINY["layers_block_type"]


def test_kimi_linear_builds_or_names_the_missing_fla():
    spec = _spec("kimi_linear_kda")
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(Exception) as raised:
            spec.build(torch.float32, 0)
        assert f"{type(raised.value).__name__}: {raised.value}" == spec.BUILD_ERROR_WITHOUT_FLA
        assert spec.BUILD_ERROR_WITHOUT_FLA in spec.REQUIRES["fla"]
    else:
        model = spec.build(torch.float32, 0)
        assert sum(type(m).__name__ == "KimiDeltaAttention" for m in model.modules()) == 2


def test_mimo_thd_layout_keeps_every_token_and_label():
    spec = _spec("mimo_v2_flash_te_thd")
    spec._check_layout_arithmetic()
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ModuleNotFoundError) as raised:  # TE attention cannot be built without it
            spec.build(torch.float32, 0)
        assert f"{type(raised.value).__name__}: {raised.value}" == spec.BUILD_ERROR_WITHOUT_TE


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_SPECS)
def test_gpu_spec_builds_and_steps_one_device_on_cuda(name):
    """On the nightly's GPUs: the model on this process's GPU and one one-device training step (no CP)."""
    from examples.automodel.models._base import unmet_requirements
    from cp_harness.usage import model_specs

    spec = _spec(name)
    unmet = unmet_requirements(spec.REQUIRES)
    if unmet:
        pytest.skip(f"{name}: " + "; ".join(f"needs {key}: {reason}" for key, reason in unmet.items()))
    for dtype in ("float32", "bfloat16"):
        model = spec.build(model_specs.DTYPES[dtype], 0)
        assert next(model.parameters()).is_cuda
        batch = spec.make_batch("plain", 16, batch_size=2, seed=3)
        result = model_specs.step(spec, model, None, batch)
        assert result["logits"].shape[:2] == (2, 16) and torch.isfinite(result["loss"])
