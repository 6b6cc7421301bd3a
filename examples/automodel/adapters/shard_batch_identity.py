"""Sharding served by nemo-automodel 0.7.0's identity sharder, ``shard_batch_identity``.

What the framework's dispatch returns when no CP prep applies (``cp_size <=
1``): ``ContextParallelSharder(shard_batch=shard_batch_identity,
local_token_global_indices=identity_local_indices)``. The batch is returned
as it came (nothing padded, ``original == padded``) and every rank's index map
is the whole sequence, so the token verbs are identities.

Translation only, at every CP size: every hook returns the framework's
identity sharder around ``cp_impl``'s normalisation, except for packs, which
keep ``cp_impl``'s packed strategy: the identity sharder has no notion of
documents (it does not mask the label of each document's first token, which
the packed hook's contract requires; the framework's recipes do that in the
data pipeline), like the shared contiguous sharder. At one rank
it is the framework's own choice; at ``N > 1`` the framework never picks it
(every rank would own every token), and the gate must say so: that is what the
``N > 1`` rows of this adapter show (``docs/real_clients.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    identity_local_indices,
    shard_batch_identity,
)

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_batch_identity
_STRATEGY = "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_identity"
WORLD_SIZES = (1,)  # the framework dispatches it at cp_size <= 1 only (S4: at N > 1 every rank owns every token)
SERVES = {"inkling2.prepare_cp_inputs": _STRATEGY, "mistral_large4.prepare_cp_inputs": _STRATEGY}


def _identity(hook: Callable[..., dict[str, Any]]):
    def prepare(batch, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ours = hook(batch, *args, **kwargs)  # cp_impl's normalisation of the batch (positions, padding_mask)
        if "document_ids" in batch:  # a normalised pack: no document semantics in the identity sharder
            return ours
        return {
            "cp_sharder": ContextParallelSharder(
                shard_batch=shard_batch_identity, local_token_global_indices=identity_local_indices
            )
        }

    prepare.__name__, prepare.__doc__ = hook.__name__, hook.__doc__
    return prepare


inkling2, mistral_large4 = compose(
    __name__,
    inkling2={"prepare_cp_inputs": _identity(cp_impl.inkling2.prepare_cp_inputs)},
    mistral_large4={"prepare_cp_inputs": _identity(cp_impl.mistral_large4.prepare_cp_inputs)},
)
