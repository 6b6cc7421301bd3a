"""``cp_impl`` with the ``contiguous_2n`` sharding layout (see :mod:`cp_impl.variants`)."""

from cp_impl.variants import with_layout

inkling2, mistral_large4, sharder = with_layout("contiguous_2n")

__all__ = ["inkling2", "mistral_large4", "sharder"]
