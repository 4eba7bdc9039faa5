"""Exact deletion for trl.SFTTrainer and any Trainer subclass with its own loss (the real trl, tiny models from a
config, TOFU rows, int and string ids, Llama and GPT-2 families).

The recording is ``trace_recording(SFTTrainer)``; replays and the oracle rebuild SFTTrainer from the run and run its
own ``compute_loss``. The exactness claim is also checked against a counterfactual built without the library's
replay engine: a plain SFTTrainer run where the deleted rows' labels are all ignored and the loss normalisers are
the recorded ones.
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch

from .conftest import TOFU_DIR

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*not sealed.*")
warnings.filterwarnings("ignore", category=FutureWarning)

# A chat template whose assistant turns are marked for return_assistant_tokens_mask (assistant_only_loss).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ 'A: ' }}{% generation %}"
    "{{ message['content'] + eos_token }}{% endgeneration %}{% else %}{{ 'Q: ' + message['content'] + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}")


@functools.cache
def _rows_and_tokenizer():
    from hf_unlearn.data import load_tofu
    from hf_unlearn.models import build_tiny_tokenizer

    rows = load_tofu("full", TOFU_DIR).select(range(32))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    tok.chat_template = CHAT_TEMPLATE
    return rows, tok


def prompt_completion(string_ids: bool = False):
    from datasets import Dataset

    rows, tok = _rows_and_tokenizer()
    ids = [f"tofu-{i}" for i in rows["id"]] if string_ids else list(rows["id"])
    return tok, Dataset.from_dict({"id": ids, "prompt": rows["question"], "completion": [" " + a for a in rows["answer"]]})


def conversational(string_ids: bool = True):
    from datasets import Dataset

    rows, tok = _rows_and_tokenizer()
    ids = [f"tofu-{i}" for i in rows["id"]] if string_ids else list(rows["id"])
    messages = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                for q, a in zip(rows["question"], rows["answer"])]
    return tok, Dataset.from_dict({"id": ids, "messages": messages})


def model(tok, family: str = "llama", dropout: float = 0.0):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, dropout=dropout, seed=0)


def sft_config(out, config_cls=None, **kw):
    from trl import SFTConfig

    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=3e-3, warmup_steps=1, max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True,
                bf16=False, seed=0, disable_tqdm=True, logging_steps=100, max_length=128, dataset_num_proc=None)
    base.update(kw)
    return (config_cls or SFTConfig)(**base)


def record_sft(out, tok, data, family="llama", dropout=0.0, trainer_kwargs=None, **config):
    from trl import SFTTrainer

    from hf_unlearn.trace import trace_recording

    trainer = trace_recording(SFTTrainer)(model=model(tok, family, dropout), args=sft_config(out, **config),
                                          train_dataset=data, processing_class=tok, trace_checkpoint_steps=2,
                                          **(trainer_kwargs or {}))
    trainer.train()
    return trainer


def delete_and_verify(run_dir, forget, tmp_path):
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify

    run = open_run(run_dir)
    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    replay = RedactedReplayTrainer(run, tmp_path / "store", forget, tmp_path / "replay")
    replay.train()
    oracle = OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle")
    oracle.train()
    return replay, oracle, verify(tmp_path / "replay", tmp_path / "oracle")


def full_replay_reproduces(run_dir) -> bool:
    from hf_unlearn.trace import ReplayTrainer, compare_states, open_run
    from hf_unlearn.trace.run import load_checkpoint

    run = open_run(run_dir)
    return compare_states(ReplayTrainer(run, start="full").train(),
                          load_checkpoint(run.final_checkpoint()))["identical"]


def state_of(trainer) -> dict:
    from hf_unlearn.trace.run import capture_state

    return capture_state(trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer, trainer.state.global_step,
                         clone=True)


def recorded_normalisers(run):
    """A plain SFTTrainer whose one change is the loss normaliser: the run's recorded num_items_in_batch."""
    from trl import SFTTrainer

    norms = {e.step: (e.norm, e.norm_dtype) for e in run.plan}

    class RecordedNormalisers(SFTTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
            norm, dtype = norms[self.state.global_step]
            return batches, torch.tensor(norm, dtype=getattr(torch, dtype), device=device)

    return RecordedNormalisers


def test_sft_prompt_completion_replay_equals_oracle_equals_a_plain_sftrainer_counterfactual(tmp_path):
    """Prompt-completion data (completion-only loss), int ids, Llama: the recording equals a plain SFTTrainer run bit
    for bit; replay == oracle; and the oracle equals an SFTTrainer run built without the replay engine, with the
    deleted rows' completion labels all ignored and the recorded normalisers."""
    from trl import SFTTrainer

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import load_state

    tok, data = prompt_completion()
    recorder = record_sft(tmp_path / "rec", tok, data)
    run_dir = tmp_path / "rec" / "trace"
    run = open_run(run_dir)
    header = run.header
    assert header["trainer"]["class"] == "trl.trainer.sft_trainer:SFTTrainer"
    assert header["trainer"]["config_class"] == "trl.trainer.sft_config:SFTConfig"
    assert header["training_args"]["completion_only_loss"] is None and header["collator"]["rebuildable"]

    plain = SFTTrainer(model=model(tok), args=sft_config(tmp_path / "plain"), train_dataset=data, processing_class=tok)
    plain.train()
    assert compare_states(state_of(plain), load_checkpoint(run.final_checkpoint()))["identical"]

    forget = run.ids_at_steps([1])[:1] + run.ids_at_steps([3])[-1:]
    replay, oracle, report = delete_and_verify(run_dir, forget, tmp_path)
    assert report["verified"], report["provenance"]
    assert type(replay).__mro__.index(SFTTrainer) and replay.compute_loss.__func__ is SFTTrainer.compute_loss

    RecordedNormalisers = recorded_normalisers(run)  # the counterfactual's one change: the recorded normalisers
    prepared = recorder.train_dataset
    masked = prepared.map(lambda r: {"labels": [-100] * len(r["labels"]) if r["id"] in forget else r["labels"]})
    counterfactual = RecordedNormalisers(
        model=model(tok), args=sft_config(tmp_path / "cf", dataset_kwargs={"skip_prepare_dataset": True}),
        train_dataset=masked, processing_class=tok)
    counterfactual.train()
    assert compare_states(state_of(counterfactual), load_state(tmp_path / "oracle"))["identical"]
    assert not compare_states(state_of(plain), load_state(tmp_path / "oracle"))["identical"]  # the deletion changed it


def test_sft_conversational_assistant_only_loss_dft_neftune_string_ids(tmp_path):
    """`messages` data through a chat template with generation markers (assistant_only_loss), loss_type dft,
    NEFTune noise and dropout, string ids, GPT-2: a full replay reproduces the recording and replay == oracle."""
    tok, data = conversational()
    recorder = record_sft(tmp_path / "rec", tok, data, family="gpt2", dropout=0.1, assistant_only_loss=True,
                          loss_type="dft", neftune_noise_alpha=5.0)
    row = recorder.train_dataset[0]
    assert isinstance(row["id"], str) and row["labels"][0] == -100 and any(x != -100 for x in row["labels"])
    run_dir = tmp_path / "rec" / "trace"
    assert full_replay_reproduces(run_dir)
    from hf_unlearn.trace import open_run

    forget = open_run(run_dir).ids_at_steps([2])[:2]
    assert delete_and_verify(run_dir, forget, tmp_path)[2]["verified"]


def test_sft_lora_peft_config(tmp_path):
    """peft_config= (LoRA): the adapter is rebuilt from the run; replay == oracle."""
    from peft import LoraConfig

    tok, data = prompt_completion(string_ids=True)
    record_sft(tmp_path / "rec", tok, data, learning_rate=1e-2,
               trainer_kwargs={"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"])})
    run_dir = tmp_path / "rec" / "trace"
    header = json.loads((run_dir / "header.json").read_text())
    assert header["model"]["peft"] and (run_dir / "model" / "adapter").is_dir()
    from hf_unlearn.trace import open_run

    assert delete_and_verify(run_dir, open_run(run_dir).ids_at_steps([0])[:1], tmp_path)[2]["verified"]


