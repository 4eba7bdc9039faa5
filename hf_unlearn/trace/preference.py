"""Exact deletion for TRL's ``DPOTrainer``: the deleted pair's dummy, the loss types whose dummy has weight 0, and
what a recording refuses (see :mod:`hf_unlearn.trace.reference` for the reference model).

``trace_recording(DPOTrainer)`` records a DPO run like any other: the store holds DPOTrainer's prepared rows
(``prompt_ids``, ``chosen_ids``, ``rejected_ids`` and the id), one slot per preference pair. A deleted pair's slot is
filled by a **dummy pair of the pair's own row lengths**: its chosen row has the deleted pair's ``prompt + chosen``
tokens and its rejected row ``prompt + rejected`` tokens, all the dummy token, and the replay's collator
(:class:`PairDummyCollator` around the run's own) zeroes the ``completion_mask`` of both rows. The plan records both
row lengths of every pair (:func:`pair_code`), so

* its labels are all ``-100``: TRL's fused LM head fills the log-probabilities of unlabelled positions with exactly 0
  through ``masked_fill`` (whose gradient there is exactly 0), so the pair's policy and reference log-probabilities are
  the constant 0, every score of the pair is a constant, and its per-pair loss has a gradient that is *structurally*
  zero (zeros multiplied through, no cancellation of two non-zero terms);
* every row keeps its length, so the collated batch keeps its shape **and its padding**: every other pair's
  computation is bit-identical. The padding matters: with grouped-query attention and SDPA, ``transformers`` runs a
  microbatch without any padded row through SDPA's GQA kernel without a mask, and one with a padded row through a
  masked kernel on repeated key/value heads; the two agree only to the last bits, so a dummy that changed which rows
  are padded (runs recorded before, whose dummy pair was prompt-only, as long as the longer row) changes the other
  pairs' gradients in the last bits;
* it keeps its slot: the per-microbatch mean over pairs divides by the same number of pairs (the recorded slots), and
  ``Trainer`` divides by the recorded accumulation steps. DPO's loss ignores ``num_items_in_batch``, so these two
  are the run's whole normaliser.

This holds for every loss type whose per-pair loss is a function of that pair's log-probabilities alone and is
averaged over pairs (:data:`PER_PAIR_LOSS_TYPES`). The others are refused by name (:data:`REFUSED_LOSS_TYPES`), as are
options that tie pairs or steps together. The probe at construction and the per-microbatch check of every replay
(:mod:`hf_unlearn.trace.dummies`) stop on any dummy that gets a gradient.

Online trainers that generate (GRPO, RLOO, PPO, online DPO, ...) are refused before any compute: see
:func:`refuse_online`.
"""

from __future__ import annotations

import contextlib
import copy
import json

import torch

from ..errors import UnlearnError
from .dtensors import model_is_sharded
from .dummies import DummyGradientWatch, dummy_positions
from .guards import program_hooks
from .lineage import ADAPTER
from .reference import (
    KEY,
    PRIVATE_SOURCE,
    REFERENCE_DIR,
    describe_reference,
    load_reference_model,
    reference_fingerprint,
    reference_root,
    save_reference,
)
from .rng import all_seeded
from .stack import pinned_stack, stack_change
from .trainers import bound_arguments

# Per-pair losses averaged over the microbatch's pairs: a prompt-only dummy pair contributes a constant (all its
# log-probabilities are 0, so chosen and rejected scores, their difference and any per-pair length normalisation are
# constants) and keeps its place in the mean's denominator.
PER_PAIR_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                       "apo_down", "discopop", "sigmoid_norm")
REFUSED_LOSS_TYPES = {
    "aot": "it sorts the log-ratio differences of all pairs in the microbatch and pairs them by rank, so a deleted pair's "
           "dummy changes which pairs every other pair is compared with",
    "aot_unpaired": "it sorts chosen and rejected log-ratios across the microbatch and pairs them by rank, so a deleted "
                    "pair's dummy changes every other pair's partner",
    "sft": "its NLL is a mean over every chosen completion token of the microbatch, so deleting a pair changes the "
           "weight of every other pair's tokens (a normaliser the slots do not fix)",
}
# DPOConfig settings a replay cannot reproduce, with the reason (checked on the config before any compute)
REFUSED_OPTIONS = {
    "precompute_ref_log_probs": "the reference log-probabilities are computed into the dataset in batches when the "
                                "trainer is built; a replay with another reference (a pipeline stage) would use stale "
                                "ones; leave it False (the reference forward runs in each step)",
    "sync_ref_model": "the reference is mixed with the policy during training (TR-DPO), a state no checkpoint holds",
}
# Trainers that train on completions sampled from the model being trained (class names, TRL and TRL experimental).
ONLINE_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer", "NashMDTrainer", "XPOTrainer",
                   "GKDTrainer", "AsyncGRPOTrainer", "GOLDTrainer", "MiniLLMTrainer", "DistillationTrainer",
                   "AsyncDistillationTrainer", "ServerDistillationTrainer")
