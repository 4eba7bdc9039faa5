"""The shared base of the approximate unlearning trainers: data pairing, the reference model, metric logging.

How data reach ``compute_loss``: the Trainer's own training dataloader iterates the **forget set** (it is the
``train_dataset``; epochs, ``max_steps``, gradient accumulation and ``accelerate`` sharding behave as usual). Each
forget microbatch is paired with one **retain microbatch** drawn from a cycling retain stream: retain draw ``d`` is
a slice of a seeded permutation of the retain set (a new permutation per pass, seeded by ``args.seed`` and the pass
number), split across processes. The draw index is ``global_step * gradient_accumulation_steps + microbatch``, so
the retain batches are a function of the step alone and a resumed run sees the same retain batches as an
uninterrupted one.

Held-out forget rows: ``validation_fraction`` (a seeded share of the forget set, drawn from a stream independent of
the Trainer's shuffle) or ``eval_forget_dataset=`` (rows you choose) are forget rows the model is **never trained
on**. They are part of the deletion request (``forget_ids``, the card), but only the stopping rules read them
(:class:`~hf_unlearn.methods.masc.MASCStoppingCallback`, :class:`~hf_unlearn.eval.stopping.UnlearningStoppingCallback`):
a stop measured on them says that forgetting reached rows the optimiser never saw.

The reference model (``p_0``, the model before unlearning) is the PEFT base with the adapter disabled when the
model is a ``PeftModel`` or ``peft_config=`` is given, else a frozen copy made once at construction, and only when
the method needs one. Reference forwards always run in eval mode (no dropout), whatever the model's training mode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

from ..data.collators import QACollator, check_attention_mask
from ..data.prompts import prompt_format
from ..data.tokenize import IGNORE_INDEX, tokenize_qa
from ..errors import UnlearnError
from ..hub.mixin import UnlearningHubMixin
from ..losses import kl_retain_loss, nll_loss
from ..utils import independent_generator  # re-exported: eval's attacks draw with it too

RETAIN_LOSSES = ("none", "ce", "kl")
HALF_DTYPES = (torch.float16, torch.bfloat16)
logger = logging.get_logger(__name__)


@dataclass
class UnlearningConfig(TrainingArguments):
    r"""Arguments shared by every hf_unlearn unlearning trainer (a ``TrainingArguments`` subclass).

    Method configs (``MASCConfig``, ``NPOConfig``, ...) subclass it and add only their own fields. Defaults that
    differ from ``TrainingArguments``: ``learning_rate=1e-5``, ``logging_steps=10``.
    """

    learning_rate: float = field(default=1e-5, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps."})

    max_length: int = field(
        default=256,
        metadata={"help": "Maximum tokens per QA pair when the trainer tokenises raw question/answer rows."},
    )
    id_column: str = field(default="id", metadata={"help": "Column holding each row's stable sample id."})
    prompt_format: str = field(
        default="hf-unlearn",
        metadata={"help": "How raw question/answer rows become tokens: 'hf-unlearn' (the chat template's user turn or "
                          "'Question: ...\\nAnswer:', the answer tokenised on its own) or 'open-unlearning' "
                          "(OpenUnlearning's per model family: hf_unlearn.data.prompts.PromptFormat.open_unlearning). "
                          "Evaluate with the format the model was trained with.",
                  "choices": ["hf-unlearn", "open-unlearning"]},
    )
    attention_mask: str = field(
        default="tokens",
        metadata={"help": "How the default collator masks a padded batch: 'tokens' (every token of a row) or 'not_pad' "
                          "(input_ids != pad id, OpenUnlearning's: a pad id inside a row, e.g. SmolLM2's end-of-turn "
                          "token, is masked too).",
                  "choices": ["tokens", "not_pad"]},
    )
    retain_batch_size: int | None = field(
        default=None,
        metadata={"help": "Retain rows per device per microbatch; None = per_device_train_batch_size."},
    )
    retain_loss: str = field(
        default="ce",
        metadata={
            "help": "Retain term: 'ce' (cross-entropy on retain answers), 'kl' (KL(p_0 || p_theta) on retain "
            "answers, needs the reference model) or 'none' (no retain batches are drawn).",
            "choices": list(RETAIN_LOSSES),
        },
    )
    lambda_forget: float = field(default=1.0, metadata={"help": "Weight of the forget term."})
    lambda_retain: float = field(default=1.0, metadata={"help": "Weight of the retain term."})
    kl_positions: str = field(
        default="answer",
        metadata={"help": "Positions the 'kl' retain term averages over: 'answer' (the retain answers' tokens) or "
                          "'all' (every position, prompt and padding included: OpenUnlearning's convention).",
                  "choices": ["answer", "all"]},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set dropout to 0 in the model and the reference model (dropout layers and attention "
                          "dropout rates). Reference forwards run without dropout either way."},
    )
    validation_fraction: float = field(
        default=0.0,
        metadata={"help": "Share of the forget set held out from training (a seeded draw, independent of the "
                          "training shuffle); stopping rules measure forgetting on these never-trained rows. "
                          "0 = train on every forget row."},
    )
    fp32_master_weights: bool = field(
        default=True,
        metadata={"help": "Train half-precision (bf16/fp16) trainable weights in fp32: they are upcast when train() "
                          "starts and cast back when it ends (a PEFT model: only its trainable weights; otherwise the "
                          "whole model), so updates below half-precision resolution accumulate instead of being "
                          "rounded away. Set bf16=True to keep the compute in half precision (autocast)."},
    )
    stop_on_nonfinite: bool = field(
        default=True,
        metadata={"help": "Stop with an error naming the step when the loss or the gradient is NaN/inf, before the "
                          "optimizer applies it (the Trainer alone would drop the NaN from its log and keep going)."},
    )

    # A method's own fields that must be > 0 or >= 0 (its config lists them; checked by __post_init__, one message)
    _positive = ()
    _non_negative = ()

    def __post_init__(self):
        super().__post_init__()
        if self.retain_loss not in RETAIN_LOSSES:
            raise UnlearnError(f"retain_loss must be one of {', '.join(RETAIN_LOSSES)}, got {self.retain_loss!r}")
        if self.kl_positions not in ("answer", "all"):
            raise UnlearnError(f"kl_positions must be 'answer' or 'all', got {self.kl_positions!r}")
        check_attention_mask(self.attention_mask)
        if self.prompt_format not in ("hf-unlearn", "open-unlearning"):
            raise UnlearnError(f"prompt_format must be 'hf-unlearn' or 'open-unlearning', got {self.prompt_format!r}")
        if self.lambda_forget < 0 or self.lambda_retain < 0:
            raise UnlearnError("lambda_forget and lambda_retain must be >= 0")
        if self.max_length < 2:
            raise UnlearnError(f"max_length must be at least 2, got {self.max_length}")
        if self.retain_batch_size is not None and self.retain_batch_size < 1:
            raise UnlearnError(f"retain_batch_size must be >= 1, got {self.retain_batch_size}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise UnlearnError(f"validation_fraction must lie in [0, 1), got {self.validation_fraction}")
        for name in self._positive:
            if not getattr(self, name) > 0:
                raise UnlearnError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in self._non_negative:
            if not getattr(self, name) >= 0:
                raise UnlearnError(f"{name} must be >= 0, got {getattr(self, name)}")


def split_held_out(dataset, fraction: float, seed: int):
    """``(trained rows, held-out rows)``: ``round(fraction * n)`` rows (at least 1) drawn with an independent stream."""
    n = len(dataset)
    held = max(1, round(fraction * n))
    if held >= n:
        raise UnlearnError(f"validation_fraction={fraction} of {n} forget rows leaves no row to train on; lower it")
    perm = torch.randperm(n, generator=independent_generator(seed, "held-out-forget")).tolist()
    return dataset.select(sorted(perm[held:])), dataset.select(sorted(perm[:held]))


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout of ``model``: ``nn.Dropout`` layers (LoRA's included) and the attention dropout rates that
    attention modules keep as plain floats (Llama, Qwen, Gemma: ``attention_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class UnlearningTrainer(UnlearningHubMixin, Trainer):
    """A ``Trainer`` whose training data are a forget set (the train dataset) paired with a retain set.

    Args:
        model: a ``PreTrainedModel``, a ``PeftModel``, or a name/path/GGUF for :func:`hf_unlearn.load_model`.
        args: the method's config (an :class:`UnlearningConfig` subclass).
        forget_dataset: rows to forget: tokenised (``input_ids``/``attention_mask``/``labels`` + id column, as
            :func:`hf_unlearn.tokenize_qa` returns) or raw QA rows (``question``/``answer`` + id column), which the
            trainer tokenises with ``processing_class``. ``train_dataset=`` is accepted as an alias.
        retain_dataset: rows to keep (same formats); required unless ``args.retain_loss == "none"``.
        processing_class: the tokenizer (needs a pad token); required for raw rows and for the default collator.
        ref_model: an explicit reference model; by default see the module docstring.
        peft_config: a ``peft.PeftConfig``; the model is wrapped with ``get_peft_model`` and only the adapter trains.
        eval_forget_dataset: held-out forget rows (same formats), never trained on, for the stopping rules; or set
            ``args.validation_fraction`` to hold out a share of ``forget_dataset`` instead. Their ids count as forget
            ids (the card keys them like the others).

    Callbacks with a ``bind(trainer)`` method and no trainer yet (the stopping callbacks) are bound to this trainer.
    """

    _config_class: type[UnlearningConfig] = UnlearningConfig
    method_name: str = "unlearning"
    paper: str = ""
    citation: str = ""

    def __init__(
        self,
        model=None,
        args: UnlearningConfig | None = None,
        forget_dataset=None,
        retain_dataset=None,
        processing_class=None,
        ref_model=None,
        data_collator=None,
        eval_dataset=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        train_dataset=None,
        eval_forget_dataset=None,
    ):
        if model is None:
            raise UnlearnError("pass the model to unlearn (model=...)")
        if train_dataset is not None and forget_dataset is not None:
            raise UnlearnError("pass the forget set once: forget_dataset= (train_dataset= is its alias)")
        forget_dataset = forget_dataset if forget_dataset is not None else train_dataset
        if args is None:
            args = self._config_class(output_dir=f"{type(self).__name__.replace('Trainer', '').lower()}-unlearned")
        if not isinstance(args, UnlearningConfig):
            raise UnlearnError(f"args must be a {self._config_class.__name__} (an UnlearningConfig), got "
                               f"{type(args).__name__}")
        self._check_tokenizer(processing_class)
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            from ..models import load_model

            model = load_model(model)

        forget_dataset = self._prepare_dataset(forget_dataset, processing_class, args, "forget")
        forget_dataset, held_out = self._held_out_rows(forget_dataset, eval_forget_dataset, processing_class, args)
        self.eval_forget_dataset = held_out
        uses_retain = self._uses_retain(args)
        if retain_dataset is not None:
            retain_dataset = self._prepare_dataset(retain_dataset, processing_class, args, "retain")
        elif uses_retain:
            raise UnlearnError(
                f"{type(self).__name__} with retain_loss={args.retain_loss!r} needs a retain set (retain_dataset=...); "
                "set retain_loss='none' to unlearn without one"
            )
        self.trained_forget_ids = list(forget_dataset[args.id_column])
        self.held_out_forget_ids = [] if held_out is None else list(held_out[args.id_column])
        self.forget_ids = self.trained_forget_ids + self.held_out_forget_ids
        if retain_dataset is not None:
            overlap = set(self.forget_ids) & set(retain_dataset[args.id_column])
            if overlap:
                shown = ", ".join(map(repr, sorted(overlap)[:5]))
                raise UnlearnError(
                    f"{len(overlap)} id(s) are in both the forget and the retain set ({shown}{', ...' if len(overlap) > 5 else ''}); "
                    "remove them from the retain set"
                )

        # PEFT: the adapter trains, the base with the adapter disabled is the reference
        if peft_config is not None:
            if _is_peft_model(model):
                raise UnlearnError("the model is already a PeftModel; pass either a PeftModel or peft_config=, not both")
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.is_peft = _is_peft_model(model)
        if self.is_peft and args.gradient_checkpointing:
            model.enable_input_require_grads()

        if ref_model is model:
            raise UnlearnError("ref_model must not be the model being trained; omit it to get a frozen copy")
        if ref_model is None and self._needs_reference(args) and not self.is_peft:
            ref_model = copy.deepcopy(model)
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        self.ref_model = ref_model

        if data_collator is None:
            if processing_class is None:
                raise UnlearnError("pass processing_class= (the tokenizer) or a data_collator= to pad batches")
            data_collator = QACollator.from_tokenizer(processing_class, id_column=args.id_column,
                                                      attention_mask=args.attention_mask)
        self.retain_dataset = retain_dataset
        if eval_dataset is not None and not isinstance(eval_dataset, dict):
            eval_dataset = self._prepare_dataset(eval_dataset, processing_class, args, "eval")

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=forget_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        # compute_loss returns a per-microbatch mean: the Trainer divides it by the accumulation steps
        self.loss_is_scaled_for_ga = False
        self.model_accepts_loss_kwargs = False

        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        if args.disable_dropout:
            for m in (self.model, self.ref_model):
                if m is not None:
                    disable_dropout(m)
        for cb in self.callback_handler.callbacks:
            if callable(getattr(cb, "bind", None)) and getattr(cb, "trainer", None) is None:
                cb.bind(self)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._retain_perm: tuple[int, torch.Tensor] | None = None
        self._retain_cursor = (-1, 0)  # (global step, microbatch within the step)
        if args.stop_on_nonfinite:
            self.add_callback(NonFiniteGradientCallback(type(self).__name__))

    def _load_callback_state(self):
        """Resume re-creates stateful callbacks from their saved state; give the new instances what the state does not
        hold (held-out rows, tokenizer: ``restored_from``) and bind them to this trainer."""
        previous = {type(cb): cb for cb in self.callback_handler.callbacks}
        super()._load_callback_state()
        for cb in self.callback_handler.callbacks:
            old = previous.get(type(cb))
            if old is not None and old is not cb and callable(getattr(cb, "restored_from", None)):
                cb.restored_from(old)
            if callable(getattr(cb, "bind", None)) and getattr(cb, "trainer", None) is None:
                cb.bind(self)

    # ------------------------------------------------------------------ what a method needs (override)

    @classmethod
    def _uses_retain(cls, args: UnlearningConfig) -> bool:
        return args.retain_loss != "none"

    @classmethod
    def _needs_reference(cls, args: UnlearningConfig) -> bool:
        return args.retain_loss == "kl"

    # ------------------------------------------------------------------ input checks and tokenisation

    @staticmethod
    def _check_tokenizer(tokenizer) -> None:
        if tokenizer is not None and getattr(tokenizer, "pad_token_id", 0) is None:
            raise UnlearnError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no pad token; set "
                "tokenizer.pad_token = tokenizer.eos_token (or load it with hf_unlearn.load_tokenizer)"
            )

    def _held_out_rows(self, forget, eval_forget, tokenizer, args: UnlearningConfig):
        """``(rows to train on, held-out forget rows or None)`` from ``eval_forget_dataset=`` or ``validation_fraction``."""
        if eval_forget is None:
            if not args.validation_fraction:
                return forget, None
            return split_held_out(forget, args.validation_fraction, args.seed)
        if args.validation_fraction:
            raise UnlearnError("pass held-out forget rows once: eval_forget_dataset= or validation_fraction, not both")
        eval_forget = self._prepare_dataset(eval_forget, tokenizer, args, "eval_forget")
        both = set(forget[args.id_column]) & set(eval_forget[args.id_column])
        if both:
            raise UnlearnError(f"{len(both)} id(s) of eval_forget_dataset are also in the forget set the model trains "
                               f"on ({', '.join(map(repr, sorted(both)[:5]))}); held-out rows must not be trained on")
        return forget, eval_forget

    @staticmethod
    def _prepare_dataset(dataset, tokenizer, args: UnlearningConfig, name: str):
        """Validate (and tokenise raw QA rows of) a forget/retain/probe dataset."""
        if dataset is None:
            raise UnlearnError(f"the {name} set is missing; pass {name}_dataset=...")
        if len(dataset) == 0:
            raise UnlearnError(f"the {name} set is empty; pass at least one row to {name}")
        columns = dataset.column_names
        if args.id_column not in columns:
            raise UnlearnError(
                f"the {name} set has no id column {args.id_column!r} (columns: {columns}); add stable ids with "
                f"dataset.add_column({args.id_column!r}, ...) or set id_column="
            )
        if "input_ids" not in columns:
            if "question" not in columns or "answer" not in columns:
                raise UnlearnError(
                    f"the {name} set is neither tokenised (input_ids/labels) nor raw QA (question/answer); "
                    f"it has {columns}"
                )
            if tokenizer is None:
                raise UnlearnError(f"the {name} set holds raw question/answer rows: pass processing_class= (the tokenizer)")
            dataset = tokenize_qa(dataset, tokenizer, max_length=args.max_length, id_column=args.id_column,
                                  use_chat_template=prompt_format(args.prompt_format, tokenizer))
        elif "labels" not in columns:
            raise UnlearnError(f"the {name} set has input_ids but no labels; tokenise it with hf_unlearn.tokenize_qa")
        ids = dataset[args.id_column]
        if len(set(ids)) != len(ids):
            raise UnlearnError(f"the {name} set has duplicate ids in column {args.id_column!r}; ids must be unique")
        for row_id, labels in zip(ids, dataset["labels"]):
            if not any(t != IGNORE_INDEX for t in labels[1:]):
                raise UnlearnError(
                    f"{name} row id {row_id!r} has no answer token (empty after truncation?); raise max_length or "
                    "drop the row"
                )
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "attention_mask", "labels", self.args.id_column]

    # ------------------------------------------------------------------ batches

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The keys the model's forward takes (drops the id column)."""
        return {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}

    def _retain_draw_index(self) -> int:
        step = self.state.global_step
        last_step, micro = self._retain_cursor
        micro = micro + 1 if step == last_step else 0
        self._retain_cursor = (step, micro)
        return step * self.args.gradient_accumulation_steps + micro

    def retain_batch(self, draw: int | None = None) -> dict[str, Any] | None:
        """The retain microbatch paired with the current forget microbatch (None without a retain set)."""
        if self.retain_dataset is None or not self._uses_retain(self.args):
            return None
        if draw is None:
            draw = self._retain_draw_index()
        n = len(self.retain_dataset)
        bs = self.args.retain_batch_size or self.args.per_device_train_batch_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        global_bs = bs * world
        per_pass = max(1, n // global_bs)
        cycle, b = divmod(draw, per_pass)
        if self._retain_perm is None or self._retain_perm[0] != cycle:
            gen = torch.Generator().manual_seed(int(self.args.seed) * 1_000_003 + cycle)
            perm = torch.randperm(n, generator=gen)
            if n < global_bs:  # tiny retain sets: repeat the permutation to fill one global batch
                perm = perm.repeat(-(-global_bs // n))
            self._retain_perm = (cycle, perm)
        chunk = self._retain_perm[1][b * global_bs:(b + 1) * global_bs]
        rows = [self.retain_dataset[int(i)] for i in chunk[rank::world]]
        batch = self.data_collator(rows)
        return self._prepare_inputs(batch)

    # ------------------------------------------------------------------ reference model

    @contextlib.contextmanager
    def reference_model(self):
        """The reference model ``p_0`` for no-grad forwards (the PEFT base with the adapter disabled, or the copy)."""
        if self.ref_model is not None:
            with torch.no_grad():
                yield self.ref_model
            return
        if not self.is_peft:
            raise UnlearnError(f"{type(self).__name__} has no reference model in this configuration")
        unwrapped = self.accelerator.unwrap_model(self.model)
        was_training = unwrapped.training
        unwrapped.eval()  # p_0 has no dropout: two reference forwards of a batch must agree
        try:
            with torch.no_grad(), unwrapped.disable_adapter():
                yield self.model
        finally:
            unwrapped.train(was_training)

    def reference_outputs(self, batch: dict[str, Any], **kwargs):
        with self.reference_model() as ref:
            return ref(**self._model_inputs(batch), **kwargs)

    # ------------------------------------------------------------------ common loss terms

    def joint_forward(self, model, forget: dict[str, Any], retain: dict[str, Any] | None, **kwargs):
        """One forward pass over the forget rows and the paired retain rows: ``(forget_out, retain_out)``.

        DDP allows one forward per backward, so (as trl does for chosen/rejected pairs) both batches are right-padded
        to a common length, concatenated, and the outputs split back and cut to each batch's own length (right
        padding leaves the real tokens' outputs unchanged). Outputs carry ``logits`` and, if asked, ``hidden_states``.
        """
        if retain is None:
            return model(**self._model_inputs(forget), **kwargs), None
        nf, lf, lr = forget["input_ids"].shape[0], forget["input_ids"].shape[1], retain["input_ids"].shape[1]
        length = max(lf, lr)

        def pad(t):
            return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=0)

        joint = {k: torch.cat([pad(forget[k]), pad(retain[k])]) for k in ("input_ids", "attention_mask")}
        out = model(**joint, **kwargs)

        def split(rows: slice, n: int) -> SimpleNamespace:
            hidden = getattr(out, "hidden_states", None)
            return SimpleNamespace(logits=out.logits[rows, :n],
                                   hidden_states=None if hidden is None else tuple(h[rows, :n] for h in hidden))

        return split(slice(0, nf), lf), split(slice(nf, None), lr)

    def retain_term(self, retain: dict[str, Any] | None, retain_out) -> torch.Tensor | None:
        """The retain loss selected by ``args.retain_loss`` from the retain rows' outputs (None for 'none')."""
        if retain is None or retain_out is None or self.args.retain_loss == "none":
            return None
        if self.args.retain_loss == "ce":
            return nll_loss(retain_out.logits, retain["labels"])
        ref_logits = self.reference_outputs(retain).logits
        return kl_retain_loss(retain_out.logits, ref_logits, retain["labels"], self.args.kl_positions)

    def combine(self, forget_loss: torch.Tensor, retain_loss: torch.Tensor | None, metrics: dict[str, Any]) -> torch.Tensor:
        """``lambda_forget * forget + lambda_retain * retain``; records both terms as metrics."""
        metrics["forget_loss"] = forget_loss
        loss = self.args.lambda_forget * forget_loss
        if retain_loss is not None:
            metrics["retain_loss"] = retain_loss
            loss = loss + self.args.lambda_retain * retain_loss
        self.record_metrics(metrics)
        return loss

    def forget_retain_loss(self, model, inputs, forget_term, return_outputs: bool = False):
        """The usual ``compute_loss``: one joint forward over the forget batch and its paired retain batch, then
        ``lambda_forget * forget_term(outputs, inputs) + lambda_retain * retain``; ``forget_term`` returns the
        forget loss or ``(loss, metrics)``."""
        retain = self.retain_batch()
        outputs, retain_out = self.joint_forward(model, inputs, retain)
        term = forget_term(outputs, inputs)
        forget, metrics = term if isinstance(term, tuple) else (term, {})
        loss = self.combine(forget, self.retain_term(retain, retain_out), metrics)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ metrics and logging (as trl does)

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        """Queue method metrics; they are averaged (across steps and processes) into the next ``log`` call."""
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            t = value.detach().float().reshape(1) if torch.is_tensor(value) else torch.tensor([float(value)])
            t = t.to(self.args.device)
            if self.accelerator.num_processes > 1:
                t = self.accelerator.gather(t)
            self._metrics[mode][key].append(float(t.mean()))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if logs and all(k.startswith("unlearn/") for k in logs):  # an evaluation callback's line: keep the queue
            return super().log(logs, start_time)
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        metrics = {k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v}
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation reports the answer cross-entropy of the eval rows (``eval_loss``)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            logits = model(**self._model_inputs(inputs)).logits
            loss = nll_loss(logits, inputs["labels"])
        return loss.detach(), None, None

    # ------------------------------------------------------------------ numerics: fp32 master weights, non-finite stop

    def train(self, *args, **kwargs):
        """``Trainer.train`` with half-precision trainable weights upcast to fp32 for the run (see
        ``fp32_master_weights``); they are cast back to their dtype when it ends, also when it fails."""
        restore = self._upcast_half_trainable() if self.args.fp32_master_weights else None
        try:
            return super().train(*args, **kwargs)
        finally:
            if restore is not None:
                restore()

    def _upcast_half_trainable(self):
        """Upcast in place (same ``Parameter`` objects, so an optimizer made earlier still holds them); returns the
        function that casts back, or None when there is nothing to upcast."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return None  # they keep their own fp32 master copies
        model = self.model
        if not any(p.requires_grad and p.dtype in HALF_DTYPES for p in model.parameters()):
            return None
        if self.is_peft:  # peft casts between the half base and fp32 adapter layers itself
            tensors = [p for p in model.parameters() if p.requires_grad and p.dtype in HALF_DTYPES]
        else:  # a whole fp32 model: no dtype mismatch between trainable and frozen layers
            tensors = [t for t in (*model.parameters(), *model.buffers()) if t.dtype in HALF_DTYPES]
        originals = [(t, t.dtype) for t in tensors]
        for t, _ in originals:
            t.data = t.data.float()
        if not (self.args.bf16 or self.args.fp16):
            logger.warning(f"{type(self).__name__}: training the {originals[0][1]} weights in fp32 (fp32_master_weights); "
                           "set bf16=True (or fp16=True) to keep the compute in half precision")

        def restore():
            for t, dtype in originals:
                t.data = t.data.to(dtype)

        return restore

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.stop_on_nonfinite and not bool(torch.isfinite(loss).all()):
            step = self.state.global_step + 1
            raise UnlearnError(
                f"{type(self).__name__}: the loss is {float(loss.float().mean())} at step {step}; training stopped before "
                f"that step's update (the model holds the weights of step {step - 1}, nothing of step {step} was "
                "saved); lower the learning rate, set max_grad_norm, or train in bf16/fp32 instead of fp16"
            )
        return loss

    # ------------------------------------------------------------------ model card contract

    def method_hyperparameters(self) -> dict[str, Any]:
        """The config's own fields (those not inherited from ``TrainingArguments``) and the training budget."""
        base = {f.name for f in dataclasses.fields(TrainingArguments)}
        own = {f.name: _jsonable(getattr(self.args, f.name)) for f in dataclasses.fields(self.args)
               if f.name not in base}
        for name in ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "lr_scheduler_type", "warmup_steps", "weight_decay", "seed"):
            own[name] = _jsonable(getattr(self.args, name))
        own.pop("id_column", None)
        if self.is_peft:
            cfg = self.accelerator.unwrap_model(self.model).peft_config.get("default")
            own["peft"] = {"type": str(getattr(cfg, "peft_type", "")), "r": getattr(cfg, "r", None),
                           "target_modules": _jsonable(getattr(cfg, "target_modules", None))}
        return own

    def unlearning_card_info(self) -> dict[str, Any]:
        """What a model card needs (see the trainer contract in DESIGN.md); ``forget_ids`` are raw, never publish them."""
        from ..hub.leaks import own_numbers

        hyperparameters = self.method_hyperparameters()
        extra = {"num_forget": len(self.forget_ids),
                 "num_retain": 0 if self.retain_dataset is None else len(self.retain_dataset),
                 "global_step": int(self.state.global_step)}
        return {
            "method": self.method_name,
            "hyperparameters": hyperparameters,
            "forget_ids": list(self.forget_ids),
            "citation": self.citation,
            "paper": self.paper,
            "extra": extra,
            # its own settings and counts, declared by exact value: warmup_steps 0 or lambda_forget 1.0 next to
            # forget ids 0 and 1 are not those ids (subclasses that add numbers to extra declare them too)
            "not_ids": {**own_numbers(hyperparameters, "hyperparameters"), **own_numbers(extra, "extra")},
        }


class NonFiniteGradientCallback(TrainerCallback):
    """Raises an :class:`UnlearnError` naming the step when a gradient is NaN/inf, before the optimizer step.

    Added by every :class:`UnlearningTrainer` (``stop_on_nonfinite``); runs after gradient clipping, which spreads a
    NaN to every gradient rather than removing it.
    """

    def __init__(self, trainer_name: str = "UnlearningTrainer"):
        self.trainer_name = trainer_name

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.detach() for p in model.parameters() if p.grad is not None] if model is not None else []
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if not bool(torch.isfinite(norm)):
            step = state.global_step + 1
            raise UnlearnError(
                f"{self.trainer_name}: the gradient is not finite (norm {float(norm)}) at step {step}; training stopped "
                f"before the optimizer applied it (the model holds the weights of step {step - 1}); lower the learning "
                "rate, set max_grad_norm, or train in bf16/fp32 instead of fp16"
            )
