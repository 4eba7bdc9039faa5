"""Multiple-choice fine-tuning of a causal LM, and forgetting a task by fine-tuning on random labels.

:class:`MultipleChoiceTrainer` trains the model to pick the labelled choice: the loss is the cross-entropy over the
(length-normalised) log-likelihoods of the choices, so the model is pushed towards the labelled answer and away from
the others. It is the initial fine-tuning. :class:`RandomLabelForgetTrainer` is the same trainer on the same training
rows with their labels re-drawn once, seeded, before training (``uniform``: any choice, the true one included, as the
common "random label" recipe does; ``flipped``: always a wrong choice).

```python
trainer = RandomLabelForgetTrainer(model=finetuned, args=RandomLabelConfig(output_dir="out", label_mode="uniform"),
                                   train_dataset=task_train, processing_class=tokenizer)
trainer.train()
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from transformers import Trainer, TrainingArguments

from ..errors import UnlearnError
from ..eval.tasks import (
    MultipleChoiceCollator,
    check_split,
    evaluate_multiple_choice,
    forward_scores,
    multiple_choice_loss,
)
from ..hub.mixin import UnlearningHubMixin

LABEL_MODES = ("uniform", "flipped")
PAPER = "https://arxiv.org/abs/2409.02228"
CITATION = """@article{zhang2024unforgettable,
  title={Unforgettable Generalization in Language Models},
  author={Zhang, Eric and Choshen, Leshem and Andreas, Jacob},
  journal={arXiv preprint arXiv:2409.02228},
  year={2024}
}"""


@dataclass
class MultipleChoiceConfig(TrainingArguments):
    """Training arguments for multiple-choice fine-tuning (the rows keep their raw columns: the collator encodes)."""

    max_length: int = field(default=256, metadata={"help": "Longest prompt + choice in tokens (prompt cut on the left)."})
    length_normalize: bool = field(
        default=True, metadata={"help": "Score a choice by its mean token log-likelihood instead of the sum."}
    )
    list_choices: bool = field(default=True, metadata={"help": "List the choices in the prompt before 'Answer:'."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the collator needs the raw question/choices columns."}
    )
    label_names: list[str] | None = field(
        default_factory=lambda: ["mc_labels"], metadata={"help": "The batch key holding the choice labels."}
    )
    report_to: str | list[str] | None = field(default="none", metadata={"help": "Integrations to report to."})


@dataclass
class RandomLabelConfig(MultipleChoiceConfig):
    """Arguments for :class:`RandomLabelForgetTrainer`."""

    label_mode: str = field(
        default="uniform",
        metadata={"help": "'uniform': each row's label drawn uniformly from its choices; 'flipped': a wrong choice."},
    )
    label_seed: int | None = field(
        default=None, metadata={"help": "Seed of the random labels (fixed for the run); defaults to `seed`."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.label_mode not in LABEL_MODES:
            raise UnlearnError(f"label_mode must be one of {', '.join(LABEL_MODES)}, not {self.label_mode!r}")


def assign_random_labels(labels: Sequence[int], n_choices: Sequence[int], mode: str = "uniform", seed: int = 0):
    """Draw one label per row: ``uniform`` over its choices, or ``flipped`` uniformly over its wrong choices.

    Pure and seeded: the same inputs always give the same labels.
    """
    import numpy as np

    if mode not in LABEL_MODES:
        raise UnlearnError(f"label_mode must be one of {', '.join(LABEL_MODES)}, not {mode!r}")
    if len(labels) != len(n_choices):
        raise UnlearnError(f"{len(labels)} labels for {len(n_choices)} rows")
    rng = np.random.default_rng(seed)
    out = []
    for y, n in zip(labels, n_choices):
        if n < 2:
            raise UnlearnError(f"a row with {n} choice(s) cannot get a random label; multiple choice needs at least 2")
        if not 0 <= y < n:
            raise UnlearnError(f"label {y} is outside its {n} choices")
        if mode == "uniform":
            out.append(int(rng.integers(0, n)))
        else:
            r = int(rng.integers(0, n - 1))
            out.append(r if r < y else r + 1)
    return out


def _accuracy_metrics(eval_pred) -> dict:
    import numpy as np

    scores, labels = eval_pred.predictions, eval_pred.label_ids
    return {"accuracy": float((np.asarray(scores).argmax(-1) == np.asarray(labels)).mean())}


class MultipleChoiceTrainer(UnlearningHubMixin, Trainer):
    """Fine-tune a causal LM to pick the labelled choice of multiple-choice rows (task schema).

    ``train_dataset``/``eval_dataset`` hold raw rows (``id, context, question, choices, label``);
    ``processing_class`` must be the tokenizer. ``trainer.evaluate()`` reports ``eval_accuracy``;
    :meth:`score` returns the per-example :class:`~hf_unlearn.eval.tasks.MCResult`.

    Every training step also logs, at no extra cost, whether each row of the batch was right under its *true*
    label: ``self.correctness_history[row_id]`` is a list of ``(global_step, correct)``, the raw material for the
    order in which rows are learned and forgotten (:func:`hf_unlearn.analysis.forgetting.first_stable_step`).
    """

    method_name = "MultipleChoiceFineTune"

    def __init__(self, model=None, args: MultipleChoiceConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, data_collator=None, compute_metrics=None, peft_config=None, **kwargs):
        if args is None:
            args = MultipleChoiceConfig(output_dir="tmp_trainer")
        if not isinstance(args, MultipleChoiceConfig):
            raise UnlearnError(f"{type(self).__name__} needs a MultipleChoiceConfig (or RandomLabelConfig) as args")
        if processing_class is None:
            raise UnlearnError(f"{type(self).__name__} needs the tokenizer as processing_class=")
        if train_dataset is not None:
            check_split(train_dataset, "train_dataset")
        if eval_dataset is not None:
            check_split(eval_dataset, "eval_dataset")
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        collator = data_collator or MultipleChoiceCollator(processing_class, args.max_length, args.list_choices)
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, data_collator=collator,
                         compute_metrics=compute_metrics or _accuracy_metrics, **kwargs)
        self.correctness_history: dict = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores, _ = forward_scores(model, inputs, self.args.length_normalize)
        loss = multiple_choice_loss(scores, inputs["mc_labels"])
        if model.training:
            true = inputs.get("mc_true_labels", inputs["mc_labels"])
            right = (scores.detach().argmax(-1) == true).tolist()
            for rid, ok in zip(inputs["row_ids"], right):
                self.correctness_history.setdefault(rid, []).append((self.state.global_step, bool(ok)))
        return (loss, {"scores": scores}) if return_outputs else loss

    def score(self, dataset, hidden_states: bool = False, batch_size: int | None = None):
        """Per-example predictions/confidences on ``dataset`` (true labels in its ``label`` column)."""
        return evaluate_multiple_choice(
            self.model, self.processing_class, dataset, batch_size=batch_size or self.args.per_device_eval_batch_size,
            max_length=self.args.max_length, normalize=self.args.length_normalize,
            list_choices=self.args.list_choices, hidden_states=hidden_states,
        )

    def _hyperparameters(self) -> dict:
        a = self.args
        return {
            "learning_rate": a.learning_rate, "num_train_epochs": a.num_train_epochs, "max_steps": a.max_steps,
            "per_device_train_batch_size": a.per_device_train_batch_size,
            "gradient_accumulation_steps": a.gradient_accumulation_steps, "weight_decay": a.weight_decay,
            "lr_scheduler_type": str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)),
            "max_length": a.max_length, "length_normalize": a.length_normalize, "list_choices": a.list_choices,
            "seed": a.seed,
        }

    def _train_ids(self) -> list:
        ds = self.train_dataset
        return list(ds["id"]) if ds is not None and "id" in ds.column_names else []

    def unlearning_card_info(self) -> dict:
        """What a model card needs (the Hub code turns ``forget_ids`` into keyed tags)."""
        return {"method": self.method_name, "hyperparameters": self._hyperparameters(), "forget_ids": [],
                "citation": "", "paper": "", "extra": {"train_rows": len(self._train_ids())}}


class RandomLabelForgetTrainer(MultipleChoiceTrainer):
    """Forget a task by fine-tuning on its training rows with random labels (drawn once, seeded, before training).

    The true labels are kept in a ``true_label`` column of ``self.train_dataset``; ``self.random_labels`` holds the
    drawn ones.
    """

    method_name = "RandomLabel"

    def __init__(self, model=None, args: RandomLabelConfig | None = None, train_dataset=None, **kwargs):
        if args is None:
            args = RandomLabelConfig(output_dir="tmp_trainer")
        if not isinstance(args, RandomLabelConfig):
            raise UnlearnError("RandomLabelForgetTrainer needs a RandomLabelConfig as args")
        if train_dataset is None or not hasattr(train_dataset, "column_names"):
            raise UnlearnError("RandomLabelForgetTrainer needs the task's training rows as a datasets.Dataset "
                               "(e.g. hf_unlearn.load_task(...)['train']) in train_dataset=")
        check_split(train_dataset, "train_dataset")
        seed = args.seed if args.label_seed is None else args.label_seed
        true = [int(y) for y in train_dataset["label"]]
        self.random_labels = assign_random_labels(true, [len(c) for c in train_dataset["choices"]], args.label_mode,
                                                  seed)
        if "true_label" in train_dataset.column_names:
            train_dataset = train_dataset.remove_columns("true_label")
        train_dataset = train_dataset.rename_column("label", "true_label").add_column("label", self.random_labels)
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)

    def unlearning_card_info(self) -> dict:
        true = self.train_dataset["true_label"]
        changed = sum(int(a != b) for a, b in zip(true, self.random_labels)) / len(true)
        hp = {**self._hyperparameters(), "label_mode": self.args.label_mode,
              "label_seed": self.args.seed if self.args.label_seed is None else self.args.label_seed}
        return {"method": self.method_name, "hyperparameters": hp, "forget_ids": self._train_ids(),
                "citation": CITATION, "paper": PAPER, "extra": {"fraction_labels_changed": changed}}
