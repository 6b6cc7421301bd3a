"""Usage: how a CP model uses the API under test, as one rank runs it.

* ``resolve_sharder`` -- resolving a sharder a hook returned the framework's way, and sharding with it.
* ``miniature_models`` -- the two miniature models, through the documented API only.
* ``model_specs`` -- real framework models through a model spec: loading and validating the spec, one model per
  (spec, dtype, seed) in a rank process, one training step the framework's way, the judge without an oracle.
"""