# the TRL trainers a recording knows (their data preparation, loss and dummy rows); another TRL trainer is refused
# when trace_recording() is called, with why where it is known
KNOWN_TRL_TRAINERS = ("SFTTrainer", "DPOTrainer", "_BaseTrainer", "BaseTrainer")
UNKNOWN_TRL_TRAINERS = {
    "KTOTrainer": "its loss's KL baseline pairs each prompt with the completion of another row of its batch, so "
                  "deleting a row changes the other rows' terms, which no dummy row keeps",
    "RewardTrainer": "it tokenizes, pads and pools its pairs its own way, which the recorder's dummy pair does not "
                     "reproduce",
}
DPO_TRAINER = "DPOTrainer"
RECORDING_MIXIN = "RecordingHooks"  # hf_unlearn.trace.recorder's hooks, whose dataset preparation DPO's skips
STORE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


# DPOTrainer attributes (and DPOConfig fields) its loss reads at every step: set from the config at construction, so a
# replay rebuilds them from the recorded config. A callback that changes one while recording (a beta schedule, a
# swapped reference) trains on a loss no replay runs: watched at every microbatch of a recording.
LOSS_SETTINGS = ("beta", "label_smoothing", "loss_types", "loss_weights", "ld_alpha", "f_divergence_type",
                 "f_alpha_divergence_coef", "use_weighting", "precompute_ref_logps", "aux_loss_enabled",
                 "router_aux_loss_coef", "ref_model")


def loss_settings(trainer) -> dict:
    """What :data:`LOSS_SETTINGS` (and ``args.discopop_tau``) hold now; the reference by its object identity."""
    out = {n: repr(getattr(trainer, n, None)) for n in LOSS_SETTINGS if n != "ref_model"}
    out["ref_model"] = f"object {id(trainer.ref_model):#x}"
    out["args.discopop_tau"] = repr(getattr(trainer.args, "discopop_tau", None))
    return out


def refuse_online(trainer_cls) -> None:
    """Refuse, before any compute, a trainer that generates its own training data from the model being trained."""
    names = {c.__name__ for c in getattr(trainer_cls, "__mro__", ())}
    found = next((n for n in ONLINE_TRAINERS if n in names), None)
    if found:
        raise UnlearnError(
            f"{trainer_cls.__qualname__} ({found}) cannot be recorded for exact deletion: it trains on completions it "
            "samples from the model being trained, so each step's data depends on the weights every earlier step "
            "produced; deleting a prompt changes those weights and hence every completion sampled after it (for every "
            "other prompt too), so the recorded plan is not the plan of the run without that prompt and no fixed-plan "
            "replay can reproduce it. Record offline trainers (SFTTrainer, DPOTrainer on a fixed preference dataset)")


def refuse_unknown_trl(trainer_cls) -> None:
    """Refuse, before any compute, a TRL trainer other than those a recording knows (:data:`KNOWN_TRL_TRAINERS`):
    its data preparation and loss are its own (TRL's KTO and reward trainers crashed deep in construction)."""
    found = next((c.__name__ for c in getattr(trainer_cls, "__mro__", ()) if c.__module__.startswith("trl.")
                  and c.__name__ not in KNOWN_TRL_TRAINERS), None)
    if found:
        why = UNKNOWN_TRL_TRAINERS.get(found, "hf_unlearn does not know its data preparation and loss")
        name = trainer_cls.__qualname__ + (f" ({found})" if found != trainer_cls.__qualname__ else "")
        raise UnlearnError(f"{name} cannot be recorded for exact deletion: {why}. Record "
                           "transformers' Trainer, TRL's SFTTrainer or DPOTrainer (or your subclass of one of them)")