def test_rows_sftrainer_drops_are_reported_not_lost(tmp_path):
    """A prompt that fills max_length leaves a fully masked row, which SFTTrainer drops: the recording warns, the
    header counts it (as a keyed tag), and a deletion request for it is answered 'never trained on'."""
    from hf_unlearn.trace import open_run, redact_store, replay_cost

    tok, data = prompt_completion()
    long_prompt = " ".join(data["prompt"][:6])
    data = data.map(lambda r, i: {"prompt": long_prompt if i in (5, 9) else r["prompt"]}, with_indices=True)
    with pytest.warns(UserWarning, match=r"dropped 2 row\(s\) \(e.g. ids \[\d+, \d+\]\): they are never trained on"):
        record_sft(tmp_path / "rec", tok, data, max_length=48, max_steps=2)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["trainer"]["dropped_rows"] == 2 and len(run.header["dataset"]) and run.header["dataset"]["rows"] == 30
    dropped = [data["id"][5], data["id"][9]]
    from hf_unlearn.trace.tags import tag

    assert run.header["trainer"]["dropped_tags"] == sorted(tag(run.key, i) for i in dropped)  # keyed tags, not ids
    cost = replay_cost(run, dropped)
    assert cost["never_trained"] == 2 and cost["slots_deleted"] == 0 and cost["already_deleted"] == 0
    receipt = redact_store(run.store_path, dropped, tmp_path / "store", run.key,
                           already_deleted=__import__("hf_unlearn.trace.replay", fromlist=["x"]).already_deleted(
                               run, dropped))
    assert receipt["already_absent"] == 2
    from hf_unlearn.errors import UnlearnError

    with pytest.raises(UnlearnError, match="never appear in the recorded plan"):
        replay_cost(run, [123456])  # an id the trainer was never given is still an error


