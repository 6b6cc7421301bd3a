"""Both miniature models on N ranks equal one device: logits, loss, input and parameter gradients.

float64 and float32 are judged by their ULP budgets and by the excess over one rank of the same
implementation; bfloat16 (parameters, activations and gradients) by its ceiling and the excess. The
models are not float16-safe (their rms_norm epsilon is subnormal there), so float16 is exercised by
the data-movement checks and the loss only."""

from hypothesis import given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks.models import MODEL, model_cases


@settings(max_examples=examples(2.0))
@given(case=model_cases(dtypes=("float64",)))
@MODEL.with_examples(lambda case: case["dtype"] == "float64")
def test_models_match_oracle_float64(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(0.5))
@given(case=model_cases(dtypes=("float32",)))
def test_models_match_oracle_float32(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(0.5))
@given(case=model_cases(dtypes=("bfloat16",)))
@MODEL.with_examples(lambda case: case["dtype"] == "bfloat16")
def test_models_match_oracle_bfloat16(cp_runner, case):
    cp_runner.check(case)
