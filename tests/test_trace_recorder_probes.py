"""The recorder's checks at construction run the user's collator and ``compute_loss``: they must catch a loss that
couples the rows of a microbatch, and leave nothing behind that changes what the recorded run trains on."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

from hf_unlearn.errors import UnlearnError

from .test_trace_common import get_trace_data, tiny, train_args

KW = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=3, warmup_steps=0)


class _OwnNormaliser(Trainer):
    """Summed token cross-entropy over a normaliser the microbatch gives (:meth:`tokens`)."""

    def tokens(self, inputs):
        raise NotImplementedError

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                             reduction="sum")
        loss = ce / self.tokens(inputs)
        return (loss, outputs) if return_outputs else loss


class NonPadNormaliser(_OwnNormaliser):
    """Divides by the microbatch's tokens that are not the pad token, counted on ``input_ids``: a deleted row keeps
    its tokens in the counterfactual (labels masked) and a replay's dummy is pad tokens, so the other rows' weight
    differs."""

    def tokens(self, inputs):
        return (inputs["input_ids"] != self.processing_class.pad_token_id).sum()


class AttentionNormaliser(_OwnNormaliser):
    """Divides by the attention mask's tokens: a dummy has the deleted row's full mask, so nothing is re-weighted."""

    def tokens(self, inputs):
        return inputs["attention_mask"].sum()


class EosCountNormaliser(_OwnNormaliser):
    """Divides by the microbatch's sequences, counted by their end-of-sequence tokens on ``input_ids`` (a per-sequence
    mean, as packing users write it): a deleted row keeps its EOS in the counterfactual, a replay's dummy has none."""

    def tokens(self, inputs):
        return (inputs["input_ids"] == self.processing_class.eos_token_id).sum().clamp(min=1)


class ClampedMicrobatchMean(Trainer):
    """A per-microbatch token mean with no normaliser (``model_accepts_loss_kwargs = False``: the ``Trainer`` divides
    by the accumulation steps itself), clamped so that a microbatch with no labelled token gives 0, not NaN."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                             reduction="sum")
        loss = ce / (targets != -100).sum().clamp(min=1)
        return (loss, outputs) if return_outputs else loss


class PythonRandomScale(Trainer):
    """A loss scaled by a draw from Python's ``random`` (seeded by the Trainer's ``set_seed``: the program is
    deterministic)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        scale = 0.5 + random.random()
        return (out[0] * scale, out[1]) if return_outputs else out * scale


def _trainer(cls, tok, data, out, recorded: bool):
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import trace_recording

    if recorded:
        return trace_recording(cls)(model=tiny(tok), args=train_args(out, **KW), train_dataset=data,
                                    processing_class=tok, data_collator=QACollator.from_tokenizer(tok),
                                    trace_checkpoint_steps=3)
    return cls(model=tiny(tok), args=train_args(out, **KW), train_dataset=data, processing_class=tok,
               data_collator=_DropIds(QACollator.from_tokenizer(tok)))


def test_a_loss_normalised_by_the_microbatchs_non_pad_tokens_is_refused_at_construction(tmp_path):
    """Attack: a ``compute_loss`` dividing by the non-pad tokens counted on ``input_ids``. The dummy's own gradient
    is zero (the normaliser is not differentiable), so the probe passed, and a step-0, a step-3 and a step-5 deletion
    were VERIFIED with every tensor off the plain ``Trainer`` counterfactual (the deleted row's tokens counted in its
    normaliser, the dummy's pad tokens not). Now the probe compares a row's gradient beside the dummy with its
    gradient beside a row whose labels are masked, and refuses before training, naming the cause."""
    tok, data = get_trace_data()
    with pytest.raises(UnlearnError, match="weights a row by what the other rows of its microbatch hold.*input_ids"):
        _trainer(NonPadNormaliser, tok, data.select(range(8)), tmp_path / "rec", recorded=True)
    assert not (tmp_path / "rec" / "trace").exists()


def test_a_loss_normalised_by_the_count_of_end_of_sequence_tokens_is_refused_at_construction(tmp_path):
    """Attack: a per-sequence mean counted by the EOS tokens of ``input_ids``. The coupling probe ran on a window of
    8 tokens, which holds no EOS, so both of its microbatches looked alike, and a step-1 deletion was VERIFIED with
    63 tensors off the counterfactual. The coupling check now runs on the whole row."""
    tok, data = get_trace_data()
    assert tok.eos_token_id in data[0]["input_ids"]  # the rows end with it, as SFT rows do
    with pytest.raises(UnlearnError, match="weights a row by what the other rows of its microbatch hold"):
        _trainer(EosCountNormaliser, tok, data.select(range(8)), tmp_path / "rec", recorded=True)


