"""Stop any unlearning trainer when its held-out forget rows reach a target, and keep that checkpoint.

MASC stops by its own rule; every other method runs a fixed budget and leaves the user to guess when forgetting is
enough. :class:`UnlearningStoppingCallback` gives every trainer the same kind of stop: every ``eval_steps`` optimizer
steps (and once at the step cap) it measures one forget metric on **held-out forget rows** (the trainer's
``eval_forget_dataset`` / ``validation_fraction`` rows, never trained on, or rows you pass) and, once the target is
reached, stops training (``mode="stop"``) or only records the step, the elapsed time and a checkpoint there and lets
training run on (``mode="monitor"``: one run then yields both the early-stopped and the fixed-budget model, since
training is deterministic and the checks change nothing). Until the target is reached the best checkpoint so far is
kept, so a run that never reaches it still leaves its best model.

```python
stop = UnlearningStoppingCallback("violation_rate", target=0.2, eval_steps=2)
args = NPOConfig(output_dir="out", validation_fraction=0.2, num_train_epochs=5)
trainer = NPOTrainer(model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok,
                     callbacks=[stop])    # an UnlearningTrainer binds it: held-out rows, collator, logging
trainer.train()                           # stops at the first check with violation rate <= 0.2
stop.reached_step, stop.best_model_path   # the step, and out/stopping_checkpoint/ (model, tokenizer, scores)
```

Metrics (``TARGET_METRICS``):

* ``violation_rate`` (lower is more forgotten): MASC's, per row the share of active answer tokens whose restricted
  margin exceeds ``tau = log(rho/(1-rho))``, averaged over rows; the same ``k``, ``beta``, ``rho`` and active-token
  rule as :class:`~hf_unlearn.methods.masc.MASCConfig` (defaults equal);
* ``forget_probability`` (lower): TOFU's probability, ``exp(-mean answer NLL)`` averaged over rows;
* ``truth_ratio`` (higher): TOFU's forget truth ratio ``mean(min(TR, 1/TR))``; it needs paraphrased and perturbed
  answers: the rows' own ``paraphrased_answer``/``perturbed_answer`` columns, else TOFU's by id (ids 0-399 and
  3600-3999 have them).

Every process scores every held-out row itself (the set is small; identical weights give identical scores), so every
process takes the same decision.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from transformers.utils import logging

from ..errors import UnlearnError
from .callback import UnlearningEvalCallback
from .result import EvalResult

logger = logging.get_logger(__name__)

# metric -> True when higher means more forgotten
TARGET_METRICS = {"violation_rate": False, "forget_probability": False, "truth_ratio": True}
MODES = ("stop", "monitor")


def _clocks() -> tuple[float, float]:
    """(wall clock, this process's CPU time): on a shared machine the CPU time is the steadier measure."""
    return time.perf_counter(), time.process_time()


class StoppingScores(EvalResult):
    """The forget metric of one check on the held-out rows (``summary``: the metric and ``rows``)."""

    kind = "forget_target"


def _tokenised(rows, tokenizer, max_length: int, id_column: str):
    if "input_ids" in rows.column_names:
        if "labels" not in rows.column_names:
            raise UnlearnError("the held-out forget rows have input_ids but no labels; tokenise them with tokenize_qa")
        return rows
    if tokenizer is None:
        raise UnlearnError("the held-out forget rows are raw question/answer rows: pass tokenizer= to tokenise them")
    from ..data.tokenize import tokenize_qa

    return tokenize_qa(rows, tokenizer, max_length=max_length, id_column=id_column)


def token_scores(model, rows, collator, metric: str, *, k: int = 10, beta: float = 1.0, rho: float = 0.5,
                 active_tokens: str = "suffix", suffix_fraction: float = 0.5, skip_first: int = 0,
                 batch_size: int = 8) -> tuple[float, int]:
    """``(value, rows scored)`` of ``violation_rate`` or ``forget_probability`` on tokenised ``rows``, no grad."""
    import torch

    from ..losses import masc_active_mask, masc_margin, masc_threshold, masc_violation_rates, token_logprobs

    device = next(model.parameters()).device
    tau = masc_threshold(rho)
    total, n = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
                labels = batch["labels"].to(device)
                logits = model(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device)).logits
                if metric == "violation_rate":
                    margin, mask = masc_margin(logits, labels, k, beta)
                    active = masc_active_mask(mask, active_tokens, suffix_fraction, skip_first)
                    rates, valid = masc_violation_rates(margin, active, tau)
                    total += float(rates[valid].sum())
                    n += int(valid.sum())
                else:
                    logp, mask = token_logprobs(logits, labels)
                    mean_logp = logp.sum(-1) / mask.sum(-1).clamp(min=1)
                    total += float(mean_logp.exp().sum())
                    n += len(mean_logp)
    finally:
        model.train(was_training)
    return total / max(n, 1), n