def test_a_user_trainer_with_its_own_loss_in_an_importable_module(tmp_path):
    """A Trainer subclass with its own compute_loss and a JSON constructor argument (tests/trace_trainers.py): the
    replay rebuilds it with the argument and runs its loss (a full replay reproduces the recording; the stock loss
    would not), and replay == oracle."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run, trace_recording

    from .test_trace_common import get_trace_data, tiny, train_args
    from .trace_trainers import L2Trainer

    tok, data = get_trace_data()
    data = data.select(range(16))
    trainer = trace_recording(L2Trainer)(model=tiny(tok), args=train_args(tmp_path / "rec", max_steps=2),
                                         train_dataset=data, data_collator=QACollator.from_tokenizer(tok), l2=0.5,
                                         trace_checkpoint_steps=1)
    trainer.train()
    run_dir = tmp_path / "rec" / "trace"
    spec = open_run(run_dir).header["trainer"]
    assert spec["class"] == "tests.trace_trainers:L2Trainer" and spec["kwargs"] == {"l2": 0.5}
    assert full_replay_reproduces(run_dir)
    assert delete_and_verify(run_dir, open_run(run_dir).ids_at_steps([1])[:1], tmp_path)[2]["verified"]


def test_what_a_replay_cannot_rebuild_is_refused_at_construction(tmp_path):
    """A trainer class or config class defined in a function, a non-JSON constructor argument, a loss that gives a
    deleted slot's dummy row weight, and wrapped packing are refused when the recording trainer is constructed, each naming
    what is wrong."""
    from trl import SFTConfig, SFTTrainer

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import trace_recording
    from hf_unlearn.trace.recording import TraceRecordingMixin

    from .trace_trainers import L2Trainer

    tok, data = prompt_completion()
    kw = dict(train_dataset=data, processing_class=tok)

    class LocalSFT(TraceRecordingMixin, SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    with pytest.raises(UnlearnError, match="trainer class .*LocalSFT is defined inside a function"):
        LocalSFT(model=model(tok), args=sft_config(tmp_path), **kw)

    class Combined(TraceRecordingMixin, SFTTrainer):  # only combines its bases: SFTTrainer is what is recorded
        pass

    assert Combined(model=model(tok), args=sft_config(tmp_path), **kw)._trace_trainer["class"].endswith(":SFTTrainer")

    from dataclasses import dataclass

    @dataclass
    class MyConfig(SFTConfig):
        extra: int = 0

    with pytest.raises(UnlearnError, match="config class .*MyConfig is defined inside a function"):
        trace_recording(SFTTrainer)(model=model(tok), args=sft_config(tmp_path, MyConfig), **kw)
    from .test_trace_common import get_trace_data, tiny, train_args

    qtok, qdata = get_trace_data()
    with pytest.raises(UnlearnError, match=r"L2Trainer\(l2=Tensor\) cannot be recorded"):
        trace_recording(L2Trainer)(model=tiny(qtok), args=train_args(tmp_path), train_dataset=qdata,
                                   l2=torch.tensor(0.1))
    from hf_unlearn.data import QACollator

    from .trace_trainers import EveryTokenTrainer

    with pytest.raises(UnlearnError, match=r"EveryTokenTrainer.compute_loss gives the dummy row that replaces a "
                                           r"deleted sample a gradient"):
        trace_recording(EveryTokenTrainer)(model=tiny(qtok), args=train_args(tmp_path), train_dataset=qdata,
                                           data_collator=QACollator.from_tokenizer(qtok))
    for padding_free in (False, True):  # wrapped packing: documents cut and attending across each other
        with pytest.raises(UnlearnError, match=r"SFTTrainer with packing=True cannot be recorded for exact deletion: "
                                               r"packing_strategy='wrapped' cuts documents .* use "
                                               r"packing_strategy='bfd' \(or 'bfd_split'\)"):
            trace_recording(SFTTrainer)(model=model(tok), args=sft_config(
                tmp_path, packing=True, packing_strategy="wrapped", padding_free=padding_free), **kw)
    assert not (tmp_path / "trace").exists()


@pytest.mark.slow  # a fresh `hf-unlearn forget` process (imports, replay and oracle): about a minute of CPU
def test_cli_forget_and_trace_commands_rebuild_the_sft_trainer_from_the_run(tmp_path, capsys):
    """`hf-unlearn forget RUN` (a fresh process: the trainer is rebuilt from the run alone), the receipts, and
    `trace inspect/redact/replay/oracle/verify` for an SFTTrainer run; inspect names the trainer class."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    from .conftest import run_cli

    tok, data = prompt_completion(string_ids=True)
    record_sft(tmp_path / "rec", tok, data, max_steps=2)
    run = tmp_path / "rec" / "trace"
    forget = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([1])[:1])
    proc = run_cli("forget", run, "--ids", forget, "--out", tmp_path / "out", "--no-progress", "--oracle")
    assert proc.returncode == 0, proc.stderr[-2000:]
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert receipt["evidence"]["verified"] is True
    assert (tmp_path / "out" / "model" / "tokenizer_config.json").is_file()  # the run's own tokenizer
    assert main(["trace", "inspect", str(run)]) == 0
    assert "trainer trl.trainer.sft_trainer:SFTTrainer (config trl.trainer.sft_config:SFTConfig" in capsys.readouterr().out
    for cmd in (["redact", run, "--forget", forget, "--out", tmp_path / "s"],
                ["replay", run, "--store", tmp_path / "s", "--forget", forget, "--out", tmp_path / "r"],
                ["oracle", run, "--forget", forget, "--out", tmp_path / "o"],
                ["verify", tmp_path / "r", tmp_path / "o"]):
        assert main(["trace", *map(str, cmd)]) == 0, capsys.readouterr().err
    assert "VERIFIED" in capsys.readouterr().out


