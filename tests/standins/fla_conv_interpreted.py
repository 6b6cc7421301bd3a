"""fla's own Triton conv kernels run by Triton's CPU interpreter against the stand-in ``fla_conv_cpu``
(``test_fla_conv_cpu.py`` starts this with ``TRITON_INTERPRET=1``, which triton reads when fla's kernels are
decorated: at import). fla's autotuner benchmarks its configs through a GPU driver, which the interpreter has not,
so each kernel is cut to its first config (a tiling choice: every config computes the same function). Prints one
JSON object: per case the largest absolute difference of each output, or the interpreter's error."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton.runtime.autotuner as autotuner

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")
_prune = autotuner.Autotuner.prune_configs
autotuner.Autotuner.prune_configs = lambda self, kwargs: _prune(self, kwargs)[:1]  # type: ignore[method-assign]

from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd  # noqa: E402

from cp_harness.standins import fla_conv_cpu  # noqa: E402


def case(rows, T, cu, with_state, with_bias, with_residual, activation, seed):
    g = torch.Generator().manual_seed(seed)
    D = 16
    n = rows if cu is None else len(cu) - 1
    x = torch.randn(rows, T, D, generator=g)
    w = torch.randn(D, 4, generator=g)
    b = torch.randn(D, generator=g) if with_bias else None
    r = torch.randn(rows, T, D, generator=g) if with_residual else None
    h0 = torch.randn(n, D, 4, generator=g) if with_state else None
    dy = torch.randn(rows, T, D, generator=g)
    cu_t = None if cu is None else torch.tensor(cu)
    out: dict = {}
    kernel = causal_conv1d_fwd(x, w, b, r, initial_state=h0, activation=activation, cu_seqlens=cu_t)[0]
    ours = fla_conv_cpu.conv_fwd(x, w, b, r, h0, activation=activation, cu_seqlens=cu_t)[0]
    out["y"] = float((kernel - ours).abs().max() / ours.abs().max())
    try:
        got = causal_conv1d_bwd(x, dy, None, w, b, r, initial_state=h0, activation=activation, cu_seqlens=cu_t)
        want = fla_conv_cpu.conv_bwd(x, dy, None, w, b, r, h0, activation, cu_t)
        for name, k, o in zip(("dx", "dw", "db", "dr", "dh0"), got, want):
            if o is not None:
                out[name] = float((k - o).abs().max() / o.abs().max())
    except Exception as e:  # noqa: BLE001 - recorded: what the interpreter does not run
        out["bwd_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


CASES = {
    "rows_state_bias_silu": dict(rows=2, T=32, cu=None, with_state=True, with_bias=True, with_residual=False,
                                 activation="silu", seed=0),
    "docs_state_residual": dict(rows=1, T=32, cu=[0, 5, 9, 32], with_state=True, with_bias=False, with_residual=True,
                                activation=None, seed=1),
    "rows_bias_silu": dict(rows=2, T=32, cu=None, with_state=False, with_bias=True, with_residual=False,
                           activation="silu", seed=2),
    "docs_swish": dict(rows=1, T=40, cu=[0, 3, 20, 40], with_state=False, with_bias=True, with_residual=False,
                       activation="swish", seed=3),
}  # fmt: skip

if __name__ == "__main__":
    print(json.dumps({name: case(**kw) for name, kw in CASES.items()}))