def is_dpo(trainer_cls) -> bool:
    """Whether ``trainer_cls`` is TRL's ``DPOTrainer`` or a subclass of it."""
    return any(c.__name__ == DPO_TRAINER and c.__module__.startswith("trl.") for c in getattr(trainer_cls, "__mro__", ()))


def dpo_refusal(args) -> str | None:
    """Why a replay cannot reproduce a DPO run with this ``DPOConfig`` (one line), or None."""
    loss_types = list(getattr(args, "loss_type", None) or ["sigmoid"])
    for loss_type in loss_types:
        if loss_type in REFUSED_LOSS_TYPES:
            return f"loss_type={loss_type!r}: {REFUSED_LOSS_TYPES[loss_type]}"
        if loss_type not in PER_PAIR_LOSS_TYPES:
            return (f"loss_type={loss_type!r} is not one whose deleted pair is known to have weight 0 "
                    f"(supported: {', '.join(PER_PAIR_LOSS_TYPES)})")
    for option, why in REFUSED_OPTIONS.items():
        if getattr(args, option, False):
            return f"{option}=True: {why}"
    return None


# A run's plan records each pair's slot length as pair_code(): both row lengths (header dataset.pair_rows). Runs recorded
# before hold the longer row's length, whose dummy is prompt-only (both rows that long).
PAIR_ROWS = "pair_rows"
_ROW_BITS = 32
DUMMY_KEY = "__hf_unlearn_dummy_pair__"  # marks a dummy pair for PairDummyCollator (never reaches the run's collator)


def pair_length(row: dict) -> int:
    """The slot length of a preference pair: its longer sequence (prompt + chosen or prompt + rejected)."""
    prompt = len(row["prompt_ids"])
    return prompt + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


def pair_code(row: dict) -> int:
    """The plan's length of a pair: its chosen row's length (+1, so no code is a plain length) above 32 bits, its
    rejected row's below; :func:`pair_rows` reads it back (a plain length: both rows that long)."""
    prompt = len(row["prompt_ids"])
    return ((prompt + len(row["chosen_ids"]) + 1) << _ROW_BITS) | (prompt + len(row["rejected_ids"]))


def pair_rows(code: int) -> tuple[int, int]:
    """``(chosen row length, rejected row length)`` of a plan length (:func:`pair_code`, or a run's older plain one)."""
    high = code >> _ROW_BITS
    return (code, code) if high == 0 else (high - 1, code & ((1 << _ROW_BITS) - 1))


def dummy_pair(template: dict, length: int, dummy_token_id: int, id_column: str) -> dict:
    """The pair that fills a deleted slot: rows of the lengths ``length`` codes (:func:`pair_rows`), all dummy tokens,
    marked for :class:`PairDummyCollator`, which gives them no completion token. A plain length (an older run): the
    prompt-only pair, ``length`` dummy prompt tokens and no chosen nor rejected token."""
    chosen, rejected = pair_rows(length)
    prompt = min(chosen, rejected)
    row = {}
    for k, v in template.items():
        if k == id_column:
            continue
        if k == "prompt_ids":
            row[k] = [dummy_token_id] * prompt
        elif k == "chosen_ids":
            row[k] = [dummy_token_id] * (chosen - prompt)
        elif k == "rejected_ids":
            row[k] = [dummy_token_id] * (rejected - prompt)
        elif isinstance(v, list):
            row[k] = []
        else:
            row[k] = type(v)() if v is not None else None
    if length >> _ROW_BITS:
        row[DUMMY_KEY] = True
    return row


