"""Scripts of one documented call on every rank: a gather, a halo, the loss (the family of function-level checks and
of a call narrowed from a model run).

Each rank loads its inputs, makes the call that failed, backpropagates the upstream gradient the case used (or
the scalar loss itself), and compares every value it returned with what the contract expects, bit for bit or
within the check's budget. What the inputs and the expected values are is the check's business
(``Check.repro``); a call recorded in a model run is judged by the definitions here (``gathered``,
``history``), the same data movement the transport checks hold the implementation to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cp_harness.cases.descriptions import EPS, accumulate
from cp_harness.instruments.coverage import memory_order
from cp_harness.judging.compare import compare_exact, compare_ulp
from cp_harness.repro import script
from cp_harness.repro.subjects import Subject

# What each documented call must do, as a script's docstring says it (``docs/contract.md``).
WHAT = {
    "inkling2.gather_sequence": "every rank's shard [B, L, ...], gathered along dim 1 in rank order, is the same global "
                                "tensor on every rank; the backward hands each rank the sum over all ranks of the "
                                "upstream gradient slices of its own shard (bfloat16/float16: accumulated in float32, "
                                "rounded once).",
    "mistral_large4.gather_tokens": "every rank's tokens [T, ...], gathered along dim 0 in rank order, are the same "
                                    "global tensor on every rank; the backward hands each rank the sum over all ranks "
                                    "of the upstream gradient slices of its own tokens (bfloat16/float16: accumulated "
                                    "in float32, rounded once).",
    "inkling2.convolution_history": "convolution_history(x, mesh, width) returns the width - 1 global rows before "
                                    "this rank's shard (zeros before position 0) followed by x; the backward adds "
                                    "every history row's gradient to the rank that owns the row (bfloat16/float16: in "
                                    "float32, rounded once).",
    "mistral_large4.shifted_cp_loss": "each rank's loss is its own sum of shifted cross-entropies x N / the global "
                                      "count of targets (the target of a shard's last position comes from the next "
                                      "rank), returned in float32 for bfloat16/float16 logits; its gradient is that "
                                      "of the rank's loss.",
}

# Placeholders of the script's constants (script.py writes each script's own).
INPUTS: tuple = ()
DIFFERENTIATED: tuple = ()
EXPECT: list = []
ULP_EPS: dict = {}


@dataclasses.dataclass(frozen=True)
class Expectation:
    """One value every rank must return: ``name`` (``"output"`` or ``"grad <input>"``), bit for bit or within
    ``budget = (ulp, floor_fraction, ulp_dtype, reference_scale)``; ``axis``: its sequence axis (global positions
    in the arrays' ``positions``); ``dtype``: the torch dtype it must have; ``masked``: only the elements of the
    arrays' ``mask`` are compared."""

    name: str
    budget: tuple[float, float, str, float] | None = None
    axis: int | None = None
    dtype: str | None = None
    masked: bool = False

    def literal(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.budget is not None:
            out.update(ulp=self.budget[0], floor_fraction=self.budget[1], of=self.budget[2],
                       reference_scale=self.budget[3])
        if self.axis is not None:
            out["axis"] = self.axis
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out


@dataclasses.dataclass
class CallCase:
    """One documented call on every rank, ready to be written as a script.

    ``function``: ``part.name``; ``args``: the call's arguments as Python expressions over ``inputs`` and ``mesh``
    (``'inputs["value"]'``, ``"mesh"``, ``"True"``); per rank: ``inputs`` (name -> tensor), ``upstream`` (the
    gradient reaching the output; ``None``: a scalar output backpropagated as it is), ``expected`` (expectation
    name -> tensor), ``positions`` (expectation name -> global position of each index along its axis),
    ``masks``. ``differentiated``: the inputs whose gradient is compared. ``what``: what the call must do;
    ``origin``: where the inputs come from."""

    function: str
    args: list[str]
    inputs: list[dict[str, torch.Tensor]]
    expect: list[Expectation]
    expected: list[dict[str, Any]]
    what: str
    origin: str
    differentiated: tuple[str, ...] = ()
    upstream: list[torch.Tensor | None] | None = None
    positions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    masks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    mesh: bool = True

    @property
    def world(self) -> int:
        return len(self.inputs)


def plan(call: CallCase, subject: Subject, name: str, case_text: str) -> script.Plan:
    """The script of ``call`` against ``subject``."""
    rule = ("bit for bit (data movement)" if all(e.budget is None for e in call.expect)
            else "within the check's ULP budget (arithmetic)")
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in call.inputs[0].items())
    doc = [f"Repro: {subject.title(call.function)} at CP size {call.world}.",
           f"What it checks: {call.what} Each of the {call.world} ranks holds its own inputs ({shapes} on rank 0; "
           f"{call.origin}), calls {call.function}({', '.join(_plain(a) for a in call.args)}), backpropagates the "
           f"upstream gradient the case used and compares what it returned with what the contract expects, {rule}; "
           "the first difference is printed with its rank and global position.",
           *subject.run_paragraphs(), f"Exported by cp_harness from the case {case_text}."]
    permuted = [u for u in (call.upstream or []) if u is not None and memory_order(u) is not None]
    if permuted:
        doc.insert(2, f"The upstream gradient reaches the call as a permuted view (rank 0: shape "
                      f"{list(permuted[0].shape)}, strides {permuted[0].stride()}), stored and rebuilt with those strides.")
    p = script.Plan(name=name, doc=doc, world=call.world, mesh=call.mesh, imports=subject.imports(),
                    arithmetic=any(e.budget is not None for e in call.expect))
    for r in range(call.world):
        for key, value in call.inputs[r].items():
            p.add(f"rank{r}/{key}", value, strides=True)
        if call.upstream is not None and call.upstream[r] is not None:
            p.add(f"rank{r}/upstream", call.upstream[r], strides=True)
        for key, value in call.expected[r].items():
            p.add(f"rank{r}/expected/{key}", value)
        for key, value in (call.positions[r] if call.positions else {}).items():
            p.add(f"rank{r}/positions/{key}", value)
        for key, value in (call.masks[r] if call.masks else {}).items():
            p.add(f"rank{r}/mask/{key}", value)
    p.constants.update(INPUTS=tuple(call.inputs[0]), DIFFERENTIATED=tuple(call.differentiated),
                       EXPECT=[e.literal() for e in call.expect])
    used = sorted({e.budget[2] for e in call.expect if e.budget is not None})
    if used:
        p.constants["ULP_EPS"] = {d: EPS[d] for d in used}
    p.functions = [subject.options_source(), subject.code_under_test_source(call.function), *subject.sources(),
                   _call_source(call), run_rank]
    return p


def _plain(arg: str) -> str:
    return arg.replace('inputs["', "").replace('"]', "")


def _call_source(call: CallCase) -> str:
    return (f"def call(function, inputs, mesh):\n    \"\"\"The call that failed, as the check made it.\"\"\"\n"
            f"    return function({', '.join(call.args)})\n")


# ------------------------------------------------------------------------------ the script's own functions
# (they refer to the names every script defines: load_arrays, tensor, differs, call, code_under_test)
def run_rank(rank: int, args, mesh, device) -> bool:
    """This rank's inputs, the call that failed, the backward with this rank's upstream gradient, then every value
    it returned against what the contract expects (``EXPECT``: bit for bit, or within a ULP budget)."""
    arrays = load_arrays()
    inputs = {name: tensor(arrays, f"rank{rank}/{name}", device).requires_grad_(name in DIFFERENTIATED)
              for name in INPUTS}
    output = call(code_under_test(args), inputs, mesh)
    if f"rank{rank}/upstream" in arrays:
        output.backward(tensor(arrays, f"rank{rank}/upstream", device))
    elif DIFFERENTIATED:
        output.backward()
    got, wrong = {"output": output, **{f"grad {name}": inputs[name].grad for name in DIFFERENTIATED}}, []
    for e in EXPECT:
        actual, positions = got[e["name"]], arrays.get(f"rank{rank}/positions/{e['name']}")
        if e.get("dtype") and actual is not None and str(actual.dtype) != e["dtype"]:
            wrong.append(f"rank {rank}: {e['name']} has dtype {actual.dtype}, the contract says {e['dtype']}")
        budget = (e["ulp"], e["floor_fraction"], ULP_EPS[e["of"]], e["reference_scale"]) if "ulp" in e else None
        wrong += [w for w in [differs(f"rank {rank}: {e['name']}", actual, arrays[f"rank{rank}/expected/{e['name']}"],
                                      lambda i: f"rank {rank}" + ("" if positions is None else
                                                                   f", global position {positions[i[e['axis']]]}"),
                                      budget)] if w]
    print("\n".join(wrong) or f"rank {rank}: every value is what the contract expects", flush=True)
    return not wrong


# ------------------------------------------------------------------------------ definitions of recorded calls
def sum_budget(dtype: torch.dtype, terms: int, magnitude: float) -> tuple | None:
    """How a sum of ``terms`` real-valued gradient slices is compared: bit for bit for up to two (addition is
    commutative, one rounding), else within ``terms - 1`` ULPs of the dtype at the contributions' magnitude
    (the order of a longer sum is the implementation's)."""
    if terms <= 2:
        return None
    return (float(terms - 1), 1.0, str(dtype).replace("torch.", ""), magnitude)


def gathered(inputs: list[torch.Tensor], upstream: list[torch.Tensor | None], axis: int):
    """A gather along ``axis`` recorded on every rank: ``(output, [grad of each rank's input], budget)``: the
    output is every rank's input in rank order; each rank's gradient is the sum over ranks of the upstream
    slices of its own shard (accumulated as the contract says)."""
    output = torch.cat([x.detach() for x in inputs], dim=axis)
    given = [u for u in upstream if u is not None]
    if len(given) < len(upstream):
        return output, None, None
    length = inputs[0].shape[axis]
    grads = [accumulate([u.narrow(axis, r * length, length) for u in given], inputs[0].dtype)
             for r in range(len(inputs))]
    magnitude = float(sum((u.double().abs() for u in given), torch.zeros((), dtype=torch.float64)).max()) \
        if given else 0.0
    return output, grads, sum_budget(inputs[0].dtype, len(inputs), magnitude)


def replay_differs(call: CallCase, recorded) -> bool:
    """Whether what a recorded call returned when replayed on the ranks (``repro.RecordedCall``) differs from what
    ``call`` (its definition) expects of it: the test that picks the call a model failure is narrowed to."""
    for r in range(call.world):
        got = {"output": recorded.output[r]}
        for name, position in zip(call.inputs[r], sorted(recorded.inputs[r])):
            got[f"grad {name}"] = recorded.grads[r].get(position)
        for e in call.expect:
            actual, want = got.get(e.name), call.expected[r][e.name]
            if actual is None:
                return True
            b = e.budget
            verdict = (compare_exact(e.name, actual, want) if b is None else
                       compare_ulp(e.name, actual, want, budget_ulp=b[0], floor_fraction=b[1], ulp_dtype=b[2],
                                   reference_scale=b[3]))
            if not verdict.ok:
                return True
    return False


def history(inputs: list[torch.Tensor], upstream: list[torch.Tensor | None], width: int):
    """A halo recorded on every rank: ``(outputs, grads, budget)``: rank ``r``'s output is the ``width - 1`` global
    rows before its shard (zeros before position 0) followed by its shard; each global row's gradient is the sum of
    the upstream rows that read it (its owner's and those of later ranks' histories)."""
    h, L = width - 1, inputs[0].shape[1]
    padded = torch.cat([torch.zeros_like(inputs[0][:, :1]).expand(-1, h, -1), *[x.detach() for x in inputs]], 1)
    outputs = [padded[:, r * L:r * L + L + h] for r in range(len(inputs))]
    given = [u for u in upstream if u is not None]
    if len(given) < len(upstream):
        return outputs, None, None
    parts, readers = [], torch.zeros(padded.shape[1], dtype=torch.int64)
    for r, u in enumerate(given):
        part = torch.zeros(padded.shape, dtype=u.dtype)
        part[:, r * L:r * L + L + h] = u
        parts.append(part)
        readers[r * L:r * L + L + h] += 1
    total = accumulate(parts, inputs[0].dtype)
    magnitude = float(sum((p.double().abs() for p in parts), torch.zeros((), dtype=torch.float64)).max())
    return outputs, [total[:, h + r * L:h + (r + 1) * L] for r in range(len(inputs))], \
        sum_budget(inputs[0].dtype, int(readers[h:].max()), magnitude)


def payload_budget(dtype: torch.dtype, policy, terms: int, magnitude: float):
    """How a check's sum of ``terms`` gradient contributions is compared: bit for bit under the strict policy; under
    ``payload`` a bfloat16/float16 sum within ``terms - 1`` ULPs at the contributions' magnitude."""
    if not (policy.payload_sums and dtype in (torch.bfloat16, torch.float16) and terms > 1):
        return None
    return (float(terms - 1), 1.0, str(dtype).replace("torch.", ""), magnitude)


# ------------------------------------------------------------------------------ the documented calls as CallCases
_RECORDED = "recorded on the ranks where the model run made this call"


def gather_call(function: str, axis: int, xs, upstream, output, grads, budget, differentiable: str, origin: str,
                mesh: bool = True) -> CallCase:
    """A gather along ``axis`` on every rank: inputs ``xs``, the gathered ``output``, each rank's ``grads``."""
    n, L = len(xs), xs[0].shape[axis]
    return CallCase(
        function, ['inputs["value"]', "mesh", differentiable], [{"value": x} for x in xs],
        [Expectation("output", axis=axis)] + ([Expectation("grad value", budget, axis=axis)] if grads else []),
        [{"output": output, **({"grad value": grads[r]} if grads else {})} for r in range(n)], WHAT[function],
        origin, ("value",) if grads else (), upstream if grads else None,
        [{"output": torch.arange(n * L), "grad value": torch.arange(r * L, (r + 1) * L)} for r in range(n)], mesh=mesh)


def recorded_gather(function: str, axis: int):
    """The definition of a gather recorded in another check's run (``Check.repro.replays``)."""
    def recorded(rec) -> CallCase:
        xs = [inputs[0] for inputs in rec.inputs]
        output, grads, budget = gathered(xs, rec.upstream, axis)
        return gather_call(function, axis, xs, rec.upstream, output, grads, budget, rec.others.get("2", "True"),
                           _RECORDED)
    return recorded


def history_call(xs, upstream, outputs, grads, budget, width: int, origin: str, mesh: bool = True) -> CallCase:
    """``convolution_history(x, mesh, width)`` on every rank: inputs ``xs``, each rank's ``outputs`` and ``grads``."""
    n, L, h = len(xs), xs[0].shape[1], width - 1
    return CallCase(
        "inkling2.convolution_history", ['inputs["x"]', "mesh", str(width)], [{"x": x} for x in xs],
        [Expectation("output", axis=1)] + ([Expectation("grad x", budget, axis=1)] if grads else []),
        [{"output": outputs[r], **({"grad x": grads[r]} if grads else {})} for r in range(n)],
        WHAT["inkling2.convolution_history"], origin, ("x",) if grads else (), upstream if grads else None,
        [{"output": torch.arange(r * L - h, (r + 1) * L), "grad x": torch.arange(r * L, (r + 1) * L)} for r in range(n)],
        mesh=mesh)


def recorded_history(rec) -> CallCase:
    """The definition of a halo recorded in another check's run (``Check.repro.replays``)."""
    xs, width = [inputs[0] for inputs in rec.inputs], int(rec.others.get("2", "1"))
    outputs, grads, budget = history(xs, rec.upstream, width)
    return history_call(xs, rec.upstream, outputs, grads, budget, width, _RECORDED)
