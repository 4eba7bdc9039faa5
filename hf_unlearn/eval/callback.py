"""Evaluate unlearning during any ``Trainer`` run, log the numbers, keep the best checkpoint.

```python
cb = UnlearningEvalCallback(tokenizer, eval_steps=10, metric_for_best="forget_quality", reference="ref.json",
                            eval_kwargs={"forget_ids": forget_ids, "max_items": 40})
trainer = MyUnlearningTrainer(..., callbacks=[cb])
cb.trainer = trainer          # optional: log through trainer.log (log history, progress bar, report_to integrations)
trainer.train()
```
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from ..errors import UnlearnError
from ..utils import weights_follow_umask

logger = logging.get_logger(__name__)


class UnlearningEvalCallback(TrainerCallback, ExportableState):
    """Run an unlearning evaluation every ``eval_steps`` optimizer steps (and at the end of training).

    Metrics are logged with the prefix ``unlearn/``: through ``trainer.log`` when ``self.trainer`` is set (so they
    reach the log history, the console and every ``report_to`` integration), else appended to
    ``state.log_history`` and the transformers logger. With ``metric_for_best`` the model of the best evaluation so
    far is saved to ``<output_dir>/<best_dir>`` (with the tokenizer and ``unlearning_eval.json``). The best score and
    its step survive checkpoint/resume (``ExportableState``).

    Args:
        tokenizer: the tokenizer the evaluation uses.
        eval_steps: evaluate every this many optimizer steps (0 = only at the end of training).
        evaluate_fn: ``fn(model, tokenizer, **eval_kwargs) -> EvalResult``; default :func:`evaluate_tofu`.
        eval_kwargs: keyword arguments for ``evaluate_fn`` (e.g. ``forget_ids``, ``max_items``, ``batch_size``).
        reference: passed to ``evaluate_fn`` as ``reference=`` (forget quality and privleak need it).
        metric_for_best: a summary key (e.g. ``forget_quality``, ``model_utility``) or ``fn(summary) -> float``.
        greater_is_better: direction of ``metric_for_best``.
    """

    def __init__(
        self,
        tokenizer=None,
        *,
        eval_steps: int = 50,
        evaluate_fn: Callable | None = None,
        eval_kwargs: dict[str, Any] | None = None,
        reference=None,
        metric_for_best: str | Callable[[dict], float] | None = None,
        greater_is_better: bool = True,
        best_dir: str = "best_unlearning_checkpoint",
        evaluate_at_end: bool = True,
        trainer=None,
    ):
        if eval_steps < 0:
            raise UnlearnError(f"eval_steps must be >= 0, got {eval_steps}")
        self.tokenizer = tokenizer
        self.eval_steps = eval_steps
        self.evaluate_fn = evaluate_fn
        self.eval_kwargs = dict(eval_kwargs or {})
        self.reference = reference
        self.metric_for_best = metric_for_best
        self.greater_is_better = greater_is_better
        self.best_dir = best_dir
        self.evaluate_at_end = evaluate_at_end
        self.trainer = trainer
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.history: list[dict[str, Any]] = []
        self._last_step: int | None = None
        self.best_model_path: str | None = None  # where the best model was saved

    # -- ExportableState -----------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "args": {"eval_steps": self.eval_steps, "greater_is_better": self.greater_is_better,
                     "best_dir": self.best_dir, "evaluate_at_end": self.evaluate_at_end},
            "attributes": {"best_score": self.best_score, "best_step": self.best_step},
        }

    # -- evaluation ----------------------------------------------------------------------------------------------
    def _score(self, summary: dict) -> float | None:
        if self.metric_for_best is None:
            return None
        if callable(self.metric_for_best):
            return float(self.metric_for_best(summary))
        if self.metric_for_best not in summary:
            raise UnlearnError(
                f"metric_for_best={self.metric_for_best!r} is not an evaluation metric; choose one of "
                f"{', '.join(sorted(summary))}"
            )
        value = summary[self.metric_for_best]
        return None if value is None else float(value)

    def evaluate(self, model, tokenizer, step: int):
        fn = self.evaluate_fn
        if fn is None:
            from .tofu import evaluate_tofu as fn
        kwargs = dict(self.eval_kwargs)
        if self.reference is not None:
            kwargs.setdefault("reference", self.reference)
        kwargs.setdefault("progress", False)
        return fn(model, tokenizer, **kwargs)

    def _run(self, args, state, model, processing_class=None):
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        if tokenizer is None:
            raise UnlearnError("UnlearningEvalCallback needs a tokenizer (pass it, or give the Trainer a processing_class)")
        step = state.global_step
        if self._last_step == step:
            return
        self._last_step = step
        result = self.evaluate(model, tokenizer, step)
        logs = {f"unlearn/{k}": float(v) for k, v in result.summary.items() if isinstance(v, (int, float))}
        score = self._score(result.summary)
        self.history.append({"step": step, **result.summary})
        if score is not None and (self.best_score is None or
                                  (score > self.best_score if self.greater_is_better else score < self.best_score)):
            self.best_score, self.best_step = score, step
            if state.is_world_process_zero:
                self._save_best(args, model, tokenizer, result)
        if self.best_score is not None:
            logs["unlearn/best_score"] = self.best_score
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append({**logs, "step": step})
            logger.info("unlearning evaluation at step %d: %s", step, logs)

    def _save_best(self, args, model, tokenizer, result) -> None:
        out = Path(args.output_dir) / self.best_dir
        unwrapped = getattr(model, "module", model)
        unwrapped.save_pretrained(out)
        weights_follow_umask(out)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
        result.to_json(out / "unlearning_eval.json")
        self.best_model_path = os.fspath(out)
        logger.info("new best unlearning score %.4g at step %d, saved to %s", self.best_score, self.best_step, out)

    # -- Trainer events ------------------------------------------------------------------------------------------
    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.eval_steps and state.global_step % self.eval_steps == 0:
            self._run(args, state, model, processing_class)
        return control

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.evaluate_at_end:
            self._run(args, state, model, processing_class)
        return control
