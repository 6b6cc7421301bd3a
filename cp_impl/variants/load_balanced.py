"""``cp_impl`` with the ``load_balanced`` sharding layout (see :mod:`cp_impl.variants`)."""

from cp_impl.variants import with_layout

inkling2, mistral_large4, sharder = with_layout("load_balanced")

__all__ = ["inkling2", "mistral_large4", "sharder"]
