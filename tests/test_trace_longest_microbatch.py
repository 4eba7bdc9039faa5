"""The environment probe's check of the run's longest microbatch (hf_unlearn.trace.longest_microbatch): recorded with
the run, re-run in the deleting process, and what it catches that the probed steps do not."""

from __future__ import annotations

import json

import pytest
import torch

from .test_trace_common import config_model, get_trace_data, record


def _recorded(tmp_path, attn: str | None = None):
    """A tiny GQA Llama (SDPA, or ``attn``), 32 TOFU rows, 4 steps of 2 microbatches, checkpoints at 0, 2 and 4,
    proven when it ends; its longest microbatch (109 tokens) is in step 3, which no checkpoint starts."""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    model = config_model("llama", tok, **({"attn_implementation": attn} if attn else {}))
    record(tok, data.select(range(8, 40)), tmp_path, model=model, every=2)
    run = open_run(tmp_path / "trace")
    assert run.header["model"].get("attn_implementation") == (attn or "sdpa")
    return run


class _NegAtLength:
    """``aten::neg`` (rotary embeddings negate half of every query and key) registered for the CPU: exact negation,
    except on tensors whose second-to-last dimension (the sequence) is ``length``, which it halves. Code no seal is
    told about here (the test bypasses the code seal): what only the probe can catch."""

    def __init__(self, length: int):
        self.length = length

    def __enter__(self):
        import warnings

        def neg(x):
            if x.dim() >= 2 and x.shape[-2] == self.length:
                return torch.mul(x, -0.5)
            return torch.mul(x, -1)

        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            self.lib.impl("neg", neg, "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()


def test_the_recording_keeps_its_longest_microbatchs_digests_and_the_probe_reruns_it(tmp_path):
    """The run's longest microbatch is in a later step than 0: the recording keeps what the engine computes for it
    alone from the step-0 checkpoint; a probe in an unchanged process re-runs it (and step 0) and passes, reporting
    it, instead of a second whole step; a deletion's output run does not inherit it (its rows are not the
    recording's)."""
    from hf_unlearn.trace import longest_microbatch, proof

    run = _recorded(tmp_path)
    entry = longest_microbatch.chosen(run)
    assert entry is not None and entry.step > 0
    kept = run.header["fidelity"][longest_microbatch.KEY]
    assert kept["step"] == entry.step and kept["tokens"] == max(entry.lens) == max(max(e.lens) for e in run.plan)
    assert len(kept["g"]) == len(kept["s"]) == 16
    assert proof.probe_steps(run) == [0, 2]  # and a kept checkpoint's step: a shape between them, from a later state
    lines = []
    probed = proof.probe_environment(run.path, log=lines.append)
    assert probed["steps"] == [0, 2] and probed["longest_microbatch"]["step"] == entry.step
    assert any("longest microbatch" in line for line in lines)
    del run.header["fidelity"][longest_microbatch.KEY]  # a run recorded without it: the probe as before
    assert not longest_microbatch.applies(run) and proof.probe_steps(run) == [0, 2]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_code_acting_only_at_the_longest_microbatchs_length_is_refused_by_the_probe(tmp_path, monkeypatch, attn):
    """A kernel that computes otherwise only at the padded length of the run's longest microbatch, present in the
    deleting process only, with the code seal bypassed (standing for any channel no seal names): step 0 re-run
    matches, and the probe still refuses, naming the longest microbatch; without the kernel it passes. With SDPA
    and with eager attention (the replay rebuilds the model with the recorded implementation)."""
    from hf_unlearn.trace import longest_microbatch, proof
    from hf_unlearn.trace.proven import ProofError

    run = _recorded(tmp_path, attn)
    entry = longest_microbatch.chosen(run)
    length = max(entry.lens)
    assert all(max(e.lens) < length for e in run.plan if e.step == 0)
    monkeypatch.setattr(proof, "code_checked", lambda run: {"compared": 0, "why": "bypassed by the test"})
    with _NegAtLength(length):
        assert proof._run_interval(run, 0, 1) is None  # step 0 alone does not see it
        with pytest.raises(ProofError) as e:
            proof.probe_environment(run.path)
    message = str(e.value)
    assert "longest microbatch" in message and f"optimizer step {entry.step}" in message
    assert f"{length} tokens to a row as padded" in message and "\n" not in message
    assert proof.probe_environment(run.path)["longest_microbatch"]["tokens"] == length


def test_the_longest_microbatch_is_not_rerun_where_it_proves_nothing_more(tmp_path):
    """Its step is step 0 (the probe re-runs it whole), or the run is a compacted one or multi-process: none."""
    import dataclasses

    from hf_unlearn.trace import longest_microbatch

    run = _recorded(tmp_path)
    entry = longest_microbatch.chosen(run)
    moved = [dataclasses.replace(e, step=0) if e.mb == entry.mb else e for e in run.plan]
    assert longest_microbatch.chosen(dataclasses.replace(run, plan=moved)) is None
    assert longest_microbatch.chosen(dataclasses.replace(run, header={**run.header, "world_size": 2})) is None
    header = json.loads((run.path / "header.json").read_text())
    assert header["fidelity"][longest_microbatch.KEY]["microbatch"] == entry.mb


def test_a_run_recorded_without_it_gets_it_from_trace_prove(tmp_path):
    """``trace_self_check=False`` keeps no digests of the longest microbatch (the probe runs its second whole step
    instead); ``trace prove``, which reproduces the whole run here, takes and seals them; a second proof keeps them."""
    from hf_unlearn.trace import longest_microbatch, open_run, proof

    tok, data = get_trace_data()
    record(tok, data.select(range(8, 40)), tmp_path, model=config_model("llama", tok), every=2,
           trainer_kwargs={"trace_self_check": False})
    run = open_run(tmp_path / "trace")
    assert longest_microbatch.KEY not in (run.header.get("fidelity") or {})
    assert proof.prove(run.path, progress=False)["proven"]
    kept = open_run(run.path).header["fidelity"][longest_microbatch.KEY]
    assert kept["step"] == 3 and kept["tokens"] == 109
    assert proof.probe_environment(run.path)["longest_microbatch"]["step"] == 3
    proof.prove(run.path, progress=False)
    assert open_run(run.path).header["fidelity"][longest_microbatch.KEY] == kept


def test_a_dpo_runs_longest_microbatch_is_its_longest_pair_row_and_the_probe_passes(tmp_path):
    """A DPO run's plan lengths hold both rows of a pair (the chosen one's above 32 bits): the longest microbatch is
    the one with the longest row of either kind, named in tokens; an unchanged process's probe re-runs it and
    passes (the reference model's forward included)."""
    from hf_unlearn.trace import longest_microbatch, open_run, proof
    from hf_unlearn.trace.preference import pair_rows

    from .test_trace_dpo import pairs, record_dpo

    tok, data = pairs(n=16)
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base")
    run = open_run(tmp_path / "rec" / "trace")
    entry = longest_microbatch.chosen(run)
    padded = {e.mb: max(r for n in e.lens for r in pair_rows(n)) for e in run.plan}  # chosen and rejected rows alike
    assert entry is not None and padded[entry.mb] == max(padded.values()) < 1000
    kept = run.header["fidelity"][longest_microbatch.KEY]
    assert kept["tokens"] == padded[entry.mb] and kept["step"] == entry.step
    assert proof.probe_environment(run.path)["longest_microbatch"]["tokens"] == padded[entry.mb]


def test_the_longest_microbatch_is_the_longest_as_collated_padded_or_flattened(tmp_path):
    """Padded, a microbatch's sequence is its longest row; flattened (padding_free, packing), all of its rows: the
    one chosen is the longest as the model sees it (rows of 50 and 17 tokens are 67 flattened, less than 43 and 43)."""
    import dataclasses

    from hf_unlearn.trace import longest_microbatch

    run = _recorded(tmp_path)
    plan = [dataclasses.replace(e, lens=lens) for e, lens in zip(run.plan[:3], ([5, 5], [50, 17], [43, 43]))]
    plan[1], plan[2] = dataclasses.replace(plan[1], step=1, mb=1), dataclasses.replace(plan[2], step=2, mb=2)
    padded = dataclasses.replace(run, plan=plan)
    flat = dataclasses.replace(padded, header={**run.header, "training_args": {
        **run.header["training_args"], "padding_free": True}})
    assert longest_microbatch.chosen(padded).mb == 1 and longest_microbatch.padded_length(padded, plan[1]) == 50
    assert longest_microbatch.chosen(flat).mb == 2 and longest_microbatch.padded_length(flat, plan[2]) == 86


def test_a_deletions_output_uses_the_digests_only_where_its_longest_microbatch_is_untouched(tmp_path):
    """``forget`` of a row outside the longest microbatch: the output run (``OUT/replay``, which a next deletion starts
    from) keeps the digests and its probe re-runs that microbatch; a row of the longest microbatch deleted: its batch
    is not the recording's, and the output's probe runs its two steps alone. Another step-0 checkpoint (a pipeline
    stage from a new parent) is not the digests' start either."""
    import dataclasses

    from hf_unlearn import forget
    from hf_unlearn.trace import longest_microbatch, open_run, proof

    run = _recorded(tmp_path / "a")
    entry = longest_microbatch.chosen(run)
    elsewhere = [i for i in run.ids_at_steps([1]) if i not in run.ids_at_steps([entry.step])][:1]
    forget(run.path, elsewhere, tmp_path / "out1", progress=False)
    kept = open_run(tmp_path / "out1" / "replay")
    assert longest_microbatch.applies(kept)
    assert proof.probe_environment(kept.path)["longest_microbatch"]["step"] == entry.step
    moved = dataclasses.replace(kept, header={**kept.header, "fidelity": {**kept.header["fidelity"], longest_microbatch.KEY: {
        **kept.header["fidelity"][longest_microbatch.KEY], "start_root": "0" * 64}}})
    assert not longest_microbatch.applies(moved)
    inside = run.ids_at_steps([entry.step])  # the longest microbatch's step: its rows
    forget(run.path, inside[:1] if entry.j == 0 else inside[-1:], tmp_path / "out2", progress=False)
    touched = open_run(tmp_path / "out2" / "replay")
    assert not longest_microbatch.applies(touched) and "longest_microbatch" not in proof.probe_environment(touched.path)