def test_without_trl_a_trl_run_names_the_extra_to_install(tmp_path, monkeypatch, capsys):
    import sys

    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run

    tok, data = prompt_completion()
    record_sft(tmp_path / "rec", tok, data, max_steps=1)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([0])[:1]
    for name in ("trl", "trl.trainer", "trl.trainer.sft_trainer", "trl.trainer.sft_config"):
        monkeypatch.setitem(sys.modules, name, None)  # as if trl were not installed
    with pytest.raises(UnlearnError, match=r"recorded with the trainer class trl.trainer.sft_trainer:SFTTrainer, "
                                           r"which cannot be imported here .*: pip install 'hf_unlearn\[trl\]'"):
        OracleReplayTrainer(run, ids)
    assert main(["trace", "oracle", str(run), "--forget", str(write_ids(tmp_path / "f.jsonl", ids)), "--out",
                 str(tmp_path / "o")]) == 1
    assert "pip install 'hf_unlearn[trl]'" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_padding_free_packs_each_microbatch_and_a_deleted_row_leaves_the_other_documents_unchanged(tmp_path):
    """padding_free=True: SFTTrainer's collator packs each microbatch into one sequence with position ids (documents
    do not attend to each other). A deleted row becomes dummy tokens of the same length inside that sequence; the
    other documents' per-token losses equal those of the same sequence with the row's labels merely ignored, and
    replay == oracle."""
    from hf_unlearn.data.collators import rebuild_collator
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.recording import dummy_row
    from hf_unlearn.trace.run import full_model_state, load_checkpoint
    from hf_unlearn.trace.store import load_store
    from hf_unlearn.trace.tags import tag

    tok, data = prompt_completion()
    record_sft(tmp_path / "rec", tok, data, padding_free=True, max_length=None)
    run_dir = tmp_path / "rec" / "trace"
    run = open_run(run_dir)
    assert run.header["collator"]["kwargs"]["padding_free"] is True
    entry = next(e for e in run.plan if e.step == 1)
    forget = run.ids_at_steps([1])[1:2]
    assert delete_and_verify(run_dir, forget, tmp_path)[2]["verified"]

    collate = rebuild_collator(run.header["collator"], run_dir / "collator")
    store = load_store(run.store_path)
    by_tag = {tag(run.key, i): n for n, i in enumerate(store["id"])}
    rows = [{k: v for k, v in store[by_tag[s]].items() if k != "id"} for s in entry.slots]
    gone = entry.slots.index(tag(run.key, forget[0]))
    masked = [dict(r, labels=[-100] * len(r["labels"])) if n == gone else r for n, r in enumerate(rows)]
    dummied = [dummy_row(r, len(r["input_ids"]), run.header["dummy_token_id"], "id") if n == gone else r
               for n, r in enumerate(rows)]
    a, b = collate(masked), collate(dummied)
    assert a["input_ids"].shape[0] == 1 and (a["position_ids"] == 0).sum() == len(rows)  # one packed sequence
    assert torch.equal(a["position_ids"], b["position_ids"]) and torch.equal(a["labels"], b["labels"])
    lm = model(tok)
    lm.load_state_dict(full_model_state(load_checkpoint(run.final_checkpoint())))
    with torch.no_grad():
        la, lb = (torch.log_softmax(lm(input_ids=x["input_ids"], position_ids=x["position_ids"],
                                             use_cache=False).logits[0, :-1], -1)  # as SFTTrainer calls it
                  for x in (a, b))
    targets = a["labels"][0, 1:]
    keep = targets != -100
    lp_a = la[keep].gather(1, targets[keep, None])
    lp_b = lb[keep].gather(1, targets[keep, None])
    assert keep.sum() > 0 and torch.equal(lp_a, lp_b)  # every other document: the same per-token loss, bit for bit
    start = sum(len(r["input_ids"]) for r in rows[:gone])
    assert not torch.equal(la[start:start + 4], lb[start:start + 4])  # while the deleted row's own tokens did change


