"""MASC (margin self-correction): unlearning that stops by itself.

The forget term lowers the restricted margin ``m = beta*z(y_t) - logsumexp_{top-k non-target}(beta*z(v))`` of each
active forget-answer token below ``tau - eta`` (``tau = log(rho/(1-rho))``); the retain term keeps the model close
to the original (``KL(p_0 || p_theta)`` or cross-entropy). Training stops at the first check where the share of
still-dominant tokens (``m > tau``), averaged over forget examples, is at most ``alpha``.

Which rows certify what (:class:`MASCStoppingCallback`):

* the **monitored rows** are the held-out forget rows when there are any (``validation_fraction`` or
  ``eval_forget_dataset=``: never trained on, so a stop says forgetting reached rows the optimiser never saw, as in
  the paper), else the forget rows the model trains on (a stop then says those rows are below ``alpha``);
* the **probe** (every ``probe_steps`` steps) is ``probe_size`` monitored rows drawn from a stream independent of the
  training shuffle, or, with ``probe_size=0``, the violation rate the training forward measured on the forget batches
  since the last check (no extra forward). The probe only decides whether to pay for a confirmation;
* the **confirmation** runs on the other monitored rows (all of them when ``probe_size=0``): disjoint from the probe
  rows, it alone decides the stop. With ``hoeffding_delta`` the decision uses a one-sided Hoeffding upper bound whose
  error level is split over the checks (the ``i``-th scheduled check spends ``delta * 6/(pi^2 i^2)``), so the bound
  holds at the stop with probability ``1 - delta`` however many checks ran. On held-out rows that are a random draw of
  the forget set it bounds the expected violation rate of a forget row the model never trained on; on trained rows it
  only adds a margin to a rate that was measured exactly;
* at the step cap a final confirmation runs; if it fails, ``stopped_step`` is ``None``, the trainer warns, and
  ``masc_stopping.json`` gives the reason.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import UnlearnError
from ..hub.leaks import own_numbers
from ..losses import (
    hoeffding_upper_bound,
    masc_active_mask,
    masc_forget_loss,
    masc_margin,
    masc_threshold,
    masc_violation_rates,
    union_bound_delta,
)
from ..utils import atomic_write_text
from .base import UnlearningConfig, UnlearningTrainer, independent_generator

logger = logging.getLogger(__name__)

STOPPING_JSON = "masc_stopping.json"
STOPPING_PLOT = "masc_violation_curve.png"
DEFAULT_PROBE_SIZE = 8  # probe rows when the rule monitors the trained forget rows (at most half of them)


@dataclass
class MASCConfig(UnlearningConfig):
    r"""Configuration of :class:`MASCTrainer` (only MASC's own fields; the rest is ``TrainingArguments``).

    ``num_train_epochs`` / ``max_steps`` are an upper budget: training normally ends earlier, when the stopping rule
    fires. Defaults that differ from ``TrainingArguments``: ``lr_scheduler_type="constant"`` (a linear decay to zero at
    the budget cap would slow the very steps the stopping rule is waiting for, and tie the result to a cap MASC is
    not meant to reach) and ``restore_callback_states_from_checkpoint=True``, so the stopping rule's state (violation
    curve, stop step) survives ``train(resume_from_checkpoint=...)``.
    """

    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Learning-rate schedule; constant by default because MASC stops itself before its cap."},
    )

    restore_callback_states_from_checkpoint: bool = field(
        default=True,
        metadata={"help": "Restore callback states (MASC's violation curve and stop step) when resuming."},
    )
    k: int = field(default=10, metadata={"help": "Number of top non-target competitor tokens in the margin."})
    beta: float = field(default=1.0, metadata={"help": "Temperature multiplying the logits inside the margin."})
    rho: float = field(
        default=0.5,
        metadata={"help": "Dominance level in (0, 1): a token is still 'dominant' while its restricted probability "
                          "sigmoid(m) exceeds rho, i.e. m > tau = log(rho/(1-rho))."},
    )
    eta: float = field(default=1.0, metadata={"help": "Buffer of the hinge relu(m - (tau - eta)) / eta (> 0)."})
    competitors: str = field(
        default="current",
        metadata={"help": "Where the top-k competitors are chosen: 'current' (the model being trained) or "
                          "'reference' (the original model).", "choices": ["current", "reference"]},
    )
    active_tokens: str = field(
        default="suffix",
        metadata={"help": "Which answer tokens are active: 'suffix' (the last suffix_fraction of each answer) or "
                          "'all'.", "choices": ["suffix", "all"]},
    )
    suffix_fraction: float = field(default=0.5, metadata={"help": "Share of each answer kept by the suffix rule."})
    skip_first: int = field(default=0, metadata={"help": "Answer tokens never active at the start of each answer."})
    retain_loss: str = field(
        default="kl", metadata={"help": "Retain term: 'kl' (KL(p_0 || p_theta)), 'ce' or 'none'."}
    )
    alpha: float = field(
        default=0.2, metadata={"help": "Stop when the violation rate on forget examples is <= alpha, in (0, 1)."}
    )
    probe_steps: int = field(default=5, metadata={"help": "Run the cheap probe every this many optimizer steps."})
    probe_size: int | None = field(
        default=None,
        metadata={"help": "Monitored forget rows in the cheap probe (drawn independently of the training shuffle; "
                          "the confirmation uses the others). 0: the probe is the violation rate the training "
                          "forward already measured on the forget batches since the last check (no extra forward; "
                          "slightly stale, so it errs on the late side); the confirmation then covers every "
                          "monitored row. None (default): 0 when the monitored rows are held out (a small set, kept "
                          "whole for the confirmation), else 8 (at most half the forget rows)."},
    )
    hoeffding_delta: float | None = field(
        default=None,
        metadata={"help": "If set, stop only when the one-sided Hoeffding upper bound of the confirmed violation rate "
                          "is <= alpha; the error level delta is split over the checks (union bound), so the bound "
                          "holds at the stop with probability 1-delta."},
    )
    save_violation_curve: bool = field(
        default=True, metadata={"help": f"Write {STOPPING_JSON} and {STOPPING_PLOT} to output_dir at the end."}
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("alpha", "rho"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise UnlearnError(f"{name} must lie strictly between 0 and 1, got {value}")
        if self.eta <= 0:
            raise UnlearnError(f"eta must be > 0, got {self.eta}")
        if self.k < 1:
            raise UnlearnError(f"k must be >= 1, got {self.k}")
        if self.competitors not in ("current", "reference"):
            raise UnlearnError(f"competitors must be 'current' or 'reference', got {self.competitors!r}")
        if self.active_tokens not in ("suffix", "all"):
            raise UnlearnError(f"active_tokens must be 'suffix' or 'all', got {self.active_tokens!r}")
        if not 0.0 < self.suffix_fraction <= 1.0:
            raise UnlearnError(f"suffix_fraction must lie in (0, 1], got {self.suffix_fraction}")
        if self.probe_steps < 1 or (self.probe_size is not None and self.probe_size < 0):
            raise UnlearnError("probe_steps must be >= 1 and probe_size >= 0 (0 = probe on the training batches)")
        if self.hoeffding_delta is not None and not 0.0 < self.hoeffding_delta < 1.0:
            raise UnlearnError(f"hoeffding_delta must lie in (0, 1), got {self.hoeffding_delta}")


def _rate_totals(rates: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[sum of the valid examples' violation rates, number of valid examples]``, summable across batches."""
    return torch.stack([rates[valid].sum(), valid.sum().float()])


