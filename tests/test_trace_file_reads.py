"""Code a replay runs again (a trainer subclass's ``compute_loss``, a recorded callback) whose behaviour follows a file
it reads while training: the recording notes the files the run's own code read (keyed digests of their content), and a
deleting process where one is missing or holds other content is refused before any compute. Before, a loss weight
read from a file from step 5 on, changed to 0.5 before the deletion, gave a VERIFIED step-5 deletion with every tensor
off the counterfactual of the program the user ran (replay and oracle both read 0.5; the environment probe re-ran
step 0 only, which reads no file)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Trainer

from .test_trace_common import config_model, get_trace_data, labels_masked, recorded_normalisers_trainer, train_args

LATE = 5
KW = dict(gradient_accumulation_steps=1, max_steps=6)


class WeightFromFile(Trainer):
    """A user's trainer whose loss is scaled, from optimizer step 5 on, by a weight it reads from a file (named by a
    JSON constructor argument: the replay rebuilds it)."""

    def __init__(self, *args, weight_file: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_file = weight_file

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step >= LATE:
            w = float(Path(self.weight_file).read_text())
            out = (out[0] * w, out[1]) if return_outputs else out * w
        return out


def _record(tmp_path, weight_file, cls=WeightFromFile, **kw):
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import trace_recording

    tok, data = get_trace_data()
    data = data.select(range(24))
    trace_recording(cls)(model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW),
                         train_dataset=data, data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                         trace_checkpoint_retention="even", weight_file=str(weight_file), **kw).train()
    return tok, data, tmp_path / "rec" / "trace"


def _counterfactual_differs(tok, data, run, ids, out):
    """The oracle's tensors that differ from a plain Trainer running the same class with the file as recorded (1.0),
    the deleted rows' labels -100 and the recorded normalisers (no replay engine)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    weight = out / "weight-as-recorded.txt"
    weight.write_text("1.0")
    model = config_model("llama", tok)
    recorded_normalisers_trainer(run, base=WeightFromFile)(
        model=model, args=train_args(out / "plain", **KW), train_dataset=labels_masked(data, ids),
        data_collator=_DropIds(QACollator.from_tokenizer(tok)), weight_file=str(weight)).train()
    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = model.state_dict()
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