def test_publishing_scans_the_trainer_arguments_but_not_sftconfig_settings(tmp_path):
    """The Hub's provenance check scans header values the trace code does not write for forget ids: SFTConfig's own
    fields (max_length=128, ...) are trl's settings, not ids; the trainer's own constructor arguments are the user's
    values and are scanned, numbers included."""
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import _header

    tok, data = prompt_completion()
    record_sft(tmp_path / "rec", tok, data, max_steps=1)
    path = tmp_path / "rec" / "trace" / "header.json"
    header = json.loads(path.read_text())
    assert header["training_args"]["max_length"] == 128
    assert _header(path, "header.json", IdScanner([128])) == []
    header["trainer"]["kwargs"] = {"alpha": 128}
    path.write_text(json.dumps(header))
    hits = _header(path, "header.json", IdScanner([128]))
    assert hits and all("trainer.kwargs" in str(h) for h in hits)


# ---- packing=True (bfd / bfd_split): a deleted document becomes dummy tokens inside its packed row ----------------
PACKED = dict(packing=True, max_length=128, per_device_train_batch_size=2)


def _touched_row(run, store, step: int):
    """A packed row of optimizer step ``step`` holding at least two documents: (its store index, its documents)."""
    from hf_unlearn.trace.tags import tag

    index = {tag(run.key, i): n for n, i in enumerate(store["id"])}
    for e in run.plan:
        for s in e.slots:
            if e.step == step and len(store[index[s]]["packed_ids"]) > 1:
                return index[s], store[index[s]]["packed_ids"]
    raise AssertionError(f"no packed row with two documents at step {step}")


