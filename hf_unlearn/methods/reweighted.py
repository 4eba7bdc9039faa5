"""Token-reweighted gradient ascent: WGA and SatImp.

Plain gradient ascent pushes every answer token down with the same force, forever; these methods weight each token's
ascent by functions of its current probability (detached), so the push fades on tokens that are already forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnlearnError
from ..losses import satimp_loss, wga_loss
from .base import UnlearningConfig, UnlearningTrainer


class _ReweightedAscentTrainer(UnlearningTrainer):
    """The shared forget/retain loop; each method's class defines ``forget_term(logits, labels)``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.forget_retain_loss(model, inputs, lambda out, batch: self.forget_term(out.logits, batch["labels"]),
                                       return_outputs)


@dataclass
class WGAConfig(UnlearningConfig):
    """WGA: gradient ascent weighted by ``p(y_t)^beta``; retain cross-entropy with weight 1 (OpenUnlearning)."""

    beta: float = field(default=1.0, metadata={"help": "Exponent of the token weight p^beta (the paper's 1.0)."})

    _non_negative = ("beta",)


class WGATrainer(_ReweightedAscentTrainer):
    """Weighted gradient ascent (Wang et al., ICLR 2025; :func:`hf_unlearn.losses.wga_loss`)."""

    _config_class = WGAConfig
    method_name = "WGA"
    paper = "https://arxiv.org/abs/2502.19301"
    citation = """@inproceedings{wang2025rethinking,
  title={Rethinking LLM Unlearning Objectives: A Gradient Perspective and Go Beyond},
  author={Wang, Qizhou and Zhou, Jin Peng and Zhou, Zhanke and Shin, Saebyeol and Han, Bo and Weinberger, Kilian Q.},
  booktitle={ICLR}, year={2025}}"""

    def forget_term(self, logits, labels):
        return wga_loss(logits, labels, self.args.beta)


@dataclass
class SatImpConfig(UnlearningConfig):
    """SatImp: gradient ascent weighted by ``p^beta1 * (1-p)^beta2``; forget:retain weights 10:1 (the paper)."""

    beta1: float = field(default=5.0, metadata={"help": "Saturation exponent: weight p^beta1 (the paper's 5.0)."})
    beta2: float = field(default=1.0, metadata={"help": "Importance exponent: weight (1-p)^beta2 (the paper's 1.0)."})
    lambda_retain: float = field(
        default=0.1,
        metadata={"help": "Weight of the retain term (the paper's forget:retain ratio of 10 with lambda_forget=1)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.beta1 < 0 or self.beta2 < 0:
            raise UnlearnError(f"beta1 and beta2 must be >= 0, got {self.beta1}, {self.beta2}")


class SatImpTrainer(_ReweightedAscentTrainer):
    """SatImp (Yang et al., ICML 2025; :func:`hf_unlearn.losses.satimp_loss`): saturation x importance reweighting.

    Weights follow OpenUnlearning's SatImp README and code defaults (forget 1, retain 0.1: the ratio of 10 the paper
    uses; its TOFU config file has them the other way round, forget 0.1 and retain 1).
    """

    _config_class = SatImpConfig
    method_name = "SatImp"
    paper = "https://arxiv.org/abs/2505.11953"
    citation = """@inproceedings{yang2025exploring,
  title={Exploring Criteria of Loss Reweighting to Enhance LLM Unlearning},
  author={Yang, Puning and Wang, Qizhou and Huang, Zhuo and Liu, Tongliang and Zhang, Chengqi and Han, Bo},
  booktitle={ICML}, year={2025}}"""

    def forget_term(self, logits, labels):
        return satimp_loss(logits, labels, self.args.beta1, self.args.beta2)
