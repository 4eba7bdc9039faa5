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


WORD = 406  # the tests' tiny tokenizer's " crime": in some TOFU rows, not in the shortest one (the probe's row)


class InputWeightedTrainer(Trainer):
    """The loss scaled by how often ``WORD`` occurs in the microbatch's inputs (prompt and answer, labelled or not):
    a deleted row that holds the word still scales its neighbours' loss in the counterfactual (its tokens kept, its
    labels ignored), while a dummy in its place does not."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        loss = loss * (1.0 + 0.25 * (inputs["input_ids"] == WORD).sum())
        return (loss, out[1]) if return_outputs else loss


try:
    from trl import DPOTrainer
except ImportError:  # pragma: no cover - trl is an extra
    DPOTrainer = None

if DPOTrainer is not None:
    class EveryTokenDPOTrainer(DPOTrainer):
        """DPO's loss ``+ 1e-3 * ((input embeddings - 1) ** 2).mean()`` over every token from the start: the recorder's
        construction probe refuses it."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss + 1e-3 * ((model.get_input_embeddings()(inputs["input_ids"]) - 1) ** 2).mean()

    class InputWeightedDPOTrainer(DPOTrainer):
        """DPO's loss scaled, from optimizer step 1 on, by how often ``word`` occurs in the microbatch's collated
        inputs (every pair's rows, completion or not); step 0 as DPO, so the construction probe passes. A deleted
        pair's tokens still scale it in the counterfactual (its completion mask zeroed); a dummy pair's do not."""

        word = WORD

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            loss = loss * (1.0 + 0.25 * (self.state.global_step > 0) * (inputs["input_ids"] == self.word).sum())
            return (loss, out[1]) if return_outputs else loss

    class GrowingEveryTokenDPOTrainer(DPOTrainer):
        """DPO's loss ``+ 1e-3 * state.global_step * ((input embeddings - 1) ** 2).mean()`` over every token of both rows of
        every pair, completion or not: zero at step 0 (the construction probe passes), from step 1 on a deleted pair's
        dummy has weight."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            return loss + 1e-3 * self.state.global_step * ((embeds - 1) ** 2).mean()  # the pad embedding is 0
