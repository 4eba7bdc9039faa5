"""A trainer whose loss gives deleted slots' dummies weight only later in training (issue #31); importable, since
replays rebuild the recorded trainer by name; no tests here."""

from __future__ import annotations

from transformers import Trainer


class GrowingEveryTokenTrainer(Trainer):
    """``CE / num_items + 0.05 * state.global_step * (logits ** 2).mean()`` over every token, labels or not: zero at
    step 0, so the recorder's construction probe (global step 0) passes it; from step 1 on a dummy row has weight."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss + 0.05 * self.state.global_step * (outputs.logits ** 2).mean()
        return (loss, outputs) if return_outputs else loss
