"""Stand-in ``flex_backward_cpu``: FlexAttention's eager (dense) path differentiated on a CPU.

Torch 2.13's ``torch.nn.attention.flex_attention.flex_attention`` refuses any CPU call whose query, key or value
requires grad, in one place: ``_validate_device`` ("FlexAttention does not support backward on CPU. Please set
the input requires_grad to False or use another device."). Nothing past that check is CPU-specific: uncompiled,
FlexAttention runs its higher-order op's dense implementation (``sdpa_dense``: scores, ``score_mod``, the block
mask's ``mask_mod``, a float32 softmax with natural-log LSE; a row with no unmasked key gives output 0 and LSE
``-inf``) under ``FlexAttentionAutogradOp``, whose backward (``sdpa_dense_backward``) differentiates the same
computation, including a gradient that reaches the LSE. On a GPU the same op compiles to the Triton kernel of
that contract; the specs that need this (Gemma4's FlexAttention ring, Kimi's MLA over the gathered latent) run
FlexAttention uncompiled on a CPU anyway (``model_owned_cp.flex_attention_eager``: inductor refuses the CPU
training call).

This stand-in replaces only the refusal: inside ``install()`` the module's ``_validate_device`` is a function that
calls torch's own with the inputs detached (so every other device check stays torch's), and counts the CPU calls
that needed grad (``calls()``). The forward, the backward, and all CP code around them (the framework's rings,
gathers, LSE merges and their gradients) are torch's and the framework's. Outside ``install()`` torch's check is
back, refusing as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cp_harness.standins.registry import StandIn, register

MODULE = "torch.nn.attention.flex_attention"
_STATE = {"calls": 0}


def _flex_module():
    import importlib

    return importlib.import_module(MODULE)


def _refuses_cpu_backward(validate) -> bool:
    """Whether ``validate`` (a ``_validate_device``) refuses CPU inputs that require grad."""
    probe = torch.zeros(1, 1, 1, 1, requires_grad=True)
    try:
        validate(probe, probe, probe)
    except NotImplementedError:
        return True
    return False


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Replace ``flex_attention._validate_device`` for the block by torch's own check on detached inputs; torch's
    function is back on exit (also after an exception). Raises if already installed, or if torch no longer
    refuses CPU backward (the stand-in is then obsolete: remove it from the spec's ``STANDINS``)."""
    flex = _flex_module()
    original = flex._validate_device
    if getattr(original, "_cp_harness_standin", False):
        raise RuntimeError("stand-in flex_backward_cpu is already installed (entered twice)")
    if not _refuses_cpu_backward(original):
        raise RuntimeError(
            f"stand-in flex_backward_cpu: {MODULE}._validate_device accepts CPU inputs that require grad; "
            "the stand-in is not needed (remove it from the spec's STANDINS)"
        )

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "cpu" and (query.requires_grad or key.requires_grad or value.requires_grad):
            _STATE["calls"] += 1
        original(query.detach(), key.detach(), value.detach())

    validate_device._cp_harness_standin = True  # type: ignore[attr-defined]
    flex._validate_device = validate_device
    try:
        yield
    finally:
        flex._validate_device = original


def installed() -> bool:
    """Whether the stand-in's check is the one FlexAttention calls now."""
    return bool(getattr(_flex_module()._validate_device, "_cp_harness_standin", False))


FLEX_BACKWARD_CPU = register(
    StandIn(
        name="flex_backward_cpu",
        device_type="cpu",
        replaces="FlexAttention's backward kernel (compiled Triton on a GPU; refused on a CPU by "
        "torch.nn.attention.flex_attention._validate_device)",
        role="FlexAttention backward",
        computes_with="FlexAttention's eager dense path differentiated (torch's sdpa_dense_backward)",
        meets="",  # no REQUIRES entry: it makes gradients judgeable where FORWARD_ONLY_ON said "cpu"
        install=install,
        calls=lambda: _STATE["calls"],
    )
)

# The same stand-in for a model whose *one-device* path calls FlexAttention too (torchtitan 0.3.0's language models:
# their only attention backends are FlexAttention and varlen, examples/torchtitan): there the one-device reference,
# the reordered run and the explanation runs need FlexAttention's CPU backward as well, so it is entered around
# every run (``reference_too``), and CP and one device compute with the same eager dense kernel. Same install,
# same counter: a spec declares one of the two names, never both (entering twice raises).
FLEX_BACKWARD_CPU_ALL_RUNS = register(
    StandIn(
        name="flex_backward_cpu_all_runs",
        device_type="cpu",
        replaces=FLEX_BACKWARD_CPU.replaces,
        role="FlexAttention backward (CP step and one-device runs)",
        computes_with=FLEX_BACKWARD_CPU.computes_with,
        meets="",
        install=install,
        calls=lambda: _STATE["calls"],
        reference_too=True,
    )
)