def _span(row, k):
    start = sum(row["seq_lengths"][:k])
    return start, start + row["seq_lengths"][k]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One packed (bfd) recording, Llama, int ids; one late deletion of a document that shares its packed row."""
    from types import SimpleNamespace

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.store import load_store

    tmp = tmp_path_factory.mktemp("packed")
    tok, data = prompt_completion()
    recorder = record_sft(tmp / "rec", tok, data, **PACKED)
    run_dir = tmp / "rec" / "trace"
    run = open_run(run_dir)
    store = load_store(run.store_path)
    n, docs = _touched_row(run, store, step=3)
    forget = [docs[-1]]
    replay, oracle, report = delete_and_verify(run_dir, forget, tmp)
    return SimpleNamespace(tmp=tmp, tok=tok, data=data, recorder=recorder, run_dir=run_dir, run=run, store=store,
                           row=n, forget=forget, replay=replay, oracle=oracle, report=report)


def test_packing_bfd_packs_as_sftrainer_does_and_a_deleted_document_becomes_dummies_of_the_same_length(packed):
    """The recorded store is SFTTrainer's own packing (input_ids, labels, seq_lengths) and the recording equals a
    plain packed SFTTrainer run bit for bit; every document is in the sealed map; a late deletion of a document
    that shares its packed row: replay == oracle VERIFIED, the redacted store keeps the row with that document's
    tokens replaced by dummies (labels ignored, lengths unchanged), the other document untouched."""
    from trl import SFTTrainer

    from hf_unlearn.trace import compare_states, replay_cost
    from hf_unlearn.trace.packing import load_map
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.store import load_store, read_receipt
    from hf_unlearn.trace.tags import tag

    run, store = packed.run, packed.store
    info = run.header["dataset"]["packing"]
    assert info["strategy"] == "bfd" and info["documents"] == 32 and info["packed_rows"] == len(store) < 32
    assert run.header["dataset"]["id_type"] == "int"
    doc_map = load_map(run)
    assert sorted(d for frags in doc_map.values() for d, _, _ in frags) == sorted(tag(run.key, i)
                                                                                  for i in packed.data["id"])
    plain = SFTTrainer(model=model(packed.tok), args=sft_config(packed.tmp / "plain", **PACKED),
                       train_dataset=packed.data, processing_class=packed.tok)
    for column in ("input_ids", "labels", "seq_lengths"):
        assert store[column] == plain.train_dataset[column]
    plain.train()
    assert compare_states(state_of(plain), load_checkpoint(run.final_checkpoint()))["identical"]

    assert packed.report["verified"], packed.report["provenance"]
    cost = replay_cost(run, packed.forget)
    assert cost["packed_rows_touched"] == 1 and cost["first_affected_step"] == 3 and cost["slots_deleted"] == 0
    redacted = load_store(packed.tmp / "store")
    receipt = read_receipt(packed.tmp / "store")
    assert len(redacted) == len(store) and receipt["packing"] == {"fragments_replaced": 1, "packed_rows_touched": 1}
    before, after = store[packed.row], redacted[packed.row]
    k = before["packed_ids"].index(packed.forget[0])
    a, b = _span(before, k)
    dummy = run.header["dummy_token_id"]
    assert after["packed_ids"][k] is None and after["seq_lengths"] == before["seq_lengths"]
    assert after["input_ids"][a:b] == [dummy] * (b - a) and after["labels"][a:b] == [-100] * (b - a)
    assert before["input_ids"][a:b] != after["input_ids"][a:b]  # physically gone from the redacted store
    keep = [i for i in range(len(before["input_ids"])) if not a <= i < b]
    assert [after["input_ids"][i] for i in keep] == [before["input_ids"][i] for i in keep]
    assert [after["labels"][i] for i in keep] == [before["labels"][i] for i in keep]
    assert packed.forget[0] not in {d for docs in redacted["packed_ids"] for d in docs}


def test_packing_the_other_documents_per_token_losses_are_the_oracles_and_the_deleted_ones_are_gone(packed):
    """The microbatch holding the deleted document: the replay (redacted store) and the oracle (original store)
    collate the same tensors; at fixed weights every other document's per-token loss equals the recorded
    microbatch's bit for bit (same position ids: no document attends to another), the deleted document has no
    labelled token left. And the oracle (the document's tokens kept, its labels ignored) equals a plain SFTTrainer
    run on the packed rows with that document's labels ignored by hand and the recorded normalisers (no replay
    engine); replay == oracle is VERIFIED (the fixture), so the replay's dummies are that counterfactual too."""

    from hf_unlearn.data.collators import rebuild_collator
    from hf_unlearn.trace import compare_states
    from hf_unlearn.trace.run import full_model_state, load_checkpoint
    from hf_unlearn.trace.tags import tag
    from hf_unlearn.trace.verification import load_state

    run, store, replay, oracle = packed.run, packed.store, packed.replay, packed.oracle
    row_tag = tag(run.key, store["id"][packed.row])
    entry = next(e for e in run.plan if row_tag in e.slots)
    ours, theirs = (t._collate(*t._rows(entry, keep_dummies=True)) for t in (replay, oracle))
    assert ours.keys() == theirs.keys()  # the oracle keeps the deleted document's tokens (labels ignored): the rest
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if torch.is_tensor(ours[k]) and k != "input_ids")
    assert not torch.equal(ours["input_ids"], theirs["input_ids"])
    index = {tag(run.key, i): n for n, i in enumerate(store["id"])}
    recorded = rebuild_collator(run.header["collator"], run.path / "collator")(
        [{k: v for k, v in store[index[s]].items() if k not in ("id", "packed_ids")} for s in entry.slots])
    assert torch.equal(recorded["position_ids"], ours["position_ids"])
    lm = model(packed.tok)
    lm.load_state_dict(full_model_state(load_checkpoint(run.final_checkpoint())))

    def token_losses(batch):
        with torch.no_grad():
            logits = lm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], reduction="none",
                                                 ignore_index=-100)

    mine, before = token_losses(ours), token_losses(recorded)
    kept = ours["labels"][0, 1:] != -100
    assert kept.sum() > 0 and torch.equal(mine[kept], before[kept])  # every other document: bit for bit
    offset = sum(len(store[index[s]]["input_ids"]) for s in entry.slots[:entry.slots.index(row_tag)])
    row = store[packed.row]
    a, b = _span(row, row["packed_ids"].index(packed.forget[0]))
    assert (recorded["labels"][0, offset + a:offset + b] != -100).any()
    assert (ours["labels"][0, offset + a:offset + b] == -100).all()  # the deleted document: no loss left

    RecordedNormalisers = recorded_normalisers(run)

    def by_hand(r):
        if packed.forget[0] not in r["packed_ids"]:
            return {}
        a, b = _span(r, r["packed_ids"].index(packed.forget[0]))
        return {"labels": r["labels"][:a] + [-100] * (b - a) + r["labels"][b:]}  # its tokens kept, no weight

    counterfactual = RecordedNormalisers(
        model=model(packed.tok), args=sft_config(packed.tmp / "cf", dataset_kwargs={"skip_prepare_dataset": True},
                                                 **PACKED),
        train_dataset=packed.recorder.train_dataset.map(by_hand), processing_class=packed.tok)
    counterfactual.train()
    assert compare_states(state_of(counterfactual), load_state(packed.tmp / "oracle"))["identical"]


