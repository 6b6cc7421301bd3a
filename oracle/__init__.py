"""Single-device reference implementations ("oracles") for context parallelism.

The oracles are pure functions of *global* (unsharded) tensors: no process
group, no mesh. They run in float64 by default, are written for clarity
(dense masks, explicit loops where clearer) and import nothing from
``cp_impl`` or ``cp_harness``.

Modules (imported on demand; importing ``oracle`` itself loads nothing else):

* :mod:`oracle.layout` -- ``keep`` / ``document_ids`` / ``positions``
  ``[batch, sequence]`` from ``seq_lens`` + ``seq_lens_padded`` (THD packs),
  from ``attention_mask`` (BSHD rows), or from a whole batch; the ``FILLER``
  (-1000) and ``IGNORE_INDEX`` (-100) constants.
* :mod:`oracle.attention` -- rotary embedding (rotate-half) and document-masked
  causal grouped-query attention with optional sliding window and score
  soft-cap.
* :mod:`oracle.convolution` -- causal depthwise convolution that never reads
  across a document boundary or from padding.
* :mod:`oracle.loss` -- shifted (Hugging Face) and aligned cross-entropy,
  returning ``(sum, count)``, and ``mean_loss``.
* :mod:`oracle.models` -- the two miniature models of
  ``docs/miniature_models.md`` (Inkling2-mini, MistralLarge4-mini): configs,
  seeded parameter initialisation, shared pieces and forwards.
"""

__all__ = ["layout", "attention", "convolution", "loss", "models"]
