"""The dummy's zero influence is evidence on every replayed microbatch, not a probe at construction.

A deleted slot is filled by a dummy sequence whose labels are all ignored: the deletion is the run's counterfactual
only if the dummy has weight exactly 0, i.e. the loss does not depend on its tokens. The recorder probes the loss
once, at construction (first order, at the initial weights, global step 0), which a loss whose dummy term starts at
zero and grows (``0.05 * state.global_step * (logits ** 2).mean()`` over every token) passes. So replays and the
oracle check every microbatch that holds a dummy while it runs: a hook on the input embeddings' output reads the
gradient the loss gives the dummy's token positions, which must be exactly zero; the first microbatch where it is
not stops the replay before its optimizer step with :class:`DummyInfluenceError`, naming the step and the loss.

Where the dummies sit in the collated batch is found by collating the microbatch a second time with another token in
the dummies' places (:func:`dummy_positions`): it works for any collator (padding side, padding-free, packed rows).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UnlearnError


class DummyInfluenceError(UnlearnError):
    """A deleted slot's dummy received a non-zero gradient: the loss gave it weight, so the replay is not the
    counterfactual of the run without the deleted rows."""


def dummy_positions(batch: dict, marked: dict) -> torch.Tensor:
    """Boolean mask (``input_ids``' shape) of the dummy tokens: where the batch collated with the dummies' token
    replaced by another differs from the batch itself."""
    a, b = batch.get("input_ids"), marked.get("input_ids")
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
        raise UnlearnError("the collator's output shape depends on the tokens' values, so the dummies' positions in a "
                           "collated microbatch cannot be located (their zero gradient cannot be checked)")
    return a != b


class DummyGradientWatch:
    """While active, every gradient that reaches the input embeddings' output is checked at the dummy positions."""

    def __init__(self, model, mask: torch.Tensor):
        self.model, self.mask = model, mask
        self.flag = torch.zeros((), dtype=torch.bool, device=mask.device)
        self.largest = torch.zeros((), device=mask.device)
        self._handle = None

    def _seen(self, grad: torch.Tensor) -> None:
        if grad.shape[:2] != self.mask.shape:
            return  # another forward inside the loss (not on this microbatch's tokens)
        at = grad[self.mask]
        if at.numel():
            self.flag |= (at != 0).any()
            self.largest = torch.maximum(self.largest, at.detach().abs().amax().float())

    def _forward_hook(self, module, args, output):
        if not torch.is_tensor(output) or not torch.is_grad_enabled():
            return None
        if not output.requires_grad and output.is_leaf:  # frozen embeddings (LoRA): let the gradient reach them
            output = output.requires_grad_(True)
        if output.requires_grad:
            output.register_hook(self._seen)
        return output

    def __enter__(self):
        self._handle = self.model.get_input_embeddings().register_forward_hook(self._forward_hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


def watch_dummy_gradient(model, mask: torch.Tensor | None):
    """A :class:`DummyGradientWatch` over ``model`` for a microbatch with dummies at ``mask``; a no-op without."""
    return DummyGradientWatch(model, mask) if mask is not None else contextlib.nullcontext()


def dummy_influence_message(loss_owner: str, step: int, mb: int, loss, largest: float) -> str:
    import math

    value = float(loss.detach().float().mean()) if torch.is_tensor(loss) else loss
    if not math.isfinite(largest):
        return (f"the dummy that fills a deleted slot received a non-finite gradient ({largest}) at optimizer step "
                f"{step}, microbatch {mb} (loss {value:.6g}): the replayed model or loss holds NaN or infinity there "
                "(the run's hazards name where the recording became non-finite), so no deletion can be proven from "
                "this step on; stopped before the optimizer step")
    return (f"the dummy that fills a deleted slot received a non-zero gradient (largest |gradient| {largest:.3g} at its "
            f"input embeddings) at optimizer step {step}, microbatch {mb} (loss {value:.6g}): {loss_owner} gives tokens "
            "whose labels are -100 a weight (a term over every token, e.g. one that grows with the step), so this "
            "replay is not the run's counterfactual without the deleted rows; stopped before the optimizer step. "
            "Weight every term of the loss by the labels and record the run again")
