"""Unlearning by cross-entropy against an adjusted target distribution: UNDIAL and CE-U.

Both replace gradient ascent's unbounded objective by a bounded one: the model is fitted, token by token, to a
distribution that no longer favours the answer token. UNDIAL takes the reference model's distribution with the
target's logit lowered by ``beta``; CE-U takes the model's own distribution with the target removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses import ce_u_loss, mask_first_answer_tokens, undial_loss
from .base import UnlearningConfig, UnlearningTrainer

# ---------------------------------------------------------------------------------------------- UNDIAL


@dataclass
class UNDIALConfig(UnlearningConfig):
    """UNDIAL: self-distillation with the answer token's logit lowered by ``beta``; no retain term by default."""

    beta: float = field(
        default=10.0,
        metadata={"help": "Strength of the penalty on the answer token's reference logit (the paper's gamma; "
                          "OpenUnlearning: 10, searched over 3/10/30)."},
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (the paper's 1e-4)."})
    retain_loss: str = field(
        default="none",
        metadata={"help": "Retain term: 'none' (the paper and OpenUnlearning), 'ce' or 'kl'."},
    )

    _non_negative = ("beta",)


class UNDIALTrainer(UnlearningTrainer):
    """UNDIAL (Dong et al., NAACL 2025): distil the reference model into the current one with the answer's logit
    lowered, so only the information to forget moves (:func:`hf_unlearn.losses.undial_loss`).

    The reference (teacher) is the model before unlearning: the PEFT base with the adapter disabled, or a frozen copy.
    """

    _config_class = UNDIALConfig
    method_name = "UNDIAL"
    paper = "https://arxiv.org/abs/2402.10052"
    citation = """@inproceedings{dong2025undial,
  title={UNDIAL: Self-Distillation with Adjusted Logits for Robust Unlearning in Large Language Models},
  author={Dong, Yijiang River and Lin, Hongzhou and Belkin, Mikhail and Huerta, Ramon and Vuli{\\'c}, Ivan},
  booktitle={NAACL}, year={2025}}"""

    @classmethod
    def _needs_reference(cls, args) -> bool:
        return True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        def forget(outputs, batch):
            return undial_loss(outputs.logits, self.reference_outputs(batch).logits, batch["labels"], self.args.beta)

        return self.forget_retain_loss(model, inputs, forget, return_outputs)


# ---------------------------------------------------------------------------------------------- CE-U


@dataclass
class CEUConfig(UnlearningConfig):
    """CE-U: cross-entropy against the model's own distribution without the answer token; no retain term by default."""

    skip_first: int = field(
        default=1,
        metadata={"help": "Leave the first N answer tokens of every row out of the loss (the paper's footnote; "
                          "OpenUnlearning: 1)."},
    )
    retain_loss: str = field(
        default="none",
        metadata={"help": "Retain term: 'none' (the paper and OpenUnlearning), 'ce' or 'kl'."},
    )

    _non_negative = ("skip_first",)


class CEUTrainer(UnlearningTrainer):
    """CE-U (Yang et al., 2025): cross-entropy unlearning (:func:`hf_unlearn.losses.ce_u_loss`), a bounded
    replacement for gradient ascent whose gradient is ``p - q`` with ``q`` the model's distribution minus the target.

    Rows whose answer is at most ``skip_first`` tokens long contribute nothing.
    """

    _config_class = CEUConfig
    method_name = "CE-U"
    paper = "https://arxiv.org/abs/2503.01224"
    citation = """@article{yang2025ceu,
  title={CE-U: Cross Entropy Unlearning},
  author={Yang, Bo},
  journal={arXiv preprint arXiv:2503.01224}, year={2025}}"""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        def forget(outputs, batch):
            return ce_u_loss(outputs.logits, mask_first_answer_tokens(batch["labels"], self.args.skip_first))

        return self.forget_retain_loss(model, inputs, forget, return_outputs)
