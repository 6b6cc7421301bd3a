"""Metamorphic properties: what must not change the result, and what must not depend on CP.

- Padding token ids, padding labels and padding position values never change
  any real output or gradient: bit for bit, on every rank.
- Results do not depend on the CP size: N ranks agree with one rank within
  the model budget (they sum in different orders, so not bit for bit).
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_harness.cases.descriptions import build_batch, canonical, with_changes
from cp_harness.cases.profiles import examples
from cp_harness.checks._token_layout import reported_layout
from cp_harness.checks.models import MODEL, model_cases
from cp_harness.judging.compare import compare_exact, compare_ulp
from cp_harness.judging.policy import STRICT
from cp_harness.judging.render import comparison_summary
from oracle.layout import layout_from_batch


def _real_mask(case, padded_len):
    keep = layout_from_batch(build_batch(case)).keep.numpy()
    S = keep.shape[1]
    mask = np.zeros((keep.shape[0], padded_len), dtype=bool)
    mask[:, :S] = keep
    return mask


def _outputs_or_fail(cp_runner, case):
    outputs = cp_runner.run_outputs(case)
    bad = [o for o in outputs if not o.ok]
    assert not bad, f"rank {bad[0].rank} raised {bad[0].error_type}: {bad[0].message}\ncase: {canonical(case)}"
    return outputs


@settings(max_examples=examples(0.3))
@given(case=model_cases(max_len=20), padding_seed=st.integers(min_value=1, max_value=2**31 - 1))
def test_padding_contents_never_change_real_results(cp_runner, case, padding_seed):
    base = with_changes(case, batch=dict(case["batch"], given_positions=True))
    noisy = with_changes(case, batch=dict(case["batch"], given_positions=True, padding_seed=padding_seed))
    a, b = _outputs_or_fail(cp_runner, base), _outputs_or_fail(cp_runner, noisy)
    S = build_batch(case)["input_ids"].shape[1]
    layout = reported_layout(a, S)  # both runs have the same layout: the sharder sees the same shapes
    real = _real_mask(base, layout.padded_len)
    grid = layout.grid
    results = [
        compare_exact(
            "logits (real tokens)", layout.scatter(b, "logits"), layout.scatter(a, "logits"), mask=real, grid=grid
        )
        if real.any()
        else None,
        compare_exact(
            "input-embedding gradient",
            layout.scatter(b, "inputs_embeds.grad"),
            layout.scatter(a, "inputs_embeds.grad"),
            grid=grid,
            gradient=True,
        ),
    ]
    for o_a, o_b in zip(a, b):
        results.append(compare_exact(f"loss@rank{o_a.rank}", o_b.tensors["loss"], o_a.tensors["loss"], rank=o_a.rank))
        for name in o_a.tensors:
            if name.startswith("grad."):
                results.append(
                    compare_exact(f"{name}@rank{o_a.rank}", o_b.tensors[name], o_a.tensors[name], rank=o_a.rank)
                )
    failed = [comparison_summary(r) for r in results if r is not None and not r.ok]
    assert not failed, (
        "padding contents changed a real result\n"
        f"case: {canonical(base)}\nwith padding: {canonical(noisy)}\n" + "\n".join(failed)
    )


@settings(max_examples=examples(0.2))
@given(case=model_cases((2, 3, 4, 8), max_len=20))
def test_results_do_not_depend_on_cp_size(cp_runner, case):
    one = with_changes(case, world_size=1)
    one.pop("mesh", None)
    single, multi = _outputs_or_fail(cp_runner, one), _outputs_or_fail(cp_runner, case)
    n = int(case["world_size"])
    budget = STRICT.budget(MODEL, case.get("dtype", "float64"))
    S = build_batch(case)["input_ids"].shape[1]
    many, one_rank = reported_layout(multi, S), reported_layout(single, S)  # any padding, any index map
    kw = dict(budget_ulp=budget.ulp, floor_fraction=budget.floor_fraction)
    results = [
        compare_ulp("logits", many.scatter(multi, "logits")[:, :S], one_rank.scatter(single, "logits")[:, :S], **kw),
        compare_ulp(
            "loss", np.array(sum(float(o.tensors["loss"]) for o in multi) / n), single[0].tensors["loss"], **kw
        ),
        compare_ulp(
            "input-embedding gradient",
            many.scatter(multi, "inputs_embeds.grad")[:, :S] / n,
            one_rank.scatter(single, "inputs_embeds.grad")[:, :S],
            **kw,
        ),
    ]
    for name in single[0].tensors:
        if name.startswith("grad."):
            results.append(compare_ulp(name, sum(o.tensors[name] for o in multi) / n, single[0].tensors[name], **kw))
    failed = [comparison_summary(r) for r in results if not r.ok]
    assert not failed, f"N={n} differs from N=1\ncase: {canonical(case)}\n" + "\n".join(failed)