class MASCStoppingCallback(TrainerCallback, ExportableState):
    """MASC's online stopping rule, shaped like ``EarlyStoppingCallback`` (its state survives checkpoint/resume).

    Every ``probe_steps`` optimizer steps it asks the trainer for the violation rate on the probe rows; when that is
    at most ``alpha`` it asks for the rate on the confirmation rows (disjoint from the probe rows, so the estimate is
    not biased by having triggered the check) and stops training if that rate, or its Hoeffding upper bound when
    ``hoeffding_delta`` is set (level split over the checks, see the module docstring), is at most ``alpha``. At the
    step cap it confirms once more whatever the schedule. The rates are sums reduced across processes, so every
    process takes the same decision. ``history`` is the violation curve; ``stopped_step`` the step the rule fired at
    (``None`` if it never did: ``stop_reason`` says why).
    """

    def __init__(self, alpha: float = 0.2, probe_steps: int = 5, hoeffding_delta: float | None = None,
                 save_curve: bool = True):
        self.alpha = alpha
        self.probe_steps = probe_steps
        self.hoeffding_delta = hoeffding_delta
        self.save_curve = save_curve
        self.history: list[dict[str, Any]] = []
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None
        self.trainer = None

    def bind(self, trainer) -> MASCStoppingCallback:
        """Attach the trainer that measures violation rates (re-done after a resume re-creates the callback)."""
        self.trainer = trainer
        return self

    def state(self) -> dict:
        return {
            "args": {"alpha": self.alpha, "probe_steps": self.probe_steps, "hoeffding_delta": self.hoeffding_delta,
                     "save_curve": self.save_curve},
            "attributes": {"history": list(self.history), "stopped_step": self.stopped_step,
                           "stop_reason": self.stop_reason},
        }

    def _confirm(self, step: int) -> tuple[float, float, int]:
        rate, n = self.trainer.violation_rate("confirm")
        entry = {"step": step, "kind": "confirm", "violation_rate": rate, "upper_bound": rate, "n": n}
        if self.hoeffding_delta:
            check = -(-step // self.probe_steps)  # the scheduled check this step belongs to (the cap: the next one)
            entry["delta"] = union_bound_delta(self.hoeffding_delta, check)
            entry["upper_bound"] = hoeffding_upper_bound(rate, n, entry["delta"])
        self.history.append(entry)
        return rate, entry["upper_bound"], n

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_step is not None:  # resumed from a checkpoint taken after the stop
            control.should_training_stop = True
            return control
        step = state.global_step
        at_cap = bool(state.max_steps) and step >= state.max_steps
        if step % self.probe_steps != 0 and not at_cap:
            return control
        if self.trainer is None:
            raise UnlearnError("MASCStoppingCallback is not bound to a trainer; MASCTrainer adds it for you")
        metrics = {}
        if not at_cap:  # at the cap there is no later check to save: confirm directly
            rate, n = self.trainer.violation_rate("probe")
            self.history.append({"step": step, "kind": "probe", "violation_rate": rate, "n": n})
            metrics["probe_violation_rate"] = rate
        if at_cap or rate <= self.alpha:
            rate, bound, n = self._confirm(step)
            metrics["confirm_violation_rate"] = rate
            if bound <= self.alpha:
                self.stopped_step = step
                self.stop_reason = (f"violation rate {rate:.4f}" + (f" (upper bound {bound:.4f})" if bound != rate else "")
                                    + f" <= alpha {self.alpha:g} on {n} confirmation rows at step {step}")
                control.should_training_stop = True
                logger.info("MASC stopped: %s", self.stop_reason)
            elif at_cap:
                self.stop_reason = (f"step cap {step} reached before the rule fired: the final confirmation measured "
                                    f"{rate:.4f}" + (f" (upper bound {bound:.4f})" if bound != rate else "")
                                    + f" > alpha {self.alpha:g} on {n} rows")
        self.trainer.record_metrics(metrics)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.stopped_step is None:
            if self.stop_reason is None:  # neither the rule nor the cap: another callback ended training
                self.stop_reason = (f"training ended at step {state.global_step}, before the step cap "
                                    f"{state.max_steps} and before the rule fired (another callback stopped it)")
            logger.warning("MASC did not stop by its rule: %s. The model may not be unlearned to alpha=%g; raise the "
                           "budget (max_steps/num_train_epochs) or the learning rate.", self.stop_reason, self.alpha)
        if self.save_curve and state.is_world_process_zero:
            extra = {"reason": self.stop_reason, "max_steps": state.max_steps, "global_step": state.global_step,
                     "hoeffding_delta": self.hoeffding_delta}
            if self.trainer is not None and hasattr(self.trainer, "certified_rows"):
                extra["certified_rows"] = self.trainer.certified_rows
            save_stopping_report(args.output_dir, self.alpha, self.stopped_step, self.history, extra)
        return control


def save_stopping_report(output_dir, alpha: float, stopped_step: int | None, history: list[dict],
                         extra: dict[str, Any] | None = None) -> Path:
    """Write the stop step, why, and the violation curve as JSON (atomically) and, if matplotlib is there, a plot."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"alpha": alpha, "stopped": stopped_step is not None, "stopped_step": stopped_step, **(extra or {}),
              "history": history}
    path = out / STOPPING_JSON
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is an optional extra
        logger.warning("matplotlib is not installed; %s not written", STOPPING_PLOT)
        return path
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, style in (("probe", "o-"), ("confirm", "s")):
        pts = [(h["step"], h["violation_rate"]) for h in history if h["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{kind} violation rate")
    ax.axhline(alpha, color="gray", linestyle="--", label=f"alpha = {alpha:g}")
    if stopped_step is not None:
        ax.axvline(stopped_step, color="red", linestyle=":", label=f"stopped at step {stopped_step}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("violation rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / STOPPING_PLOT, dpi=100)
    plt.close(fig)
    return path


class MASCTrainer(UnlearningTrainer):
    """Margin self-correction unlearning with an online stopping rule (Di Gennaro, Shevchenko, Yang, 2026).

    Takes everything :class:`UnlearningTrainer` takes; the stopping rule monitors the held-out forget rows
    (``eval_forget_dataset=`` or ``args.validation_fraction``) when there are any, else the trained forget rows (see
    the module docstring for which rows certify what). ``probe_dataset`` and ``confirm_dataset`` are the two disjoint
    parts of the monitored rows; ``certified_rows`` says which kind they are.
    """

    _config_class = MASCConfig
    method_name = "MASC"
    paper = "https://arxiv.org/abs/2606.02920"
    citation = """@article{digennaro2026masc,
  title={Fast Unlearning at Scale via Margin Self-Correction},
  author={Di Gennaro, Federico and Shevchenko, Alexander and Yang, Fanny},
  journal={arXiv preprint arXiv:2606.02920}, year={2026}}"""

    @classmethod
    def _needs_reference(cls, args) -> bool:
        return args.retain_loss == "kl" or args.competitors == "reference"

    def __init__(self, model=None, args: MASCConfig | None = None, forget_dataset=None, retain_dataset=None,
                 *pargs, confirm_dataset=None, **kwargs):
        if confirm_dataset is not None:
            raise UnlearnError("confirm_dataset= is now eval_forget_dataset=: held-out forget rows that the probe and "
                               "the confirmation share (disjointly) and that are never trained on")
        super().__init__(model, args, forget_dataset, retain_dataset, *pargs, **kwargs)
        self.tau = masc_threshold(self.args.rho)
        held_out = self.eval_forget_dataset is not None
        monitored = self.eval_forget_dataset if held_out else self.train_dataset
        self.certified_rows = "held-out" if held_out else "trained"
        size = self.args.probe_size
        if size is None:
            size = 0 if held_out else min(DEFAULT_PROBE_SIZE, len(monitored) // 2)
        self.probe_size = size
        if size >= len(monitored):
            raise UnlearnError(
                f"probe_size={size} leaves no confirmation rows among the {len(monitored)} {self.certified_rows} "
                "forget rows the stopping rule monitors; lower probe_size (0 = probe on the training batches) "
                + ("or hold out more rows" if held_out else "or pass more forget rows")
            )
        # drawn from its own stream: the Trainer shuffles with args.seed, so a probe drawn with that seed would be
        # exactly the first rows trained on
        perm = torch.randperm(len(monitored), generator=independent_generator(self.args.seed, "masc-probe")).tolist()
        self.probe_dataset = monitored.select(sorted(perm[:size])) if size else None
        self.confirm_dataset = monitored.select(sorted(perm[size:])) if size else monitored
        # (sum of per-example violation rates, examples) seen by the training forward since the last probe
        self._batch_rates = torch.zeros(2, device=self.args.device)
        self.stopping_callback = MASCStoppingCallback(
            self.args.alpha, self.args.probe_steps, self.args.hoeffding_delta, self.args.save_violation_curve
        ).bind(self)
        self.add_callback(self.stopping_callback)

    def _load_callback_state(self):
        """Resume re-creates the stopping callback from its state (the base binds it); keep pointing at it."""
        super()._load_callback_state()
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, MASCStoppingCallback):
                self.stopping_callback = cb

    # ------------------------------------------------------------------ the loss

    def _margins(self, batch, outputs) -> tuple[torch.Tensor, torch.Tensor]:
        competitors = None
        if self.args.competitors == "reference":
            competitors = self.reference_outputs(batch).logits
        margin, mask = masc_margin(outputs.logits, batch["labels"], self.args.k, self.args.beta, competitors)
        active = masc_active_mask(mask, self.args.active_tokens, self.args.suffix_fraction, self.args.skip_first)
        return margin, active

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain)
        margin, active = self._margins(inputs, outputs)
        forget = masc_forget_loss(margin, active, self.tau, self.args.eta)
        rates, valid = masc_violation_rates(margin.detach(), active, self.tau)
        if model.training and self.probe_dataset is None:  # the probe reads these (probe_size=0)
            self._batch_rates += _rate_totals(rates, valid).to(self._batch_rates.device)
        metrics = {
            "batch_violation_rate": rates[valid].mean() if bool(valid.any()) else 0.0,
            "mean_margin": (margin.detach() * active).sum() / active.sum().clamp(min=1),
        }
        loss = self.combine(forget, self.retain_term(retain, retain_out), metrics)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ the stopping rule's measurement

    @torch.no_grad()
    def violation_rate(self, which: str = "confirm") -> tuple[float, int]:
        """Violation rate of the current model on the probe or confirmation rows: ``(rate, n_examples)``.

        Each process scores its share of the rows; the sums are reduced across processes, so the result (and the
        stopping decision) is the same everywhere. With ``probe_size=0`` the probe is the rate measured by the
        training forward on the forget batches since the last probe (``(0.0, 0)`` if none, e.g. just after a resume:
        the confirmation then decides).
        """
        if which == "probe" and self.probe_dataset is None:
            totals, self._batch_rates = self._batch_rates, torch.zeros_like(self._batch_rates)
            return self._reduced_rate(totals)
        dataset = {"probe": self.probe_dataset, "confirm": self.confirm_dataset}[which]
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        mine = list(range(rank, len(dataset), world))
        bs = self.args.per_device_eval_batch_size
        model = self.model
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, device=self.args.device)
        try:
            for start in range(0, len(mine), bs):
                batch = self._prepare_inputs(self.data_collator([dataset[i] for i in mine[start:start + bs]]))
                margin, active = self._margins(batch, model(**self._model_inputs(batch)))
                rates, valid = masc_violation_rates(margin, active, self.tau)
                totals += _rate_totals(rates, valid)
        finally:
            model.train(was_training)
        return self._reduced_rate(totals)

    def _reduced_rate(self, totals: torch.Tensor) -> tuple[float, int]:
        """``(sum of per-example rates, examples)`` summed over processes -> ``(mean rate, examples)``."""
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        n = int(totals[1].item())
        return float(totals[0].item()) / max(n, 1), n

    # ------------------------------------------------------------------ results

    @property
    def stopped_step(self) -> int | None:
        return self.stopping_callback.stopped_step

    @property
    def violation_history(self) -> list[dict[str, Any]]:
        return self.stopping_callback.history

    @property
    def stop_reason(self) -> str | None:
        return self.stopping_callback.stop_reason

    def unlearning_card_info(self) -> dict[str, Any]:
        info = super().unlearning_card_info()
        confirms = [h for h in self.violation_history if h["kind"] == "confirm"]
        own = {
            "tau": self.tau,
            "stopped_by_rule": self.stopped_step is not None,
            "stopped_step": self.stopped_step,
            "certified_rows": self.certified_rows,
            "probe_size": self.probe_size,
            "num_confirmation_rows": len(self.confirm_dataset),
            "num_probes": sum(h["kind"] == "probe" for h in self.violation_history),
        }
        info["extra"].update({**own, "stop_reason": self.stop_reason})
        info["not_ids"].update(own_numbers(own, "extra"))
        if self.stop_reason:  # a sentence built from its own rates, steps and row counts ("0.0000 ... at step 5")
            info["not_ids"]["extra.stop_reason"] = sorted({int(n) for n in re.findall(r"\d+", self.stop_reason)})
        if confirms:
            info["evaluation"] = {"masc_violation_rate": confirms[-1]["violation_rate"]}
            info["not_ids"].update(own_numbers(info["evaluation"], "evaluation"))  # a rate of 0.0 is not id 0
        return info
