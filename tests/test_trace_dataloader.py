"""Data loader worker processes, as users set them (``dataloader_num_workers``, ``dataloader_in_order=False``).

With workers the dataset's rows are read and collated in other processes; the recorder records what the training
loop receives, in the order it receives it. With ``dataloader_in_order=False`` that order is whichever batch a worker
finished first: the recorded order is the run's, and a deletion's counterfactual is the run in that order with the
deleted rows' labels -100. Each test builds that counterfactual with a plain ``Trainer`` (no replay engine) whose
sampler yields the recorded order.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Trainer

from hf_unlearn.data import QACollator

from .test_trace_common import (
    config_model,
    get_trace_data,
    labels_masked,
    record,
    recorded_normalisers_trainer,
    train_args,
)
from .test_trace_neutral_attacks import _forget_outcome

KW = dict(gradient_accumulation_steps=1, max_steps=6)


class SlowFirstBatchCollator(QACollator):
    """QA collation that takes a second over the microbatch holding row 0: with two workers and
    ``dataloader_in_order=False`` the next worker's batch is served first (the recorded order is not the sampler's)."""

    def __call__(self, features):
        if any(f.get("id") == 0 for f in features):
            time.sleep(1.0)
        return super().__call__(features)


def _counterfactual_in_recorded_order(tok, data, run, forget, order: list[int], out) -> dict:
    """A plain ``Trainer`` with the recorded normalisers whose sampler yields the rows in ``order`` (no workers)."""
    from hf_unlearn.demo import _DropIds

    base = recorded_normalisers_trainer(run, base=Trainer)

    class InRecordedOrder(base):
        def _get_train_sampler(self, train_dataset=None):
            return order

    model = config_model("llama", tok)
    InRecordedOrder(model=model, args=train_args(out, **KW), train_dataset=labels_masked(data, forget),
                    data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
    return model.state_dict()


@pytest.mark.parametrize("in_order", [pytest.param(True, marks=pytest.mark.slow), False])  # True: slow (budget)
def test_worker_processes_delete_as_the_run_in_its_recorded_order(tmp_path, in_order):
    """Two loader workers (in order, and out of order with one slow batch): a mid-run deletion is VERIFIED and equal
    to a plain Trainer fed the recorded order with the deleted row's labels -100."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(24))
    collator = (QACollator if in_order else SlowFirstBatchCollator).from_tokenizer(tok)
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), data_collator=collator,
           dataloader_num_workers=2, dataloader_in_order=in_order, **KW)
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    order = [i for s in range(KW["max_steps"]) for i in opened.ids_at_steps([s])]
    assert sorted(order) == list(range(24))  # ids are the rows' indices here
    sampler = [i for batch in torch.utils.data.BatchSampler(list(_seeded_permutation(24)), 4, False) for i in batch]
    if not in_order:  # the slow batch was served after the next worker's: not the sampler's order
        assert order != sampler, "the slow batch did not come late: the test did not exercise out-of-order loading"
    else:
        assert order == sampler
    ids = opened.ids_at_steps([3])[:1]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    plain = _counterfactual_in_recorded_order(tok, data, run, ids, order, tmp_path / "plain")
    off = [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual"


def _seeded_permutation(n: int) -> list[int]:
    """The order transformers' random sampler gives under ``seed=0`` (train_args' seed)."""
    g = torch.Generator()
    g.manual_seed(0)
    return torch.randperm(n, generator=g).tolist()