class PairDummyCollator:
    """The run's preference collator, with the completion mask of every dummy pair (both its rows) zeroed: the
    dummy keeps the deleted pair's row lengths, hence the microbatch's shape and padding, and has no completion
    token. Rows without the mark are collated as the run's collator collates them."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        marked = [k for k, f in enumerate(features) if f.get(DUMMY_KEY)]
        batch = self.collator([{k: v for k, v in f.items() if k != DUMMY_KEY} for f in features])
        if marked:
            mask = batch.get("completion_mask")
            if not torch.is_tensor(mask) or mask.shape[0] != 2 * len(features):
                raise UnlearnError("the run's preference collator gives no completion_mask of chosen rows then rejected "
                                   "rows (DataCollatorForPreference's layout): a deleted pair's dummy cannot be given "
                                   "weight 0; replay with the collator the run was recorded with")
            rows = torch.tensor(marked + [len(features) + k for k in marked])
            batch["completion_mask"] = mask.index_fill(0, rows, 0)
        return batch

    def __getattr__(self, name):  # the run's collator's settings (pad_token_id, max_length, ...)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


PROBE_PAIR = {"prompt_ids": 2, "chosen_ids": 2, "rejected_ids": 1}  # tokens the preflight's pair keeps of each


def probe_pair(row: dict) -> dict:
    """The pair the DPO preflight's two passes run on: ``row`` with the last :data:`PROBE_PAIR` tokens of its prompt
    and the first ones of its chosen and rejected completions (a real pair's tokens, chosen and rejected rows of
    unequal lengths when the pair's are; TRL's ``max_length`` truncation makes such pairs). What the passes compare is
    one pair's gradient beside two neighbours of its own row lengths (a deleted slot's dummy, a copy of itself), a
    property of the loss that does not depend on how long the pair is; each pass costs its tokens (a 75-token pair's
    two passes: 3.5 s CPU on SmolLM2-135M, 11 tokens: 1.0 s; on a CPU without native bf16, in fp32, 11 tokens: 2.1 s of a
    2.4 s construction, 7 tokens: about 0.6 s less). Rows of equal length stay equal. A row with other token columns
    (images, token types) is kept whole: cutting them consistently is the collator's business."""
    if set(row) != set(PROBE_PAIR) or not all(isinstance(row[k], list) and row[k] for k in PROBE_PAIR):
        return row
    whole = {k: len(row[k]) for k in ("chosen_ids", "rejected_ids")}
    keep = {k: min(n, PROBE_PAIR[k]) for k, n in whole.items()}
    if whole["chosen_ids"] == whole["rejected_ids"]:  # no padding in the pair: none in the probe's
        keep = dict.fromkeys(whole, min(whole["chosen_ids"], max(PROBE_PAIR["chosen_ids"], PROBE_PAIR["rejected_ids"])))
    elif keep["chosen_ids"] == keep["rejected_ids"]:
        longer = max(whole, key=whole.get)
        keep[longer] += 1  # it has more: the rows keep unequal lengths
    return {"prompt_ids": row["prompt_ids"][-PROBE_PAIR["prompt_ids"]:], **{k: row[k][:n] for k, n in keep.items()}}


def dummy_pair_has_weight(collator, row: dict) -> bool:
    """True unless the collator gives the dummy pair no completion token (weight exactly 0)."""
    mask = collator([dict(row)]).get("completion_mask")
    return mask is None or bool(torch.as_tensor(mask).any())


def is_start_root(policy) -> bool:
    """Whether the root of ``policy``'s adapter-disabled reference (:func:`reference_root`) is its lineage's start
    root (:func:`hf_unlearn.trace.lineage.weights_root` of its state as training starts): the same tensors under the
    same names, each tied one once, hashed by the same function, when the adapters are LoRA's ``lora_*`` tensors only
    (no ``modules_to_save`` copy nor ``original_module``) and no tensor is sharded (lineage gathers DTensors, every
    process joining). Then a recording takes it from there instead of hashing the base weights once more: when
    training starts, the weights the reference computes with from the first step on."""
    names = list(policy.state_dict())
    return not model_is_sharded(policy) and \
        [n for n in names if "lora_" not in n] == [n for n in names if not ADAPTER.search(n)]


