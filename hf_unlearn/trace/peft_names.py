"""The plain model's name of a PEFT-wrapped model's tensor: what lineage roots and checkpoint hashes name it by."""

from __future__ import annotations

import re

_PEFT_PREFIX = re.compile(r"^base_model\.model\.")


def base_key(name: str) -> str:
    """The base model's own key of a (PEFT-wrapped) parameter name: ``base_model.model.X.base_layer.weight`` ->
    ``X.weight``; any other name is its own."""
    return _PEFT_PREFIX.sub("", name).replace(".base_layer.", ".")
