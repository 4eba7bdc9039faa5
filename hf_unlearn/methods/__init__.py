"""Approximate unlearning trainers: MASC (stops by itself) and the fixed-budget baselines and methods.

Each method is a ``XConfig(UnlearningConfig)`` + ``XTrainer(UnlearningTrainer)`` pair; losses live in
:mod:`hf_unlearn.losses`. Names resolve lazily so importing one trainer module does not import the others.
"""

from __future__ import annotations

import importlib

_LAZY = {
    # --- methods (approximate unlearning) ---
    "UnlearningConfig": "base",
    "UnlearningTrainer": "base",
    "MASCConfig": "masc",
    "MASCTrainer": "masc",
    "MASCStoppingCallback": "masc",
    **{name: "baselines" for name in (
        "GradAscentConfig", "GradAscentTrainer", "GradDiffConfig", "GradDiffTrainer", "NPOConfig", "NPOTrainer",
        "SimNPOConfig", "SimNPOTrainer", "RMUConfig", "RMUTrainer",
    )},
    **{name: "preference" for name in (
        "IdkDPOConfig", "IdkDPOTrainer", "IdkNLLConfig", "IdkNLLTrainer", "PreferenceCollator", "load_refusals",
    )},
    **{name: "soft_targets" for name in ("UNDIALConfig", "UNDIALTrainer", "CEUConfig", "CEUTrainer")},
    **{name: "reweighted" for name in ("WGAConfig", "WGATrainer", "SatImpConfig", "SatImpTrainer")},
    **{name: "pdu" for name in ("PDUConfig", "PDUTrainer", "PDUDualCallback")},
    "NonFiniteGradientCallback": "base",
    # --- random-label forgetting ---
    **{name: "random_label" for name in (
        "MultipleChoiceConfig", "MultipleChoiceTrainer", "RandomLabelConfig", "RandomLabelForgetTrainer",
    )},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_unlearn.methods' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
