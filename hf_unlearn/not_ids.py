"""A trainer's own numbers in its model card: declared not to be sample ids.

The Hub's forget-id scanner (:mod:`hf_unlearn.hub.leaks`) refuses any number in a card equal to a forget id unless
the card declares it (``not_ids``). Trainers of every layer (the replay engine, the methods, the editors) write
steps, ranks and counts of their own; :func:`own_numbers` declares exactly those values. It is pure (no Hub, no
torch), so the engine that writes card info does not import the publishing code that scans it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any


def own_numbers(tree: Mapping[str, Any], prefix: str) -> dict[str, list[int | float]]:
    """Every integral number a trainer or editor itself wrote under ``prefix`` of its card info (steps, ranks,
    counts, seeds, indices in keys such as ``block_N``), by field, with its exact value: its own ``not_ids``, so that
    a rank of 16 or a run of 500 steps is not refused as sample id 16 or 500. Only these values pass; any other
    number in those fields is still scanned."""
    out: dict[str, list[int | float]] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}"
        found: list[int | float] = [int(n) for n in re.findall(r"\d+", str(key))]
        if isinstance(value, Mapping):
            out.update(own_numbers(value, path))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and float(value).is_integer():
            found.append(value)
        elif isinstance(value, (list, tuple)):  # e.g. a replay's matched step range [0, 7]
            found += [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and float(v).is_integer()]
        if found:
            out[path] = out.get(path, []) + found
    return out
