"""``cp_impl``'s strategies served through nemo-automodel 0.7.0's own ``ContextParallelSharder`` class.

The hooks are ``cp_impl``'s; the sharder they return is the framework's class,
constructed the way a model hook constructs it:
``ContextParallelSharder(shard_batch=<cp_impl's strategy>, local_token_global_indices=<cp_impl's index map>)``.
The harness then resolves it with the framework's constructor (``device_mesh=``),
shards with the framework's ``shard`` and uses the framework's verbs
(``shard_token_tensor(fill=)``, ``gather_token_tensor(trim=)``, which gather
with ``torch.distributed.nn.functional.all_gather``). This is the compatibility
case of the sharder contract: the class is the framework's, the strategy ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = ContextParallelSharder
_CLASS = "nemo_automodel.components.distributed.context_parallel.sharder.ContextParallelSharder"
# The hooks' returned sharder (class, constructor, shard, verbs) is the framework's.
SERVES = {
    "inkling2.prepare_cp_inputs": _CLASS,
    "mistral_large4.prepare_cp_inputs": _CLASS,
    "mistral_large4.prepare_packed_cp_inputs": _CLASS,
}


def _framework_class(hook: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def prepare(*args: Any, **kwargs: Any) -> dict[str, Any]:
        ours = hook(*args, **kwargs)["cp_sharder"]
        return {
            "cp_sharder": ContextParallelSharder(
                shard_batch=ours.shard_batch, local_token_global_indices=ours.local_token_global_indices
            )
        }

    prepare.__name__, prepare.__doc__ = hook.__name__, hook.__doc__
    return prepare


inkling2, mistral_large4 = compose(
    __name__,
    inkling2={"prepare_cp_inputs": _framework_class(cp_impl.inkling2.prepare_cp_inputs)},
    mistral_large4={
        "prepare_cp_inputs": _framework_class(cp_impl.mistral_large4.prepare_cp_inputs),
        "prepare_packed_cp_inputs": _framework_class(cp_impl.mistral_large4.prepare_packed_cp_inputs),
    },
)