class PreferenceTraceMixin:
    """The DPO parts of a recording (and of replays composed with it): put before :class:`TraceRecordingMixin` by
    :func:`hf_unlearn.trace.trace_recording` for ``trl.DPOTrainer`` and its subclasses."""

    _trace_machinery = True
    _trace_token_column = "prompt_ids"

    def __init__(self, *args, **kwargs):
        cls = type(self)
        base = next(c for c in cls.__mro__ if c.__name__ == DPO_TRAINER)
        bound = bound_arguments(base.__init__, args, kwargs)
        config = bound.get("args")
        why = dpo_refusal(config) if config is not None else None
        if why and not self._is_replay:
            raise UnlearnError(f"{base.__qualname__} cannot be recorded for exact deletion: {why}")
        super().__init__(*args, **kwargs)
        if getattr(self, "aux_loss_enabled", False) and not self._is_replay:
            raise UnlearnError(f"{base.__qualname__} cannot be recorded for exact deletion: the MoE router's "
                               "load-balancing loss is computed over every token of the microbatch, a deleted pair's "
                               "dummy included; set router_aux_loss_coef=0")
        if not self._is_replay:
            hooks = program_hooks(self.accelerator.unwrap_model(self.ref_model)) if self.ref_model is not None else []
            if hooks:  # a replay loads the reference from its files: without them
                raise UnlearnError(
                    f"{base.__qualname__} cannot be recorded for exact deletion: the reference model carries a hook "
                    f"or function a replay does not run ({hooks[0]}{f' and {len(hooks) - 1} more' if len(hooks) > 1 else ''}"
                    "), since it loads the reference from its files; remove it (a patch of the reference's class is "
                    "sealed with the run's code instead)")
            at_start = self.ref_model is None and is_start_root(self.accelerator.unwrap_model(self.model))
            self._trace_reference = describe_reference(self, given=bound.get("ref_model") is not None,
                                                       root_at_start=at_start)
        elif getattr(self, "run", None) is not None:
            self._drop_reference_adapter(self.run.header)
            if getattr(self, "_trace_reference_replaced", False):  # recorded into the replay's output run
                self._trace_reference = describe_reference(self, given=True)
            else:
                self._check_reference_computes_as_recorded(self.run.header)

    def _reference_fingerprint(self, header: dict) -> str | None:
        """:func:`~hf_unlearn.trace.reference.reference_fingerprint` of the reference this trainer holds, under the
        run's numeric stack (None: no separate reference model)."""
        if self.ref_model is None or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return None  # sharded: its forward is collective, and the recorder's header is written by one process
        with pinned_stack(header):
            return reference_fingerprint(self.accelerator.unwrap_model(self.ref_model))

    def _check_reference_computes_as_recorded(self, header: dict) -> None:
        """A replay's reference must compute the recorded log-probabilities bit for bit (its weights were checked by
        their root when loaded; this covers config, buffers, attributes and hooks): refused before any compute."""
        want = (header.get(KEY) or {}).get("forward_sha256")
        got = self._reference_fingerprint(header) if want else None
        if want and got != want:
            raise UnlearnError("the DPO reference model this replay holds has the recorded weights but does not compute "
                               "the recorded run's log-probabilities on the probe (another config, non-persistent "
                               "buffer, attention implementation or hook): a replay with it would not be this run's "
                               "counterfactual; give the replay the reference the run was trained against")

    def training_step(self, *args, **kwargs):
        start = getattr(self, "_trace_loss_settings", None)
        if start is not None and getattr(self, "_trace_loss_change", None) is None:
            now = loss_settings(self)
            changed = next((k for k in now if now[k] != start[k]), None)
            if changed:
                self._trace_loss_change = (
                    f"DPOTrainer's {changed} changed during training (before optimizer step {self.state.global_step}: "
                    f"{start[changed]} -> {now[changed]}; a callback?), so the run trained on a loss that no replay, "
                    "which rebuilds the trainer from the recorded config, runs")
        return super().training_step(*args, **kwargs)

    def _trace_changed_during_training(self) -> str | None:
        """Why the recording's loss settings or reference are not those it recorded when training started, or None."""
        if getattr(self, "_trace_loss_change", None):
            return self._trace_loss_change
        want = (self._trace_header.get("reference_model") or {}).get("forward_sha256")
        if want and self._reference_fingerprint(self._trace_header) != want:
            return ("the DPO reference model changed during training (its log-probabilities on the probe are not those "
                    "recorded when training started: a callback or hook edited it?), so no replay can load the "
                    "reference each step used")
        return None

    def _drop_reference_adapter(self, header: dict) -> None:
        """A replay hands DPOTrainer the PEFT model rebuilt from the run, and DPOTrainer, given a PEFT model without a
        reference, copies its adapter (here: the fresh one, before the checkpoint loads) into a "ref" adapter. The
        recording built the adapter from ``peft_config``, whose reference is the adapter disabled: remove the copy and
        restore the recorded trainable set."""
        model = self.accelerator.unwrap_model(self.model)
        record = header.get("reference_model") or {}
        if record.get("kind") != "adapter_disabled" or "ref" not in (getattr(model, "peft_config", None) or {}):
            return
        model.delete_adapter("ref")
        frozen = header["model"].get("frozen_parameters")
        if frozen is not None:
            frozen = set(frozen)
            for name, p in model.named_parameters(remove_duplicate=False):
                p.requires_grad_(name not in frozen)

    # ---- DPOTrainer's dataset preparation -----------------------------------------------------------------
    def _prepare_dataset(self, dataset, *args, **kwargs):
        if self._is_replay:  # the store holds DPOTrainer's prepared rows
            return dataset
        # DPOTrainer's own preparation, past TraceRecordingMixin's (SFT packing; found by name: the recording sits
        # above this module)
        mixin = next(c for c in type(self).__mro__ if c.__name__ == RECORDING_MIXIN)
        return super(mixin, self)._prepare_dataset(dataset, *args, **kwargs)

    # ---- the dummy pair (hooks of TraceRecordingMixin and the replays) -------------------------------------
    @property
    def data_collator(self):
        return self.__dict__.get("_trace_pair_collator")

    @data_collator.setter
    def data_collator(self, collator):
        """A replay collates with :class:`PairDummyCollator` around the run's collator (the dummy pair's mask)."""
        if self._is_replay and collator is not None and not isinstance(collator, PairDummyCollator):
            collator = PairDummyCollator(collator)
        self.__dict__["_trace_pair_collator"] = collator

    def _pair_rows_recorded(self) -> bool:
        """Whether the plan's lengths are :func:`pair_code` (a recording now, or a replay of a run recorded so)."""
        run = getattr(self, "run", None) if self._is_replay else None
        return run is None or bool((run.header.get("dataset") or {}).get(PAIR_ROWS))

    def _trace_row_lengths(self, served) -> list[int]:
        columns = [served[k] for k in STORE_COLUMNS]
        return [self._trace_row_length(dict(zip(STORE_COLUMNS, row))) for row in zip(*columns)]

    def _trace_row_length(self, row: dict) -> int:
        return pair_code(row) if self._pair_rows_recorded() else pair_length(row)

    def _trace_dummy_row(self, template: dict, length: int, token: int) -> dict:
        return dummy_pair(template, length, token, self.id_column)

    def _trace_dummy_has_weight(self, collator, row: dict) -> bool:
        collator = collator if isinstance(collator, PairDummyCollator) else PairDummyCollator(collator)
        template = {k: v for k, v in row.items() if k != DUMMY_KEY}
        coded = dummy_pair(template, pair_code({"prompt_ids": [0] * 2, "chosen_ids": [0] * 2, "rejected_ids": [0]}),
                           self.dummy_token_id, self.id_column)  # rows of unequal lengths, as most pairs have
        return dummy_pair_has_weight(collator, row) or dummy_pair_has_weight(collator, coded)

    def _trace_dummies_only_run(self, entry) -> bool:
        return True  # a dummy pair's per-pair loss is a constant: a microbatch of them is no NaN

    def _trace_masked_row(self, row: dict) -> dict | None:
        """The deleted pair as the counterfactual trains it: its tokens kept, both rows' completion masks zeroed (the
        mark :class:`PairDummyCollator` reads); None for a run recorded before pair rows (its dummy, prompt-only, has
        other row lengths than the pair)."""
        return {**row, DUMMY_KEY: True} if self._pair_rows_recorded() else None

    def _check_dummy_has_no_influence(self, row: dict) -> None:
        """DPOTrainer's loss on a real pair A beside a deleted slot's dummy pair D (A's own row lengths): the gradient
        at D's input embeddings (both of its rows) must be exactly zero, and the gradient at A's must be bit for bit
        the one A gets beside a real pair B of the same row lengths (a copy of A: the microbatch's shape and padding,
        so every kernel A's rows go through, are the same): a loss that couples the pairs of a microbatch (a mean over
        all completion or attention tokens, a count of non-empty pairs, a sort) re-weights A when its neighbour is
        deleted, which no zero gradient at D shows. Once, at construction, at the initial weights, on A's first tokens
        (:func:`probe_pair`)."""
        name = type(self).__mro__[0].__qualname__
        row = probe_pair(row)
        collator = PairDummyCollator(self.data_collator)
        dummy = dummy_pair(row, self._trace_row_length(row), self.dummy_token_id, self.id_column)
        marked = dummy_pair(row, self._trace_row_length(row), self.dummy_token_id + 1, self.id_column)
        collated = collator([dict(row), dummy])
        mask = dummy_positions(collated, collator([dict(row), marked])).to(self.args.device)
        watch = DummyGradientWatch(self.model, mask)
        beside_dummy = self._probe_gradient(collated, ~mask, watch)
        if bool(watch.flag):
            raise UnlearnError(f"{name}.compute_loss gives the dummy pair that replaces a deleted pair a gradient "
                               f"(largest |gradient| {float(watch.largest):.3g} at its input embeddings): a deleted "
                               "pair would not have weight 0; weight every term by the completion mask")
        pair = collator([dict(row), dict(row)])
        if beside_dummy is not None and not torch.equal(beside_dummy, self._probe_gradient(pair, ~mask)):
            raise UnlearnError(f"{name}.compute_loss weights a pair by what the other pairs of its microbatch hold (its "
                               "gradient beside a deleted pair's dummy is not the one beside a real pair of the same "
                               "row lengths): deleting a pair would re-weight the others, so a replay is not the run "
                               "without it; make the loss a mean over the microbatch's pairs of per-pair terms")

    def _probe_gradient(self, collated: dict, keep: torch.Tensor, *watches):
        """The gradient ``compute_loss`` gives the input embeddings at ``keep`` (eval mode, metrics untouched), with
        ``watches`` (context managers on the model) active; None if none reaches them."""
        name = type(self).__mro__[0].__qualname__
        model, training = self.model, self.model.training
        saved = copy.deepcopy(getattr(self, "_metrics", None))  # DPOTrainer logs metrics in compute_loss: not ours
        tokens = getattr(self, "_total_train_tokens", None)
        seen = _EmbeddingGradient(model, keep)
        try:
            model.eval()
            with contextlib.ExitStack() as stack:
                for w in (seen, *watches):
                    stack.enter_context(w)
                stack.enter_context(all_seeded(0))  # two calls compared: the same draws in each
                loss = self.compute_loss(model, self._prepare_inputs(collated))
                loss.backward()
        except UnlearnError:
            raise
        except Exception as e:  # noqa: BLE001 - the loss failed on a real pair and a dummy pair
            raise UnlearnError(f"{name}.compute_loss fails on a microbatch of a training pair and the dummy pair that "
                               f"replaces a deleted pair: {e}") from None
        finally:
            model.zero_grad(set_to_none=True)
            model.train(training)
            if saved is not None:
                self._metrics = saved
            if tokens is not None:
                self._total_train_tokens = tokens
        return seen.grad

    # ---- the reference model --------------------------------------------------------------------------------
    def _trace_header_dict(self, served, fingerprint, hazards, notes) -> dict:
        header = super()._trace_header_dict(served, fingerprint, hazards, notes)
        if self._trace_reference["params_root"] is None and (self._is_replay or getattr(self, "_trace_resume", None)):
            # no lineage computed as this training starts (a resume keeps the earlier one): hashed here
            policy = self.accelerator.unwrap_model(self.model)
            self._trace_reference["params_root"] = reference_root(policy)
        if self._trace_reference["kind"] != "adapter_disabled":
            self._trace_reference["forward_sha256"] = self._reference_fingerprint(header)
        if getattr(self, "_trace_resume", None) and (self.trace_dir / "header.json").is_file():
            self._check_resumed_reference(json.loads((self.trace_dir / "header.json").read_text()), header)
        if not self._is_replay:
            self._trace_loss_settings, self._trace_loss_change = loss_settings(self), None
        with pinned_stack(header):  # a reload's probe is compared with the one computed under the run's stack
            header["reference_model"] = save_reference(self._trace_reference, self.trace_dir)
        header["dataset"]["pairs"] = True
        if not self._is_replay:
            header["dataset"][PAIR_ROWS] = self._pair_rows_recorded()  # the plan's lengths are pair_code()
        return header

    def _trace_start_weights(self, header: dict) -> None:
        """The adapter-disabled reference's root is the lineage's start root, computed from the same state as
        training starts (:func:`is_start_root`): taken from it, not hashed again."""
        if self._trace_reference["params_root"] is None:
            self._trace_reference["params_root"] = header["lineage"]["start_root"]
            header["reference_model"]["params_root"] = header["lineage"]["start_root"]

    def _check_resumed_reference(self, previous: dict, header: dict) -> None:
        """A resumed recording must train against the reference its earlier steps used (every replay uses one for the
        whole run): its kind and params root, and its probe log-probabilities when the numeric stack is the same."""
        before, now = previous.get("reference_model") or {}, self._trace_reference
        fields = ["kind", "params_root"]
        if not stack_change(previous.get("numeric_stack"), header.get("numeric_stack")):
            fields.append("forward_sha256")
        changed = next((f for f in fields if f in before and before[f] != now.get(f)), None)  # (older runs: no sha)
        if changed:
            raise UnlearnError(f"{self.trace_dir} was recorded against another DPO reference model than the one it is "
                               f"resumed with ({changed} {str(before.get(changed))[:16]}..., now "
                               f"{str(now.get(changed))[:16]}...): a replay uses one reference for the whole run; "
                               "resume with the reference the earlier steps trained against")

    def _trace_replay_arguments(self, run, given: dict) -> dict:
        if "ref_model" in given:  # the caller's reference (a pipeline stage's new parent): see load_reference_model
            self._trace_reference_replaced = True
            return {}
        ref = load_reference_model(run)
        return {} if ref is None else {"ref_model": ref}


