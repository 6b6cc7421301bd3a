"""Reports as strict JSON: the one conversion every command's JSON file goes through.

Python's ``json`` writes ``inf`` and ``nan`` as bare ``Infinity``/``NaN``, which
strict JSON readers reject; a ratio against a zero minimum is ``inf``, so report
values pass through :func:`json_safe` before they are written.
"""

from __future__ import annotations

import math


def json_safe(value):
    """Non-finite floats as strings (``"inf"``), so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
