"""The standard approximate-unlearning baselines, each a config + trainer pair on :class:`UnlearningTrainer`.

They run a fixed budget (``num_train_epochs`` / ``max_steps``); the losses live in :mod:`hf_unlearn.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UnlearnError
from ..losses import (
    answer_token_mask,
    gradient_ascent_loss,
    npo_loss,
    rmu_forget_loss,
    rmu_retain_loss,
    sequence_logprob,
    simnpo_loss,
)
from .base import UnlearningConfig, UnlearningTrainer

# ---------------------------------------------------------------------------------------------- gradient ascent


@dataclass
class GradAscentConfig(UnlearningConfig):
    """Gradient ascent on the forget answers; no retain term by default."""

    retain_loss: str = field(default="none", metadata={"help": "Retain term ('none', 'ce' or 'kl')."})


class GradAscentTrainer(UnlearningTrainer):
    """Maximise the forget answers' cross-entropy (Jang et al., 2023)."""

    _config_class = GradAscentConfig
    method_name = "GradAscent"
    paper = "https://arxiv.org/abs/2210.01504"
    citation = """@inproceedings{jang2023knowledge,
  title={Knowledge Unlearning for Mitigating Privacy Risks in Language Models},
  author={Jang, Joel and Yoon, Dongkeun and Yang, Sohee and Cha, Sungmin and Lee, Moontae and Logeswaran, Lajanugen and Seo, Minjoon},
  booktitle={ACL}, year={2023}}"""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain)
        forget = gradient_ascent_loss(outputs.logits, inputs["labels"])
        loss = self.combine(forget, self.retain_term(retain, retain_out), {})
        return (loss, outputs) if return_outputs else loss


# ---------------------------------------------------------------------------------------------- gradient difference


@dataclass
class GradDiffConfig(UnlearningConfig):
    """Gradient difference: ascent on forget answers, descent (cross-entropy) on retain answers."""


class GradDiffTrainer(GradAscentTrainer):
    """Gradient ascent on the forget set plus cross-entropy on the retain set (Liu et al., 2022; TOFU baseline)."""

    _config_class = GradDiffConfig
    method_name = "GradDiff"
    paper = "https://arxiv.org/abs/2401.06121"
    citation = """@article{maini2024tofu,
  title={TOFU: A Task of Fictitious Unlearning for LLMs},
  author={Maini, Pratyush and Feng, Zhili and Schwarzschild, Avi and Lipton, Zachary C. and Kolter, J. Zico},
  journal={arXiv preprint arXiv:2401.06121}, year={2024}}"""


# ---------------------------------------------------------------------------------------------- NPO


@dataclass
class NPOConfig(UnlearningConfig):
    """Negative Preference Optimization; ``retain_loss='kl'`` gives NPO+KLR, ``'ce'`` NPO+RT."""

    beta: float = field(default=0.1, metadata={"help": "Inverse temperature of the NPO loss."})
    retain_loss: str = field(
        default="none", metadata={"help": "Retain term: 'none' (plain NPO), 'kl' (NPO+KLR) or 'ce' (NPO+RT)."}
    )

    _positive = ("beta",)


class NPOTrainer(UnlearningTrainer):
    """NPO (Zhang et al., 2024): a DPO-style loss with only a rejected answer, relative to the reference model."""

    _config_class = NPOConfig
    method_name = "NPO"
    paper = "https://arxiv.org/abs/2404.05868"
    citation = """@article{zhang2024negative,
  title={Negative Preference Optimization: From Catastrophic Collapse to Effective Unlearning},
  author={Zhang, Ruiqi and Lin, Licong and Bai, Yu and Mei, Song},
  journal={arXiv preprint arXiv:2404.05868}, year={2024}}"""

    @classmethod
    def _needs_reference(cls, args) -> bool:
        return True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain)
        policy = sequence_logprob(outputs.logits, inputs["labels"])
        ref = sequence_logprob(self.reference_outputs(inputs).logits, inputs["labels"])
        forget = npo_loss(policy, ref, self.args.beta)
        metrics = {"forget_log_ratio": (policy - ref).mean().detach()}
        loss = self.combine(forget, self.retain_term(retain, retain_out), metrics)
        return (loss, outputs) if return_outputs else loss

    @property
    def _method_label(self) -> str:
        return {"kl": "NPO+KLR", "ce": "NPO+RT"}.get(self.args.retain_loss, "NPO")

    def unlearning_card_info(self):
        info = super().unlearning_card_info()
        info["method"] = self._method_label
        return info


