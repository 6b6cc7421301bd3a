"""Usage: how a CP model uses the API under test, as one rank runs it.

* ``resolve_sharder`` -- resolving a sharder a hook returned the framework's way, and sharding with it.
* ``miniature_models`` -- the two miniature models, through the documented API only.
"""
