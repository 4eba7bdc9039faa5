"""Publishing unlearned models to the Hugging Face Hub and checking them there.

``cards`` renders model cards from the Jinja templates in ``model_cards/``; ``keys`` turns raw sample ids into keyed
tags (HMAC with a key that stays local); ``publish`` pushes weights, tokenizer, state-hash manifest, card and
publishable provenance in one commit; ``verify`` downloads a revision and recomputes its state hashes;
``mixin`` gives trainers ``create_model_card``/``push_to_hub``; ``server`` is a local Hub-compatible server.
Modules import ``huggingface_hub`` only inside functions, so ``HF_ENDPOINT`` can be set late.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "push_unlearned": "hf_unlearn.hub.publish",
    "PushResult": "hf_unlearn.hub.publish",
    "save_card_info": "hf_unlearn.hub.publish",
    "build_manifest": "hf_unlearn.hub.publish",
    "verify_on_hub": "hf_unlearn.hub.verify",
    "verify_folder": "hf_unlearn.hub.verify",
    "VerifyReport": "hf_unlearn.hub.verify",
    "render_model_card": "hf_unlearn.hub.cards",
    "UnlearningHubMixin": "hf_unlearn.hub.mixin",
    "write_model_card": "hf_unlearn.hub.mixin",
    "keyed_tags": "hf_unlearn.hub.keys",
    "HubServer": "hf_unlearn.hub.server",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_unlearn.hub' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
