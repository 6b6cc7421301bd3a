"""The model spec contract as a type: what a spec module must offer (``ModelSpec``), what it may declare
(``SpecTraits``), and the check every spec passes when it loads (``check_spec``).

A model spec is a module (``examples/automodel/models/deepseek_v41.py`` is the worked example; ``docs/extending.md``
walks through writing one). ``ModelSpec`` is a ``typing.Protocol`` of its required functions and attributes;
``check_spec`` verifies a module against it (every function present, callable, taking the documented positional
arguments; the optional declarations of the right types) and raises ``SpecError`` naming every field that is
wrong and what it should be, before any rank starts. ``traits(spec)`` reads the optional declarations with their
defaults:

- ``WORLD_SIZES``: the CP sizes the tiny config supports (cases at other sizes are not drawn);
- ``BATCH_KINDS``: the ``make_batch`` kinds it supports, among ``plain``, ``right_padded``, ``packed`` (the
  default), ``left_padded`` and ``images`` (a VLM's rows with images, ``make_batch(..., images=...)``);
- ``BATCH_ROWS``: the batch sizes (rows) it supports (default ``(1, 2)``), for every kind or per kind
  (``{"packed": (1,)}`` for a model that packs one physical row per micro-batch);
- ``COVERS``: framework CP callable (dotted path) -> what this spec's CP path does with it (the coverage table);
- ``FORWARD_ONLY_ON``: device type -> why gradients cannot be judged there (logits and loss are; the report
  names what was not judged and why);
- ``REQUIRES``: ``"cuda"`` or an importable module name -> why the spec needs it (unmet: its cases are skipped
  with that reason, never failed and never passed);
- ``STANDINS``: names of kernel stand-ins (``cp_harness.standins``) the spec's CP path may run on: each replaces
  one device kernel by a CPU computation of its contract. Declaring one says that the requirement it meets
  (``StandIn.meets``, e.g. ``"cuda"``) is for that kernel only: where the requirement is unmet, the spec runs
  with the stand-in entered around its CP step (never around the one-device reference), and the report names
  it; where the requirement is met (a GPU), the real kernel runs.

Optional functions (``OPTIONAL_FUNCTIONS``, with their arities) enable more checks: ``pad_batch`` +
``cp_padded_length`` padding sensitivity, ``cp_kernels`` kernel sensitivity, ``reorder_rows`` the reordered
reference of a batch with media (``ModelSpec`` does not list them:
a protocol cannot say "optional").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from cp_harness import standins

BATCH_KINDS = ("plain", "right_padded", "packed")  # a spec that declares none draws these
# every kind a spec may declare: left padding only where a spec opts in (a chat-template collater's rows), images
# only where the model is a VLM whose CP path splices them (``make_batch(..., images=[[[start, h, w], ...], ...])``)
KNOWN_BATCH_KINDS = (*BATCH_KINDS, "left_padded", "images")


class SpecError(ValueError):
    """A model spec module that does not meet the contract (names each field and what it should be)."""


@runtime_checkable
class ModelSpec(Protocol):
    """What a model spec module offers. Shapes: ``B`` rows, ``S`` global sequence in the caller's coordinates,
    ``S_local`` this rank's shard, ``V`` vocabulary."""

    NAME: str
    DTYPES: tuple[torch.dtype, ...]

    def build(self, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
        """The model at a tiny config, seeded weights identical on every rank, in ``train()`` mode."""

    def shard(self, model: torch.nn.Module, mesh: Any, batch: dict) -> tuple[Callable[[], Any], dict, Any]:
        """Enter CP the framework's way: ``(ctx_factory, local_batch, sharder)``; ``mesh`` a 1-D ``"cp"`` mesh or
        ``None`` (one device); ``batch`` not mutated."""

    def forward(self, model: torch.nn.Module, local_batch: dict) -> torch.Tensor:
        """Logits ``[B, S_local, V]`` of this rank's shard (called inside ``ctx_factory()``)."""

    def gather_logits(self, sharder: Any, local_logits: torch.Tensor) -> torch.Tensor:
        """``[B, S_local, V]`` -> ``[B, S, V]`` in the caller's coordinates (0 where the model dropped a position)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
        """Summed cross entropy over ``labels`` divided by the *global* label count."""

    def num_label_tokens(self, batch: dict) -> int:
        """Supervised targets in the global batch."""

    def valid_positions(self, batch: dict) -> torch.Tensor:
        """Bool ``[B, S]``: the positions whose logits are defined and compared."""

    def make_batch(self, kind: str, seq_len: int, **keywords: Any) -> dict:
        """An example global batch of ``kind`` (one of ``BATCH_KINDS``) and ``seq_len`` tokens per row."""


REQUIRED_FUNCTIONS: dict[str, int] = {
    "build": 2,
    "shard": 3,
    "forward": 2,
    "gather_logits": 2,
    "loss": 3,
    "num_label_tokens": 1,
    "valid_positions": 1,
    "make_batch": 2,
}
# Optional functions, with the positional arguments the harness calls them with:
# ``local_labels(local_batch)`` this rank's labels; ``pad_batch(batch, length)`` and
# ``cp_padded_length(model, seq_len, cp_size)`` the padding check; ``cp_kernels(model)`` the kernel check: a
# context manager inside which ``model``'s one-device forward uses the kernels its CP path uses, without CP (its
# value, a str, names them; its docstring says exactly what changes inside it; docs/extending.md, docs/real_models.md).
# ``reorder_rows(batch, order)`` the batch with its rows in ``order`` (the reordered reference), for a batch with
# tensors that are not per row (a VLM's ``pixel_values`` / ``image_grid_thw``, flat over the images).
OPTIONAL_FUNCTIONS: dict[str, int] = {
    "local_labels": 1, "pad_batch": 2, "cp_padded_length": 3, "cp_kernels": 1, "reorder_rows": 2,
}  # fmt: skip
REQUIRED_ATTRIBUTES = ("NAME", "DTYPES")


@dataclasses.dataclass(frozen=True)
class SpecTraits:
    """A spec's optional declarations, defaults applied (see the module docstring)."""

    name: str
    world_sizes: tuple[int, ...] | None = None  # None: every size
    batch_kinds: tuple[str, ...] = BATCH_KINDS
    batch_rows: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # kind -> rows

    def rows_for(self, kind: str) -> tuple[int, ...]:
        """The batch sizes a ``kind`` batch may have."""
        return tuple(self.batch_rows.get(kind, (1, 2)))

    covers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    forward_only_on: Mapping[str, str] = dataclasses.field(default_factory=dict)
    requires: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    standins: tuple[str, ...] = ()  # kernel stand-ins the CP path may run on (cp_harness.standins)

    def _missing(self) -> dict[str, str]:
        out = {}
        for key, why in self.requires.items():
            missing = not torch.cuda.is_available() if key == "cuda" else importlib.util.find_spec(key) is None
            if missing:
                out[key] = why
        return out

    def stood_in(self) -> dict[str, str]:
        """The ``REQUIRES`` entries this process does not meet that a declared stand-in meets: key -> the
        stand-in's report line (the spec then runs here, on the stand-in)."""
        meets: dict[str, list[str]] = {}
        for name in self.standins:  # several stand-ins may meet one key ("cuda": the ring and Mamba's kernels)
            meets.setdefault(standins.get(name).meets, []).append(standins.get(name).description)
        return {key: "; ".join(meets[key]) for key in self._missing() if key in meets}

    def unmet(self) -> dict[str, str]:
        """The ``REQUIRES`` entries this process does not meet, and no declared stand-in meets: ``"cuda"``
        without a CUDA device, a module that cannot be imported."""
        stood_in = self.stood_in()
        return {key: why for key, why in self._missing().items() if key not in stood_in}

    def forward_only(self, device_type: str) -> str | None:
        """Why gradients are not judged on ``device_type`` (``None``: they are)."""
        return self.forward_only_on.get(device_type)


def _positional_capacity(fn: Callable) -> tuple[int, int | None]:
    """``(required, most)`` positional parameters ``fn`` takes (``most`` None: any number)."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    most = None if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


def _check_function(module: types.ModuleType, name: str, arity: int, problems: list[str], *, required: bool) -> None:
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            problems.append(f"{name}: missing (a function taking {arity} positional argument(s))")
        return
    if not callable(fn):
        problems.append(f"{name}: {type(fn).__name__}, not a function")
        return
    try:
        least, most = _positional_capacity(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: its signature cannot be read, trust it
    if least > arity or (most is not None and most < arity):
        problems.append(
            f"{name}: takes {least}..{'any' if most is None else most} positional argument(s); the "
            f"contract calls it with {arity}"
        )


def _str_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) and v for k, v in value.items())


def check_spec(name: str, module: types.ModuleType) -> SpecTraits:
    """Check ``module`` against the contract; its ``SpecTraits``. ``SpecError`` lists every problem found."""
    problems: list[str] = []
    for function, arity in REQUIRED_FUNCTIONS.items():
        _check_function(module, function, arity, problems, required=True)
    for function, arity in OPTIONAL_FUNCTIONS.items():
        _check_function(module, function, arity, problems, required=False)
    if not isinstance(getattr(module, "NAME", None), str):
        problems.append("NAME: missing (a str naming the model)")
    dtypes = getattr(module, "DTYPES", None)
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if not isinstance(dtypes, tuple) or not dtypes or any(d not in names for d in dtypes):
        problems.append("DTYPES: give a non-empty tuple of torch.float32 / torch.bfloat16")
        dtypes = ()
    sizes = getattr(module, "WORLD_SIZES", None)
    if sizes is not None and (
        not isinstance(sizes, tuple) or not sizes or any(not isinstance(n, int) or n < 1 for n in sizes)
    ):
        problems.append(f"WORLD_SIZES: {sizes!r}; give a tuple of positive CP sizes, e.g. (1, 2, 3, 4)")
    declared_rows = getattr(module, "BATCH_ROWS", (1, 2))
    by_kind = declared_rows if isinstance(declared_rows, Mapping) else {k: declared_rows for k in KNOWN_BATCH_KINDS}
    if not all(
        k in KNOWN_BATCH_KINDS and isinstance(v, tuple) and v and all(isinstance(n, int) and n >= 1 for n in v)
        for k, v in by_kind.items()
    ):
        problems.append(
            f"BATCH_ROWS: {declared_rows!r}; give a tuple of positive batch sizes, e.g. (1,), or a dict "
            f"kind -> tuple, e.g. {{'packed': (1,)}}"
        )
        by_kind = {}
    rows = {k: tuple(v) for k, v in by_kind.items()}
    kinds = getattr(module, "BATCH_KINDS", BATCH_KINDS)
    if not isinstance(kinds, tuple) or not kinds or any(k not in KNOWN_BATCH_KINDS for k in kinds):
        problems.append(f"BATCH_KINDS: {kinds!r}; give a tuple among {KNOWN_BATCH_KINDS}")
        kinds = BATCH_KINDS
    for attribute in ("COVERS", "FORWARD_ONLY_ON", "REQUIRES"):
        value = getattr(module, attribute, {})
        if not _str_map(value):
            problems.append(f"{attribute}: {type(value).__name__}; give a dict of str -> non-empty str (what -> why)")
    declared = getattr(module, "STANDINS", ())
    known = standins.known()
    if not isinstance(declared, tuple) or any(not isinstance(n, str) or n not in known for n in declared):
        problems.append(f"STANDINS: {declared!r}; give a tuple of registered stand-in names, among {sorted(known)}")
        declared = ()
    if problems:
        raise SpecError(
            f"model spec {name!r} does not meet the spec contract "
            f"(cp_harness.usage.spec_contract.ModelSpec, docs/extending.md):\n  " + "\n  ".join(problems)
        )
    return SpecTraits(
        name=name,
        world_sizes=sizes,
        batch_kinds=kinds,
        batch_rows=rows,
        covers=dict(getattr(module, "COVERS", {})),
        forward_only_on=dict(getattr(module, "FORWARD_ONLY_ON", {})),
        requires=dict(getattr(module, "REQUIRES", {})),
        dtypes=tuple(names[d] for d in dtypes),
        standins=declared,
    )
