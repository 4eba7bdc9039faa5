"""hf_unlearn: machine unlearning for language models, the Hugging Face way.

Importing the package is cheap: public names are resolved lazily on first access, so
``import hf_unlearn`` pulls in neither torch nor transformers until a name needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

# public name -> module that defines it. Each capability adds its names here.
_LAZY: dict[str, str] = {
    # data
    "load_tofu": "hf_unlearn.data.tofu",
    "tokenize_qa": "hf_unlearn.data.tokenize",
    "QACollator": "hf_unlearn.data.collators",
    "load_task": "hf_unlearn.data.tasks",
    "load_muse_news": "hf_unlearn.data.muse",
    # models
    "load_model": "hf_unlearn.models",
    "load_tokenizer": "hf_unlearn.models",
    "build_tiny_model": "hf_unlearn.models",
    # state hashes (shared by trace verification and Hub cards)
    "state_hashes": "hf_unlearn.trace.hashing",
    "StateHashes": "hf_unlearn.trace.hashing",

    # --- trace (exact deletion) ---
    "TraceRecordingTrainer": "hf_unlearn.trace.recording",
    "trace_recording": "hf_unlearn.trace.recording",
    "RedactedReplayTrainer": "hf_unlearn.hub.replay",  # the engine's class with Hub publishing (push_to_hub)
    "OracleReplayTrainer": "hf_unlearn.hub.replay",
    "redact_store": "hf_unlearn.trace.store",
    "replay_cost": "hf_unlearn.trace.replay",
    "verify_replay": "hf_unlearn.trace.verification",

    # --- methods (approximate unlearning) ---
    "UnlearningConfig": "hf_unlearn.methods.base",
    "UnlearningTrainer": "hf_unlearn.methods.base",
    "MASCConfig": "hf_unlearn.methods.masc",
    "MASCTrainer": "hf_unlearn.methods.masc",
    "MASCStoppingCallback": "hf_unlearn.methods.masc",
    "GradAscentConfig": "hf_unlearn.methods.baselines",
    "GradAscentTrainer": "hf_unlearn.methods.baselines",
    "GradDiffConfig": "hf_unlearn.methods.baselines",
    "GradDiffTrainer": "hf_unlearn.methods.baselines",
    "NPOConfig": "hf_unlearn.methods.baselines",
    "NPOTrainer": "hf_unlearn.methods.baselines",
    "SimNPOConfig": "hf_unlearn.methods.baselines",
    "SimNPOTrainer": "hf_unlearn.methods.baselines",
    "RMUConfig": "hf_unlearn.methods.baselines",
    "RMUTrainer": "hf_unlearn.methods.baselines",
    **{name: f"hf_unlearn.methods.{module}" for module, names in (
        ("preference", ("IdkDPOConfig", "IdkDPOTrainer", "IdkNLLConfig", "IdkNLLTrainer")),
        ("soft_targets", ("UNDIALConfig", "UNDIALTrainer", "CEUConfig", "CEUTrainer")),
        ("reweighted", ("WGAConfig", "WGATrainer", "SatImpConfig", "SatImpTrainer")),
        ("pdu", ("PDUConfig", "PDUTrainer")),
    ) for name in names},

    # --- random-label forgetting and analysis ---
    "MultipleChoiceConfig": "hf_unlearn.methods.random_label",
    "MultipleChoiceTrainer": "hf_unlearn.methods.random_label",
    "RandomLabelConfig": "hf_unlearn.methods.random_label",
    "RandomLabelForgetTrainer": "hf_unlearn.methods.random_label",
    "evaluate_multiple_choice": "hf_unlearn.eval.tasks",
    "forget_gap": "hf_unlearn.analysis.forgetting",
    "forget_ratio": "hf_unlearn.analysis.forgetting",
    "probe_by_layer": "hf_unlearn.analysis.probes",
    "run_forgetting_experiment": "hf_unlearn.analysis.forgetting_experiment",
    "ForgettingSetup": "hf_unlearn.analysis.forgetting_experiment",

    # --- circuits and unlearning difficulty (CUD) ---
    "CircuitConfig": "hf_unlearn.analysis.circuits",
    "CircuitSet": "hf_unlearn.analysis.circuits",
    "compute_circuits": "hf_unlearn.analysis.circuits",
    "extract_circuit": "hf_unlearn.analysis.circuits",
    "circuit_similarity": "hf_unlearn.analysis.circuits",
    "circuit_statistics": "hf_unlearn.analysis.circuits",
    "edge_patching_effects": "hf_unlearn.analysis.circuits",
    "AnchorConfig": "hf_unlearn.analysis.cud",
    "AnchorSet": "hf_unlearn.analysis.cud",
    "build_anchors": "hf_unlearn.analysis.cud",
    "compute_cud": "hf_unlearn.analysis.cud",
    "stratify": "hf_unlearn.analysis.cud",

    # --- evaluation ---
    "evaluate_tofu": "hf_unlearn.eval.tofu",
    "TofuResult": "hf_unlearn.eval.tofu",
    "evaluate_muse_news": "hf_unlearn.eval.muse",
    "MuseResult": "hf_unlearn.eval.muse",
    "evaluate_quantized": "hf_unlearn.eval.quantized",
    "quantize_model": "hf_unlearn.eval.quantized",
    "evaluate_robustness": "hf_unlearn.eval.robustness",
    "RobustnessResult": "hf_unlearn.eval.robustness",
    "training_preset": "hf_unlearn.presets",
    "evaluation_preset": "hf_unlearn.presets",
    "UnlearningEvalCallback": "hf_unlearn.eval.callback",
    "UnlearningStoppingCallback": "hf_unlearn.eval.stopping",

    # --- a deletion request end to end ---
    "forget": "hf_unlearn.deletion",
    "ForgetConfig": "hf_unlearn.deletion",
    "ForgetReceipt": "hf_unlearn.deletion",
    # --- a stream of requests: the deletion service ---
    "DeletionLedger": "hf_unlearn.deletion",
    "verify_receipt": "hf_unlearn.deletion",
    # --- closed-form editing (QR-Erase) ---
    "qr_erase": "hf_unlearn.editing.qr_erase",
    "QREraseConfig": "hf_unlearn.editing.qr_erase",
    "EditReport": "hf_unlearn.editing.report",
    "TaskMatrices": "hf_unlearn.editing.task_matrices",
    "load_task_matrices": "hf_unlearn.editing.task_matrices",
    "make_task_matrices": "hf_unlearn.editing.finetune",

    # --- hub publishing ---
    "push_unlearned": "hf_unlearn.hub.publish",
    "verify_on_hub": "hf_unlearn.hub.verify",
    "UnlearningHubMixin": "hf_unlearn.hub.mixin",
    "write_model_card": "hf_unlearn.hub.mixin",
    "HubServer": "hf_unlearn.hub.server",

}

__all__ = sorted(_LAZY) + ["__version__"]

from .runtime import quiet_optional_backends as _quiet  # noqa: E402  (stdlib only: keeps the import light)

_quiet()  # peft imports bitsandbytes, which logs a kernels notice at import in every script; drop that one line


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_unlearn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