def _resigned(store, out, key, store_dir) -> None:
    """Save ``store`` at ``out`` with the receipt of ``store_dir`` re-signed under the run key for it (what a faulty
    redactor holding the key would write)."""
    import shutil

    from hf_unlearn.trace.store import RECEIPT_NAME, read_receipt, receipt_mac, save_store

    receipt = dict(read_receipt(store_dir), store_sha256=save_store(store, out))
    receipt["mac"] = receipt_mac(key, receipt)
    (out / RECEIPT_NAME).write_text(json.dumps(receipt))
    shutil.copy(store_dir / "packing.json", out)


def test_packing_a_smuggled_document_or_an_edited_document_map_is_refused_not_verified(packed, tmp_path):
    """Attacks on the packed deletion, each refused before any compute (so no VERIFIED can follow): the deleted
    document's tokens put back into its packed row of the redacted store, or its id put back, with the receipt
    re-signed under the run key; another packed row's tokens changed; the store edited after redaction; the
    document map edited (a document moved to another fragment), with or without the header's seal."""
    import shutil

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer
    from hf_unlearn.trace.store import load_store
    from hf_unlearn.trace.tags import tag

    run, n = packed.run, packed.row
    redacted_dir = packed.tmp / "store"
    redacted = load_store(redacted_dir)
    original = packed.store[n]

    def attack(name, change, match):
        out = tmp_path / name
        forged = redacted.map(lambda r, i: change(dict(r), i), with_indices=True, keep_in_memory=True)
        _resigned(forged, out, run.key, redacted_dir)
        with pytest.raises(UnlearnError, match=match):
            RedactedReplayTrainer(run, out, packed.forget, tmp_path / f"{name}-replay")
        assert not (tmp_path / f"{name}-replay").exists()

    attack("tokens", lambda r, i: dict(r, input_ids=original["input_ids"], labels=original["labels"]) if i == n else r,
           "still holds tokens, labels or the id of a deleted document")
    attack("id", lambda r, i: dict(r, packed_ids=original["packed_ids"]) if i == n else r,
           "still holds 1 id")
    row_tag = tag(run.key, packed.store["id"][n])
    untouched = next(e for e in run.plan if e.step == 3 and row_tag not in e.slots)  # replayed, not changed
    other = packed.store["id"].index(next(i for i in packed.store["id"] if tag(run.key, i) == untouched.slots[0]))
    attack("other-row", lambda r, i: dict(r, input_ids=[r["input_ids"][0] + 1] + r["input_ids"][1:]) if i == other
           else r, "does not collate to the batch the run recorded")
    edited = tmp_path / "edited"
    shutil.copytree(redacted_dir, edited)
    forged = redacted.map(lambda r, i: dict(r, input_ids=original["input_ids"]) if i == n else r, keep_in_memory=True,
                          with_indices=True)
    shutil.rmtree(edited)
    forged.save_to_disk(str(edited))
    shutil.copy(redacted_dir / "redaction_receipt.json", edited)
    with pytest.raises(UnlearnError, match="changed after redaction"):
        RedactedReplayTrainer(run, edited, packed.forget, tmp_path / "edited-replay")

    copy = tmp_path / "run"
    shutil.copytree(packed.run_dir, copy)
    doc_map = json.loads((copy / "packing.json").read_text())
    row = next(r for r in doc_map if len(r[1]) > 1)
    row[1][0][0], row[1][1][0] = row[1][1][0], row[1][0][0]  # two documents swap fragments
    (copy / "packing.json").write_text(json.dumps(doc_map, separators=(",", ":")))
    with pytest.raises(UnlearnError, match="not the document map the run sealed"):
        OracleReplayTrainer(copy, packed.forget, out_dir=tmp_path / "o")
    import hashlib

    header = json.loads((copy / "header.json").read_text())
    header["dataset"]["packing"]["map_sha256"] = hashlib.sha256((copy / "packing.json").read_bytes()).hexdigest()
    (copy / "header.json").write_text(json.dumps(header))
    with pytest.raises(UnlearnError, match="integrity check"):
        OracleReplayTrainer(copy, packed.forget, out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_packing_forget_cli_and_trace_inspect_on_a_packed_run(packed, tmp_path, capsys):
    """`hf-unlearn forget RUN --oracle` (in process: the CLI's forget()) deletes an early document of a packed run,
    receipt VERIFIED; `trace inspect` describes the packing and checks the document map."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    ids = write_ids(tmp_path / "f.jsonl", packed.run.ids_at_steps([0])[:1])
    assert main(["forget", str(packed.run_dir), "--ids", str(ids), "--out", str(tmp_path / "out"), "--no-progress",
                 "--oracle"]) == 0, capsys.readouterr().err
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert receipt["evidence"]["verified"] is True
    assert "packing: the documents sit in 1 packed row slot(s), which stay" in capsys.readouterr().out
    assert main(["trace", "inspect", str(packed.run_dir)]) == 0
    assert f"packing bfd (max_length 128): 32 documents, 32 fragments in {len(packed.store)} packed rows; document " \
           "map packing.json matches the sealed header" in capsys.readouterr().out


@pytest.mark.slow  # a second packed recording (about 20 s of CPU)
def test_packing_bfd_split_a_document_split_across_packed_rows_is_deleted_from_every_one(tmp_path):
    """packing_strategy='bfd_split', GPT-2, string ids: documents longer than max_length are split into fragments
    in several packed rows; deleting one finds every packed row and fragment it occupies; replay == oracle."""
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.store import load_store

    tok, data = prompt_completion(string_ids=True)
    record_sft(tmp_path / "rec", tok, data, family="gpt2", packing=True, packing_strategy="bfd_split", max_length=32,
               per_device_train_batch_size=2, max_steps=3)
    run = open_run(tmp_path / "rec" / "trace")
    store = load_store(run.store_path)
    rows_of = {}
    for n, docs in enumerate(store["packed_ids"]):
        for d in docs:
            rows_of.setdefault(d, []).append(n)
    doc = next(d for d in run.ids_at_steps([2]) if len(rows_of[d]) > 1)
    assert isinstance(doc, str) and run.header["dataset"]["id_type"] == "str"
    from hf_unlearn.trace.tags import tag

    cost = replay_cost(run, [doc])
    row_tags = {tag(run.key, store["id"][n]) for n in rows_of[doc]}
    assert cost["packed_rows_touched"] == sum(s in row_tags for e in run.plan for s in e.slots) >= 1
    assert delete_and_verify(tmp_path / "rec" / "trace", [doc], tmp_path)[2]["verified"]
    redacted, dummy = load_store(tmp_path / "store"), run.header["dummy_token_id"]
    for n in rows_of[doc]:  # every fragment of the document, in every packed row it occupies
        k = store[n]["packed_ids"].index(doc)
        a, b = _span(store[n], k)
        assert redacted[n]["packed_ids"][k] is None and redacted[n]["input_ids"][a:b] == [dummy] * (b - a)
        assert redacted[n]["labels"][a:b] == [-100] * (b - a)
    assert doc not in {d for docs in redacted["packed_ids"] for d in docs}


def test_packing_a_second_request_on_the_replayed_run_equals_one_oracle_of_both(packed, tmp_path):
    """Request 2 deletes the other document of the same packed row, from request 1's output run (its store already
    holds request 1's dummies, its map marks them): the row is left with no weight, and the result is the oracle of
    both requests on the original run, VERIFIED."""
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, replay_cost, verify

    first = open_run(packed.tmp / "replay")
    assert first.header["dataset"]["packing"]["map_sha256"] != packed.run.header["dataset"]["packing"]["map_sha256"]
    second = [d for d in packed.store[packed.row]["packed_ids"] if d not in packed.forget]
    cost = replay_cost(first, second)
    assert cost["packed_rows_touched"] == 1 and cost["already_deleted"] == 0
    redact_store(first.store_path, second, tmp_path / "s2", first.key)
    RedactedReplayTrainer(first, tmp_path / "s2", second, tmp_path / "r2").train()
    OracleReplayTrainer(packed.run, packed.forget + second, out_dir=tmp_path / "oracle").train()
    assert verify(tmp_path / "r2", tmp_path / "oracle")["verified"]