# ---------------------------------------------------------------------------------------------- SimNPO


@dataclass
class SimNPOConfig(UnlearningConfig):
    """SimNPO: reference-free, length-normalised NPO with a reward margin ``gamma``.

    The loss is ``-(2/beta) log sigmoid(beta * (mean answer NLL - gamma))`` (:func:`hf_unlearn.losses.simnpo_loss`):
    ``gamma`` inside the ``beta`` scaling, as the authors' code (``gamma``) and OpenUnlearning (``delta``) have it.
    OpenUnlearning's ``gamma`` is the forget-term weight, here ``lambda_forget``; its ``alpha`` is ``lambda_retain``.
    The authors' tuned TOFU forget10 setting (also OpenUnlearning's SimNPO default) is ``beta=4.5, gamma=0,
    lambda_forget=0.125`` with a cross-entropy retain term: the ``simnpo_tofu`` registry entry.
    """

    beta: float = field(default=2.5, metadata={"help": "Inverse temperature of the SimNPO loss."})
    gamma: float = field(
        default=0.0,
        metadata={"help": "Reward margin on the mean answer NLL, inside the beta scaling (OpenUnlearning's delta)."},
    )

    _positive = ("beta",)


class SimNPOTrainer(UnlearningTrainer):
    """SimNPO (Fan et al., 2024): NPO without a reference model, on the mean answer log-probability."""

    _config_class = SimNPOConfig
    method_name = "SimNPO"
    paper = "https://arxiv.org/abs/2410.07163"
    citation = """@article{fan2024simplicity,
  title={Simplicity Prevails: Rethinking Negative Preference Optimization for LLM Unlearning},
  author={Fan, Chongyu and Liu, Jiancheng and Lin, Licong and Jia, Jinghan and Zhang, Ruiqi and Mei, Song and Liu, Sijia},
  journal={arXiv preprint arXiv:2410.07163}, year={2024}}"""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain)
        avg = sequence_logprob(outputs.logits, inputs["labels"], average=True)
        forget = simnpo_loss(avg, self.args.beta, self.args.gamma)
        metrics = {"forget_avg_logprob": avg.mean().detach()}
        loss = self.combine(forget, self.retain_term(retain, retain_out), metrics)
        return (loss, outputs) if return_outputs else loss


# ---------------------------------------------------------------------------------------------- RMU


@dataclass
class RMUConfig(UnlearningConfig):
    """Representation Misdirection for Unlearning: steer one layer's activations on forget answers to a random vector.

    Both terms are averaged over **answer tokens** (labels != -100): per row the mean over its answer tokens of the
    mean squared difference over the hidden dimension, then the mean over rows. OpenUnlearning intends the same mean,
    but its code computes it right only at batch size 1 (``loss_reduction="open_unlearning"`` reproduces it). Trained
    weights (full fine-tuning): the MLPs (gate/up/down projections) of ``update_layers``, by default the steered layer
    and the two below it (WMDP's RMU trains only their ``down_proj``); ``trainable_parameters="all"`` trains every
    parameter, as OpenUnlearning's TOFU config does; with ``peft_config=`` the adapter trains instead. Defaults
    differ from OpenUnlearning's (layer 7, steering 2, retain weight 1): ``hf_unlearn.presets`` lists why, and
    ``training_preset("open-unlearning", "rmu")`` sets them.
    """

    layer_id: int | None = field(
        default=None, metadata={"help": "Decoder layer whose output is steered; None = the middle layer."}
    )
    update_layers: list[int] | None = field(
        default=None,
        metadata={"help": "Layers whose MLP weights train (full fine-tuning only); None = layer_id-2..layer_id."},
    )
    steering_coeff: float = field(default=6.5, metadata={"help": "Norm c of the control vector c*u."})
    trainable_parameters: str = field(
        default="mlp",
        metadata={"help": "'mlp' (the MLPs of update_layers, as WMDP) or 'all' (every parameter, OpenUnlearning's "
                          "TOFU config); full fine-tuning only.", "choices": ["mlp", "all"]},
    )
    loss_reduction: str = field(
        default="row_mean",
        metadata={"help": "'row_mean' (per row, the mean over its answer tokens; then over rows) or "
                          "'open_unlearning' (OpenUnlearning's broadcast mean(S) * mean(1/n), equal at batch size 1).",
                  "choices": ["row_mean", "open_unlearning"]},
    )
    retain_loss: str = field(
        default="ce",
        metadata={"help": "Unused by RMU (its retain term matches the frozen model's activations); 'none' drops it."},
    )
    lambda_retain: float = field(default=100.0, metadata={"help": "Weight of the activation-matching retain term."})

    def __post_init__(self):
        super().__post_init__()
        if self.trainable_parameters not in ("mlp", "all"):
            raise UnlearnError(f"trainable_parameters must be 'mlp' or 'all', got {self.trainable_parameters!r}")
        if self.loss_reduction not in ("row_mean", "open_unlearning"):
            raise UnlearnError(f"loss_reduction must be 'row_mean' or 'open_unlearning', got {self.loss_reduction!r}")