def truth_ratio_score(model, tokenizer, items: Sequence[dict], *, max_length: int = 512,
                      batch_size: int = 16) -> tuple[float, int]:
    """``(mean(min(TR, 1/TR)), items)`` over ``items`` with ``question``, ``paraphrased_answer``, ``perturbed_answer``."""
    from ..data.tokenize import encode_qa
    from . import metrics as M
    from .runner import pad_token_id, score_sequences
    from .tofu import resolve_chat_template

    chat = resolve_chat_template(tokenizer, None)
    encodings, owner = [], []
    for i, it in enumerate(items):
        for text in [it["paraphrased_answer"], *it["perturbed_answer"]]:
            encodings.append(encode_qa(tokenizer, it["question"], text, max_length, chat))
            owner.append(i)
    stats = score_sequences(model, encodings, pad_id=pad_token_id(tokenizer), batch_size=batch_size, progress=False)
    nlls: list[list[float]] = [[] for _ in items]
    for i, st in zip(owner, stats):
        nlls[i].append(st.mean_nll)
    ratios = [M.truth_ratio(v[0], v[1:]) for v in nlls]
    return M.truth_ratio_forget_score(ratios), len(ratios)


class UnlearningStoppingCallback(UnlearningEvalCallback):
    """Stop (or mark) an unlearning run when a forget metric on held-out forget rows reaches ``target``.

    Args:
        metric: ``"violation_rate"``, ``"forget_probability"`` (reached when <= target) or ``"truth_ratio"`` (>=).
        target: the level that counts as forgotten (e.g. MASC's ``alpha`` for the violation rate, or the retain-only
            reference's value of the metric).
        eval_steps: check every this many optimizer steps; the step cap is always checked.
        mode: ``"stop"`` ends training at the first check that reaches the target; ``"monitor"`` records that
            step, its elapsed training time and a checkpoint, and lets training run to its budget.
        eval_dataset: held-out forget rows (tokenised or raw QA); default: the bound trainer's
            ``eval_forget_dataset``.
        tokenizer: needed for raw rows and ``truth_ratio``; default: the bound trainer's ``processing_class``.
        save_checkpoint: ``True``: keep the best model so far in ``<output_dir>/<best_dir>`` (frozen once the target
            is reached: in monitor mode it is the model at ``reached_step``); ``"target"``: only the model that
            reaches the target (no writes before); ``False``: none.
        k, beta, rho, active_tokens, suffix_fraction, skip_first: the violation rate's margin, as MASC's.
        tofu_path: where TOFU's perturbed answers are read for ``truth_ratio`` (default: $HF_UNLEARN_DATA_DIR/tofu).

    After training: ``reached_step`` / ``reached_value`` / ``reached_seconds`` (training time from ``on_train_begin``
    to the check that reached the target, checks included, checkpoint writes excluded) or ``None``;
    ``check_seconds`` (time spent in checks and checkpoint writes, to subtract from a fixed-budget run's time); the
    same two as process CPU time (``reached_cpu_seconds``, ``check_cpu_seconds``);
    ``history``; ``best_model_path``. All but the timings survive checkpoint/resume (``ExportableState``).
    """

    def __init__(self, metric: str = "violation_rate", target: float = 0.2, *, eval_steps: int = 5,
                 mode: str = "stop", eval_dataset=None, tokenizer=None, save_checkpoint: bool | str = True,
                 best_dir: str = "stopping_checkpoint", k: int = 10, beta: float = 1.0, rho: float = 0.5,
                 active_tokens: str = "suffix", suffix_fraction: float = 0.5, skip_first: int = 0,
                 max_length: int | None = None, batch_size: int = 8, tofu_path=None, trainer=None):
        if metric not in TARGET_METRICS:
            raise UnlearnError(f"unknown stopping metric {metric!r}; choose one of {', '.join(TARGET_METRICS)}")
        if mode not in MODES:
            raise UnlearnError(f"mode must be 'stop' or 'monitor', got {mode!r}")
        if eval_steps < 1:
            raise UnlearnError(f"eval_steps must be >= 1, got {eval_steps}")
        if save_checkpoint not in (True, False, "target"):
            raise UnlearnError(f"save_checkpoint must be True, False or 'target', got {save_checkpoint!r}")
        if metric == "violation_rate" and not 0.0 < rho < 1.0:
            raise UnlearnError(f"rho must lie strictly between 0 and 1, got {rho}")
        super().__init__(tokenizer, eval_steps=eval_steps, metric_for_best=metric,
                         greater_is_better=TARGET_METRICS[metric], best_dir=best_dir, evaluate_at_end=False)
        self.metric, self.target, self.mode = metric, float(target), mode
        self.eval_dataset = eval_dataset
        self.save_checkpoint = save_checkpoint
        self.margin_spec = dict(k=k, beta=beta, rho=rho, active_tokens=active_tokens,
                                suffix_fraction=suffix_fraction, skip_first=skip_first)
        self.max_length = max_length
        self.batch_size = batch_size
        self.tofu_path = tofu_path
        self.reached_step: int | None = None
        self.reached_value: float | None = None
        self.reached_seconds: float | None = None
        self.reached_cpu_seconds: float | None = None
        self.check_seconds = 0.0
        self.check_cpu_seconds = 0.0
        self._rows = None  # tokenised held-out rows, or truth-ratio items
        self._started: tuple[float, float] | None = None  # (wall, process CPU) at on_train_begin
        self._save_seconds = (0.0, 0.0)
        self.trainer = None
        if trainer is not None:
            self.bind(trainer)

    # -- ExportableState -----------------------------------------------------------------------------------------
    def state(self) -> dict:
        state = super().state()
        state["args"] = {"metric": self.metric, "target": self.target, "eval_steps": self.eval_steps,
                         "mode": self.mode, "save_checkpoint": self.save_checkpoint, "best_dir": self.best_dir,
                         **self.margin_spec}
        state["attributes"].update({"reached_step": self.reached_step, "reached_value": self.reached_value,
                                    "history": list(self.history)})
        return state

    def bind(self, trainer) -> UnlearningStoppingCallback:
        """Read held-out rows, tokenizer and length limit from an UnlearningTrainer; log through it."""
        self.trainer = trainer
        if self.eval_dataset is None:
            self.eval_dataset = getattr(trainer, "eval_forget_dataset", None)
        if self.tokenizer is None:
            self.tokenizer = getattr(trainer, "processing_class", None)
        if self.max_length is None:
            self.max_length = getattr(trainer.args, "max_length", None)
        trained = getattr(trainer, "trained_forget_ids", None)
        id_column = getattr(trainer.args, "id_column", "id")
        if trained and self.eval_dataset is not None and id_column in self.eval_dataset.column_names:
            both = set(trained) & set(self.eval_dataset[id_column])
            if both:
                raise UnlearnError(
                    f"{len(both)} of the callback's held-out rows are trained on ({', '.join(map(repr, sorted(both)[:5]))}); "
                    "a stop measured on them says nothing about unseen rows: pass rows outside the forget set the "
                    "trainer trains on (or use the trainer's validation_fraction rows)"
                )
        return self

    def restored_from(self, old: UnlearningStoppingCallback) -> None:
        """After a resume re-created this callback from its state: take the settings the state does not hold."""
        self.eval_dataset, self.tokenizer, self.tofu_path = old.eval_dataset, old.tokenizer, old.tofu_path
        self.max_length, self.batch_size = old.max_length, old.batch_size

    # -- what is reached -----------------------------------------------------------------------------------------
    def reached(self, value: float) -> bool:
        return value >= self.target if TARGET_METRICS[self.metric] else value <= self.target

    def _prepare(self):
        if self._rows is not None:
            return self._rows
        rows = self.eval_dataset
        if rows is None or len(rows) == 0:
            raise UnlearnError(
                "UnlearningStoppingCallback has no held-out forget rows: set validation_fraction in the trainer's "
                "config, pass eval_forget_dataset= to the trainer, or eval_dataset= to the callback"
            )
        id_column = getattr(getattr(self.trainer, "args", None), "id_column", "id")
        if self.metric == "truth_ratio":
            self._rows = self._truth_ratio_items(rows, id_column)
        else:
            from ..data.collators import QACollator

            if self.tokenizer is None and "input_ids" not in rows.column_names:
                raise UnlearnError("raw held-out rows need a tokenizer (tokenizer=, or a trainer's processing_class)")
            rows = _tokenised(rows, self.tokenizer, self.max_length or 512, id_column)
            pad = getattr(self.tokenizer, "pad_token_id", None)
            self._collator = QACollator(pad_token_id=0 if pad is None else pad, id_column=id_column)
            self._rows = rows
        return self._rows

    def _truth_ratio_items(self, rows, id_column: str) -> list[dict]:
        cols = rows.column_names
        if {"question", "paraphrased_answer", "perturbed_answer"} <= set(cols):
            return [{"question": r["question"], "paraphrased_answer": r["paraphrased_answer"],
                     "perturbed_answer": list(r["perturbed_answer"])} for r in rows]
        from .tofu import tofu_sets

        why = ("truth_ratio needs paraphrased and perturbed answers (TOFU ids 0-399 and 3600-3999 have them, or add "
               "question/paraphrased_answer/perturbed_answer columns to the held-out rows)")
        ids = list(rows[id_column])
        try:
            items = tofu_sets(forget_ids=ids, tofu_path=self.tofu_path,
                              max_items={"retain": 1, "real_authors": 1, "world_facts": 1, "holdout": 1})["forget"]
        except UnlearnError as e:
            raise UnlearnError(f"{why}: {e}") from None
        missing = [it["id"] for it in items if it["perturbed_answer"] is None]
        if missing:
            raise UnlearnError(f"{why}; held-out ids {missing[:5]} have none")
        return items

    def evaluate(self, model, tokenizer, step: int) -> StoppingScores:
        rows = self._prepare()
        if self.metric == "truth_ratio":
            value, n = truth_ratio_score(model, tokenizer, rows, max_length=self.max_length or 512,
                                         batch_size=self.batch_size)
        else:
            value, n = token_scores(model, rows, self._collator, self.metric, batch_size=self.batch_size,
                                    **self.margin_spec)
        return StoppingScores(summary={self.metric: value, "rows": n}, meta={"target": self.target})

    def _save_best(self, args, model, tokenizer, result) -> None:
        if not self.save_checkpoint or (self.save_checkpoint == "target"
                                        and not self.reached(result.summary[self.metric])):
            return
        started = _clocks()
        super()._save_best(args, model, tokenizer, result)
        self._save_seconds = tuple(a + b - c for a, b, c in zip(self._save_seconds, _clocks(), started))

    # -- Trainer events ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._started = _clocks()
        self.check_seconds = self.check_cpu_seconds = 0.0
        self._save_seconds = (0.0, 0.0)  # every checkpoint write of this run (wall, CPU)
        return control

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.reached_step is not None:
            if self.mode == "stop":  # resumed from a checkpoint taken after the stop
                control.should_training_stop = True
            return control
        step = state.global_step
        if step % self.eval_steps and not (state.max_steps and step >= state.max_steps):
            return control
        started = _clocks()
        self._run(args, state, model, processing_class)
        now = _clocks()
        self.check_seconds += now[0] - started[0]
        self.check_cpu_seconds += now[1] - started[1]
        value = self.history[-1][self.metric]
        if self.reached(value):
            self.reached_step, self.reached_value = step, value
            if self._started is not None:  # checkpoint writes are not part of the time to the target
                self.reached_seconds = now[0] - self._save_seconds[0] - self._started[0]
                self.reached_cpu_seconds = now[1] - self._save_seconds[1] - self._started[1]
            logger.info("forget target reached at step %d: %s = %.4f (target %g)", step, self.metric, value,
                        self.target)
            if self.mode == "stop":
                control.should_training_stop = True
        return control

    def summary(self) -> dict[str, Any]:
        """What the run reached, for reports: metric, target, mode, reached step/value/seconds, check seconds."""
        return {"metric": self.metric, "target": self.target, "mode": self.mode, "reached_step": self.reached_step,
                "reached_value": self.reached_value, "reached_seconds": self.reached_seconds,
                "reached_cpu_seconds": self.reached_cpu_seconds, "check_seconds": self.check_seconds,
                "check_cpu_seconds": self.check_cpu_seconds, "best_step": self.best_step,
                "checkpoint": self.best_model_path, "checks": len(self.history)}
