"""Code a replay runs again (a trainer subclass's ``compute_loss``, a recorded callback) whose behaviour follows a file
it reads while training: the recording notes the files the run's own code read (keyed digests of their content), and a
deleting process where one is missing or holds other content is refused before any compute. Before, a loss weight
read from a file from step 5 on, changed to 0.5 before the deletion, gave a VERIFIED step-5 deletion with every tensor
off the counterfactual of the program the user ran (replay and oracle both read 0.5; the environment probe re-ran
step 0 only, which reads no file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerCallback

from .test_trace_common import config_model, get_trace_data, labels_masked, recorded_normalisers_trainer, train_args
from .test_trace_neutral_attacks import _forget_outcome

LATE = 5
KW = dict(gradient_accumulation_steps=1, max_steps=6)


class WeightFromFile(Trainer):
    """A user's trainer whose loss is scaled, from optimizer step 5 on (``from_step``), by a weight it reads from a
    file (named by a JSON constructor argument: the replay rebuilds it)."""

    def __init__(self, *args, weight_file: str = "", from_step: int = LATE, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_file, self.from_step = weight_file, from_step

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step >= self.from_step:
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


def _counterfactual_differs(tok, data, run, ids, out, *callbacks):
    """The oracle's tensors that differ from a plain Trainer running the same class with the file as recorded (1.0),
    the deleted rows' labels -100 and the recorded normalisers (no replay engine)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    weight = out / "weight-as-recorded.txt"  # the counterfactual's own copy (its reads are not a replay's)
    weight.write_text("1.0")
    model = config_model("llama", tok)
    recorded_normalisers_trainer(run, base=WeightFromFile)(
        model=model, args=train_args(out / "plain", **KW), train_dataset=labels_masked(data, ids),
        data_collator=_DropIds(QACollator.from_tokenizer(tok)), weight_file=str(weight),
        callbacks=list(callbacks)).train()
    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = model.state_dict()
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


class ReadsAround(TrainerCallback):
    """A recorded callback that reads, at every step, a numpy array of its own (``np.load``: noted), a model config
    through transformers (an installed package's read: not noted) and the files the run writes into its trace folder
    (not noted)."""

    def __init__(self, array_file: str = "", config_dir: str = ""):
        self.array_file, self.config_dir = array_file, config_dir

    def on_step_begin(self, args, state, control, **kwargs):
        from transformers import AutoConfig

        np.load(self.array_file)
        AutoConfig.from_pretrained(self.config_dir)
        trace = Path(args.output_dir) / "trace"
        for written in (trace / "header.json", trace / "wal.bin", trace / "progress.json"):  # wal.bin grows each step
            if written.exists():
                written.read_bytes()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 6-step run of the tiny Llama whose loss weight (1.0) is read from a file from step 5 on, with the callback."""
    tmp = tmp_path_factory.mktemp("file_reads")
    (tmp / "weight.txt").write_text("1.0")
    np.save(tmp / "array.npy", np.arange(3))
    tok, _ = get_trace_data()
    config_model("llama", tok).config.save_pretrained(tmp / "config")
    callback = ReadsAround(str(tmp / "array.npy"), str(tmp / "config"))
    tok, data, run = _record(tmp, tmp / "weight.txt", callbacks=[callback])
    return tok, data, run, tmp


def test_the_recording_notes_the_files_its_own_code_read_and_no_content(recorded):
    from hf_unlearn.trace import open_run

    _, _, run, tmp = recorded
    reads = open_run(run).header["fidelity"]["file_reads"]
    by = {"by": __name__}
    assert {p: {k: v for k, v in r.items() if k != "content"} for p, r in reads.items()} == {
        str((tmp / "array.npy").resolve()): by, str((tmp / "weight.txt").resolve()): by}, reads
    assert all(len(r["content"]) == 32 for r in reads.values())
    plain = __import__("hashlib").sha256(b"1.0").hexdigest()  # keyed digests: not even the content's own hash
    assert plain[:32] not in (run / "header.json").read_text()


def test_a_file_the_runs_code_read_changed_before_the_deletion_refuses_before_any_compute(recorded, tmp_path):
    """ATTACK: the weight file changed to 0.5 before `forget` (replay and oracle would both read 0.5, and the probe
    re-runs step 0 only): it was VERIFIED with all 21 tensors off the counterfactual of the program the user ran. Now
    refused before any compute, in one line naming the file; a deleted file too."""
    from hf_unlearn.trace import open_run

    _, _, run, tmp = recorded
    weight = tmp / "weight.txt"
    ids = open_run(run).ids_at_steps([LATE])[:1]
    try:
        weight.write_text("0.5")
        kind, what = _forget_outcome(run, ids, tmp_path / "changed")
        assert kind == "refused" and "\n" not in what, (kind, what)
        assert f"read the file {weight.resolve()} (read by {__name__}: present while recording, present with " \
               "other content here)" in what, what
        assert f"restore {weight.resolve()} as it was when the run was recorded, or record the run again" in what
        assert "before any compute" in what and not (tmp_path / "changed").exists()
        weight.unlink()
        kind, what = _forget_outcome(run, ids, tmp_path / "missing")
        assert kind == "refused" and "present while recording, missing here" in what, what
        assert not (tmp_path / "missing").exists()
    finally:
        weight.write_text("1.0")


def test_the_same_files_delete_exactly(recorded, tmp_path):
    """The file as recorded: a step-5 deletion is VERIFIED and equal to the engine-free counterfactual."""
    from hf_unlearn.trace import open_run

    tok, data, run, tmp = recorded
    ids = open_run(run).ids_at_steps([LATE])[:1]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    callback = ReadsAround(str(tmp / "array.npy"), str(tmp / "config"))
    assert not _counterfactual_differs(tok, data, run, ids, tmp_path / "del", callback)


def test_a_file_changed_while_training_is_noted_and_refuses_every_deletion(tmp_path):
    """A callback (one replays do not run) rewrites the weight file at step 3 while the loss reads it at every step:
    no process can hold both contents, so the recording notes the step (each read hashes the file) and every deletion
    is refused before any compute, naming the file and the step."""
    from hf_unlearn.trace import open_run

    weight = tmp_path / "weight.txt"
    weight.write_text("1.0")

    class Rewrite(TrainerCallback):  # defined here: watched, not replayed
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                weight.write_text("0.9")

    _, _, run = _record(tmp_path, weight, from_step=0, callbacks=[Rewrite()])
    fidelity = open_run(run).header["fidelity"]
    assert fidelity["file_reads"][str(weight.resolve())]["changed"] == 3, fidelity["file_reads"]
    assert not fidelity["recording"]["reproduced"]  # the proof, replaying with 0.9 from step 0, diverged at once
    kind, what = _forget_outcome(run, open_run(run).ids_at_steps([0])[:1], tmp_path / "del")
    assert kind == "refused" and "its content changed at optimizer step 3 while training" in what, what
    assert not (tmp_path / "del").exists()


class _Rows(torch.utils.data.Dataset):
    """A user's dataset reading its rows from a file (the data loader's reads: rows, checked by their digests)."""

    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return len(Path(self.path).read_text()) + i


def test_what_the_programs_own_code_reads_is_noted_and_nothing_else(tmp_path, monkeypatch):
    """Noted: ``open``, ``Path.read_bytes``, ``os.open`` read-only, ``np.load`` and ``np.loadtxt`` (readers given the
    program's path),
    each with its first step and a change at a later read. Not noted: writes, the excluded folders, an installed
    package's own reads (transformers reading a config), the source ``inspect`` reads, the rows a
    data loader reads, ``/proc``, code replays never run (``unwatched``)."""
    import inspect
    import linecache
    import os

    from transformers import AutoConfig, LlamaConfig

    from hf_unlearn.trace.environment_reads import unwatched
    from hf_unlearn.trace.file_reads import watching

    a, b, arr, excluded = tmp_path / "a.txt", tmp_path / "b.bin", tmp_path / "x.npy", tmp_path / "out"
    a.write_text("1")
    b.write_bytes(b"2")
    np.save(arr, np.zeros(2))
    np.savetxt(tmp_path / "t.csv", np.zeros(2))
    excluded.mkdir()
    (excluded / "c.txt").write_text("3")
    LlamaConfig().save_pretrained(tmp_path / "config")
    step = [0]
    with watching(exclude=[excluded], step=lambda: step[0]) as log:
        with open(a) as f:
            f.read()
        b.read_bytes()
        os.close(os.open(str(b), os.O_RDONLY))
        np.load(arr)
        np.loadtxt(tmp_path / "t.csv")  # numpy's text readers hold the open they were imported with
        step[0] = 2
        a.write_text("changed")
        a.read_text()
        with open(tmp_path / "new.txt", "w") as f:
            f.write("w")
        (excluded / "c.txt").read_text()
        AutoConfig.from_pretrained(tmp_path / "config")
        linecache.clearcache()
        inspect.getsource(_Rows)  # this file's source, read for display
        list(torch.utils.data.DataLoader(_Rows(b), batch_size=2))
        Path("/proc/self/status").read_text()
        with unwatched():
            (tmp_path / "new.txt").read_text()
    assert {Path(p).name: (r["step"], r.get("changed"), r["by"]) for p, r in log.items()} == {
        "a.txt": (0, 2, __name__), "b.bin": (0, None, __name__), "x.npy": (0, None, __name__),
        "t.csv": (0, None, __name__)}, dict(log)
    assert open is __import__("builtins").open and os.open.__module__ == "posix"  # nothing wrapped outside


def test_a_path_naming_another_file_in_the_deleting_process_is_named(tmp_path, monkeypatch):
    """A relative path read from the recording's working directory, and a link, are sealed by the file they named:
    where the same path names another file (another working directory, a link pointing elsewhere), even with the
    same content, the difference is named; a replay's read of a file the recording never read too."""
    import os

    from hf_unlearn.trace.file_reads import differences, sealed, unrecorded, watching

    key = b"k" * 32
    here, there = tmp_path / "here", tmp_path / "there"
    for d in (here, there):
        d.mkdir()
        (d / "w.txt").write_text("1.0")
    os.symlink(here / "w.txt", tmp_path / "link.txt")
    monkeypatch.chdir(here)
    with watching() as log:
        Path("w.txt").read_text()
        (tmp_path / "link.txt").read_text()
    recorded = sealed(key, log)
    assert recorded == {str(here / "w.txt"): {"content": recorded[str(here / "w.txt")]["content"], "by": __name__,
                                              "as": "w.txt"}}, recorded  # one file, read by two names
    assert differences(key, recorded) == [] and unrecorded(key, recorded, log) == []
    monkeypatch.chdir(there)
    assert differences(key, recorded) == [(str(here / "w.txt"), f"w.txt (read by {__name__}: it named "
                                           f"{here / 'w.txt'} while recording, {there / 'w.txt'} here)")]
    with watching() as replay:
        Path("w.txt").read_text()
    assert unrecorded(key, recorded, replay) == [
        f"{there / 'w.txt'} (read by {__name__}, which the recording's code never read)"]
    monkeypatch.chdir(here)
    (here / "w.txt").write_text("0.5")
    with watching() as replay:
        Path("w.txt").read_text()
    assert unrecorded(key, recorded, replay) == [
        f"{here / 'w.txt'} (read by {__name__}: its content differs from the recording's)"]


@pytest.mark.slow  # the same refusal through the CLI (~15 s); the API's is in the default suite
def test_hf_unlearn_forget_refuses_a_changed_file_before_any_compute(recorded, tmp_path):
    """The attack through the command line, in a process of its own: `hf-unlearn forget` with the weight file changed
    exits non-zero before any compute, naming the file and what to do."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    from .conftest import run_cli

    _, _, run, tmp = recorded
    weight = tmp / "weight.txt"
    write_ids(tmp_path / "ids.jsonl", open_run(run).ids_at_steps([LATE])[:1])
    try:
        weight.write_text("0.5")
        proc = run_cli("forget", run, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "del", "--oracle",
                       "--no-progress")
    finally:
        weight.write_text("1.0")
    assert proc.returncode != 0 and "VERIFIED" not in proc.stdout, proc.stdout[-2000:]
    assert f"read the file {weight.resolve()}" in proc.stderr and "refusing before any compute (restore" in proc.stderr
    assert not (tmp_path / "del").exists()


class ReadsAFile(TrainerCallback):
    """A recorded callback that reads a file at every step (and does nothing with it)."""

    def __init__(self, path: str = ""):
        self.path = path

    def on_step_begin(self, args, state, control, **kwargs):
        Path(self.path).read_bytes()


def test_a_pipeline_deletion_compares_every_stages_files_before_any_compute(tmp_path):
    """Stage 2 of a pipeline was recorded with a callback reading a file; a pipeline deletion of a stage-1 row after
    the file changed is refused before any compute, naming stage 2 and the file."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.trace.proof import ProofError

    from .test_trace_common import ids_at_step, record, tiny
    from .test_trace_pipeline import KW as PIPELINE
    from .test_trace_pipeline import _from

    tok, data = get_trace_data()
    settings = tmp_path / "settings.bin"
    settings.write_bytes(b"a")
    t1 = record(tok, data.select(range(16)), tmp_path / "s1", model=tiny(tok), **PIPELINE)
    t1.save_model(str(tmp_path / "s1"))
    record(tok, data.select(range(16, 32)), tmp_path / "s2", model=_from(tmp_path / "s1"),
           trainer_kwargs={"callbacks": [ReadsAFile(str(settings))]}, **PIPELINE)
    runs = [str(tmp_path / "s1" / "trace"), str(tmp_path / "s2" / "trace")]
    settings.write_bytes(b"b")
    with pytest.raises(ProofError, match=rf"^stage 2: the recorded run's code read the file {settings.resolve()} ") as e:
        forget(runs, ids_at_step(runs[0], 0)[:1], tmp_path / "pipeline", oracle=True, progress=False)
    assert "\n" not in str(e.value) and "before any compute" in str(e.value)
    assert not (tmp_path / "pipeline").exists()


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_recording_resumed_where_a_file_its_code_read_changed_is_refused(tmp_path):
    """Stopped after step 4 with a recorded callback reading a file at every step, the file changed, then resumed:
    the steps after the resume would read other content than the ones before, so the resume is refused, naming the
    file; restored, the resume seals the file as read before the stop."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import open_run

    from .test_trace_neutral_attacks import stopped_at_4_then_resumed

    tok, data = get_trace_data()
    settings = tmp_path / "settings.bin"
    settings.write_bytes(b"a")
    trainer = stopped_at_4_then_resumed(tmp_path, tok, data.select(range(24)), [ReadsAFile(str(settings))])
    trainer(trainer.stop_at_4).train()
    settings.write_bytes(b"b")
    with pytest.raises(UnlearnError, match=rf"cannot be resumed in this process: .* differs here: {settings.resolve()} "
                                           r"\(read by tests.test_trace_file_reads: present while recording, present "
                                           r"with other content here\)"):
        trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    settings.write_bytes(b"a")
    trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    assert list(open_run(tmp_path / "rec" / "trace").header["fidelity"]["file_reads"]) == [str(settings.resolve())]
