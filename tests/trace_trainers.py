"""Trainer subclasses with their own loss, importable (replays rebuild them by name); no tests here."""

from __future__ import annotations

from transformers import Trainer


class L2Trainer(Trainer):
    """A user's Trainer with its own loss: the token loss plus ``l2`` times the squared norm of the trained weights,
    and a JSON constructor argument a replay must get back."""

    def __init__(self, *args, l2: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.l2 = l2

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss + self.l2 * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)
        return (loss, outputs) if return_outputs else loss


class EveryTokenTrainer(Trainer):
    """A loss with a term on every token, labels or not (a penalty on the hidden states): a deleted slot's dummy
    row would carry weight, so recording it is refused."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, {**inputs, "output_hidden_states": True}, True, num_items_in_batch)
        loss = loss + 1e-3 * outputs.hidden_states[1].mean()  # the residual stream after the first layer
        return (loss, outputs) if return_outputs else loss


class CountingLoss(Trainer):
    """A loss that counts its calls (the steps it saw, and a list edited in place): a probe that ran it once more
    than training did would shift an edit keyed to the count by one microbatch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls = getattr(self, "calls", 0) + 1
        self.seen = getattr(self, "seen", []) + [self.state.global_step]
        self.log_ = getattr(self, "log_", [])
        self.log_.append(self.calls)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class EditAtStep3(Trainer):
    """Halves the first layer's MLP weights under no_grad inside its own compute_loss, once, at optimizer step 3: an
    edit the recording's guards see outside the record, which a replay (running this compute_loss) makes too."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        import torch

        if self.state.global_step == 3 and getattr(self, "edited_at", None) != 3:
            self.edited_at = 3
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "layers.0.mlp" in name:
                        p.mul_(0.5)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
