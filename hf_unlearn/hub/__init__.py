"""Publishing unlearned models to the Hugging Face Hub and checking them there.

``cards`` renders model cards from the Jinja templates in ``model_cards/``; ``keys`` is the one id-tagging key and
keyed tags; ``leaks`` finds forget ids in anything about to be published; ``provenance`` selects and checks the trace
files a push may publish; ``publish`` pushes weights, tokenizer, state-hash manifest, card and provenance in one
commit; ``verify`` downloads a revision, recomputes its hashes and loads it; ``mixin`` gives trainers
``create_model_card``/``push_to_hub``; ``replay`` puts the mixin above the replay engine's trainers; ``server`` (over
``store``) is a local Hub-compatible server.
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
    "expected_from": "hf_unlearn.hub.verify",
    "render_model_card": "hf_unlearn.hub.cards",
    "UnlearningHubMixin": "hf_unlearn.hub.mixin",
    "write_model_card": "hf_unlearn.hub.mixin",
    "keyed_tags": "hf_unlearn.hub.keys",
    "load_key": "hf_unlearn.hub.keys",
    "rotate_key": "hf_unlearn.hub.keys",
    "IdScanner": "hf_unlearn.hub.leaks",
    "find_raw_ids": "hf_unlearn.hub.leaks",
    "HubServer": "hf_unlearn.hub.server",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_unlearn.hub' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
