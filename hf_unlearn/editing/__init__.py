"""Closed-form weight edits: task matrices, their dominant subspaces (CPQR, truncated CPQR, SVD), QR-Erase.

``qr_erase(model, forget_task, retain_task)`` edits a model in place and returns it with an ``EditReport``; the
decompositions are pure functions on tensors in :mod:`.decompositions`; task matrices (full fine-tunes, LoRA
adapters, GPT-2 ``Conv1D`` included) in :mod:`.task_matrices`; fine-tuning task models from data in
:mod:`.finetune`. Submodules import torch/scipy only when used.
"""