class RMUTrainer(UnlearningTrainer):
    """RMU (Li et al., 2024, WMDP): forget activations go to ``c*u``, retain activations stay the frozen model's.

    The steered activations are the output of decoder layer ``layer_id`` (``hidden_states[layer_id + 1]``) on answer
    tokens. Without PEFT only the MLPs of ``update_layers`` train (the rest of the model is frozen in place; the card
    lists the layers); with ``peft_config=`` the adapter trains. The control vector ``u`` is a seeded random unit
    vector (uniform [0, 1) entries, normalised, as WMDP and OpenUnlearning draw it).
    """

    _config_class = RMUConfig
    method_name = "RMU"
    paper = "https://arxiv.org/abs/2403.03218"
    citation = """@article{li2024wmdp,
  title={The WMDP Benchmark: Measuring and Reducing Malicious Use With Unlearning},
  author={Li, Nathaniel and Pan, Alexander and Gopal, Anjali and others},
  journal={arXiv preprint arXiv:2403.03218}, year={2024}}"""

    @classmethod
    def _needs_reference(cls, args) -> bool:
        return args.retain_loss != "none"

    def __init__(self, model=None, args=None, *pargs, **kwargs):
        super().__init__(model, args, *pargs, **kwargs)
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        n_layers = config.num_hidden_layers
        layer = self.args.layer_id if self.args.layer_id is not None else n_layers // 2
        if not 0 <= layer < n_layers:
            raise UnlearnError(f"layer_id must be in [0, {n_layers - 1}] for this model, got {layer}")
        self.layer_id = layer
        if not self.is_peft and self.args.trainable_parameters == "all":
            self.update_layers = "all"
        elif not self.is_peft:
            layers = self.args.update_layers or [i for i in range(layer - 2, layer + 1) if i >= 0]
            if any(not 0 <= i < n_layers for i in layers):
                raise UnlearnError(f"update_layers must be in [0, {n_layers - 1}], got {layers}")
            patterns = tuple(f"layers.{i}.mlp." for i in layers) + tuple(f"h.{i}.mlp." for i in layers)
            trainable = 0
            for name, p in self.model.named_parameters():
                p.requires_grad_(any(s in name for s in patterns))
                trainable += p.requires_grad
            if trainable == 0:
                raise UnlearnError(f"no MLP parameters found for layers {layers}; use peft_config= for this model")
            self.update_layers = layers
        gen = torch.Generator().manual_seed(int(self.args.seed))
        u = torch.rand(config.hidden_size, generator=gen)
        self.control_vector = (self.args.steering_coeff * u / u.norm()).to(self.args.device)

    def _hidden(self, outputs) -> torch.Tensor:
        return outputs.hidden_states[self.layer_id + 1]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain, output_hidden_states=True)
        reduction = self.args.loss_reduction
        forget = rmu_forget_loss(self._hidden(outputs), self.control_vector, answer_token_mask(inputs["labels"]),
                                 reduction)
        retain_loss = None
        if retain is not None:
            ref_hidden = self._hidden(self.reference_outputs(retain, output_hidden_states=True))
            retain_loss = rmu_retain_loss(self._hidden(retain_out), ref_hidden, answer_token_mask(retain["labels"]),
                                          reduction)
        loss = self.combine(forget, retain_loss, {})
        return (loss, outputs) if return_outputs else loss

    def method_hyperparameters(self):
        hp = super().method_hyperparameters()
        hp["layer_id"] = self.layer_id
        if not self.is_peft:
            hp["update_layers"] = self.update_layers if self.update_layers == "all" else list(self.update_layers)
        hp.pop("retain_loss", None)
        return hp