class _EmbeddingGradient(DummyGradientWatch):
    """While active, keeps the gradient that reaches the input embeddings' output at the positions of ``mask``."""

    grad = None

    def _seen(self, grad: torch.Tensor) -> None:
        if grad.shape[:2] == self.mask.shape:
            self.grad = grad[self.mask].detach().clone()


def check_trainer_class(cls) -> None:
    """Refuse, before any compute, a recording class a replay cannot follow (see :func:`refuse_online`), or a DPO
    trainer recorded without :class:`PreferenceTraceMixin` (a hand-made ``TraceRecordingMixin`` subclass)."""
    refuse_online(cls)
    if is_dpo(cls) and not issubclass(cls, PreferenceTraceMixin):
        raise UnlearnError(f"record {cls.__qualname__} with trace_recording(DPOTrainer), which adds the deleted "
                           "pair's dummy and the reference model's record (a hand-made TraceRecordingMixin subclass "
                           "does not)")


def replaced_reference(trainer, header: dict, out_dir) -> None:
    """A replay given ``ref_model=`` (a reference other than the recorded one): its output run records that reference
    (by weights and source, as a recording does) and the one it replaced, so a later request on it loads the right one."""
    if not getattr(trainer, "_trace_reference_replaced", False):
        return
    import shutil
    from pathlib import Path

    out_dir = Path(out_dir)
    shutil.rmtree(out_dir / REFERENCE_DIR, ignore_errors=True)
    out_dir.joinpath(*PRIVATE_SOURCE).unlink(missing_ok=True)
    before = (header.get(KEY) or {}).get("params_root")
    desc = trainer._trace_reference
    if desc["kind"] != "adapter_disabled":
        desc["forward_sha256"] = trainer._reference_fingerprint(header)
    with pinned_stack(header):  # a reload's probe is compared with the one computed under the run's stack
        header[KEY] = {**save_reference(desc, out_dir), "replaced_params_root": before}


def preference_mixins(trainer_cls) -> tuple:
    """The mixins :func:`~hf_unlearn.trace.trace_recording` puts before ``TraceRecordingMixin`` for ``trainer_cls``
    (refusing, before any compute, trainers that generate their own data)."""
    refuse_online(trainer_cls)
    refuse_unknown_trl(trainer_cls)
    return (PreferenceTraceMixin,) if is_dpo(trainer_cls) else ()
