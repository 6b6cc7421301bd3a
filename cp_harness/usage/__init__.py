"""Usage: how a CP model uses the API under test, as one rank runs it.

* ``resolve_sharder`` -- resolving a sharder a hook returned the framework's way, and sharding with it.
* ``miniature_models`` -- the two miniature models, through the documented API only.
* ``spec_contract`` -- the model spec contract as a type (``ModelSpec``, a Protocol), its optional declarations
  (``SpecTraits``: CP sizes, batch kinds, covered framework functions, forward-only devices, requirements,
  kernel stand-ins) and the check every spec passes when it loads.
* ``model_specs`` -- real framework models through a model spec: loading the spec, one model per (spec, dtype,
  seed) in a rank process, one training step the framework's way, the judge without an oracle.
"""