def test_a_step_deleted_whole_under_a_clamped_mean_with_no_normaliser_steps_as_the_plain_run(tmp_path):
    """Attack: a per-microbatch mean with no normaliser, clamped (a microbatch with no labelled token gives 0), and
    every row of step 1 deleted. The plain ``Trainer`` with those labels masked steps AdamW on zero gradients; the
    replay skipped the step (it took every loss with no normaliser for a NaN mean), and the deletion was VERIFIED
    with every tensor off, the AdamW step counts too. The recording's probe now finds such a loss finite on a
    microbatch of dummies (sealed in the header), and replays run it and step."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_common import delete, labels_masked

    tok, data = get_trace_data()
    data = data.select(range(8))
    _trainer(ClampedMicrobatchMean, tok, data, tmp_path / "rec", recorded=True).train()
    run = tmp_path / "rec" / "trace"
    assert open_run(run).header["trainer"]["dummies_only_loss"] == "finite"
    forget = open_run(run).ids_at_steps([1])
    assert len(forget) == KW["per_device_train_batch_size"]  # the whole step
    assert delete(run, forget, tmp_path / "del")[1]["verified"]
    model = tiny(tok)
    plain = ClampedMicrobatchMean(model=model, args=train_args(tmp_path / "plain", **KW),
                                  train_dataset=labels_masked(data, forget), processing_class=tok,
                                  data_collator=_DropIds(QACollator.from_tokenizer(tok)))
    plain.train()
    oracle = load_state(tmp_path / "del" / "oracle")
    assert not [n for n, t in oracle["model"].items() if not torch.equal(t, model.state_dict()[n])]
    assert {float(s["step"]) for s in oracle["optimizer"]["state"].values()} == {3.0}  # stepped at step 1 too


@pytest.mark.slow  # a recording, a deletion and a plain counterfactual (about 15 s)
def test_a_loss_normalised_by_the_attention_mask_records_and_deletes_as_the_counterfactual(tmp_path):
    """The control: the same loss over the attention mask's tokens (the dummy keeps the deleted row's full mask)
    passes the probe, and a step-1 deletion is VERIFIED and equal to the plain ``Trainer`` with the row's labels
    masked."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_common import delete, labels_masked, recorded_normalisers_trainer

    tok, data = get_trace_data()
    data = data.select(range(8))
    _trainer(AttentionNormaliser, tok, data, tmp_path / "rec", recorded=True).train()
    run = tmp_path / "rec" / "trace"
    forget = open_run(run).ids_at_steps([1])[:1]
    assert delete(run, forget, tmp_path / "del")[1]["verified"]
    model = tiny(tok)
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds

    recorded_normalisers_trainer(run, base=AttentionNormaliser)(
        model=model, args=train_args(tmp_path / "plain", **KW), train_dataset=labels_masked(data, forget),
        processing_class=tok, data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
    oracle = load_state(tmp_path / "del" / "oracle")["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, model.state_dict()[n])]


def test_the_checks_at_construction_leave_pythons_random_stream_alone(tmp_path):
    """Attack: a loss drawing from Python's ``random``. The dummy-weight probe ran ``compute_loss`` twice after the
    Trainer's ``set_seed`` and gave back torch's RNG only, so the recorded run trained another model than the same
    program without the recorder (all 21 tensors off; equal to the plain program with two extra draws). The
    construction checks give back Python's and numpy's streams too: the recording equals the plain program."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(8))
    _trainer(PythonRandomScale, tok, data, tmp_path / "rec", recorded=True).train()
    recorded = load_checkpoint(open_run(tmp_path / "rec" / "trace").final_checkpoint())["model"]
    plain = _trainer(PythonRandomScale, tok, data, tmp_path / "plain", recorded=False)
    plain.train()
    state = plain.model.state_dict()
    assert not [n for n, t in recorded.items() if not torch.equal(t, state[n])]


def test_a_parametrized_model_is_refused_at_construction(tmp_path):
    """Attack: an identity ``torch.nn.utils.parametrize`` registered on one projection before training. A replay
    rebuilds the model from its class and config, without it: the recording trained to the end and its proof died
    in ``load_state_dict`` (missing ``...up_proj.weight``, unexpected ``...parametrizations.weight.original``), a
    traceback. Now refused at construction in one line naming the module and what to do."""
    from torch.nn.utils import parametrize

    class Same(torch.nn.Module):
        def forward(self, x):
            return x

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    model = tiny(tok)
    parametrize.register_parametrization(model.model.layers[0].mlp.up_proj, "weight", Same())
    with pytest.raises(UnlearnError, match=r"parametrize is registered on 1 module\(s\) \(model.layers.0.mlp.up_proj.weight"):
        TraceRecordingTrainer(model=model, args=train_args(tmp_path / "rec", **KW), train_dataset=data.select(range(8)),
                              data_collator=QACollator.from_tokenizer(tok))
    assert not (tmp_path / "rec" / "trace").exists()
