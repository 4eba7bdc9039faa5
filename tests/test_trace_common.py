"""Shared set-up of the trace tests (no tests here): a tiny Llama, TOFU rows, and recorded runs.

Plain cached functions rather than fixtures (fixtures cannot be shared between test modules without conftest):
the data is built and the run recorded once per session into a temporary folder removed at exit; tests that
damage a run work on a copy.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

from .conftest import TOFU_DIR

warnings.filterwarnings("ignore", message=".*not sealed.*")


@functools.cache
def get_trace_data():
    """64 TOFU rows tokenised with a 1k-token tokenizer trained on them (fast, real text)."""
    from hf_unlearn.data import load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_tokenizer

    rows = load_tofu("full", TOFU_DIR).select(range(64))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    return tok, tokenize_qa(rows, tok, max_length=128)


def tiny(tok, dropout: float = 0.0):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, dropout=dropout, seed=0)


def tiny_config_kwargs(tok) -> dict:
    """The config fields every hand-built tiny model of the trace tests shares (hidden 32, 2 layers, 2 heads)."""
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


# families the trace tests build from a config by hand (model class, config class); GQA ones get one key/value head
CONFIG_FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "mistral": ("MistralForCausalLM", "MistralConfig"),
                   "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"), "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig"),
                   "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
                   "mixtral": ("MixtralForCausalLM", "MixtralConfig"), "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig")}


def config_model(family: str, tok, seed: int = 0, **overrides):
    """A tiny ``family`` model built from its config (:func:`tiny_config_kwargs` plus ``overrides``), seeded."""
    import torch
    import transformers

    model_cls, config_cls = CONFIG_FAMILIES[family]
    kwargs = {**tiny_config_kwargs(tok), **({} if family == "gpt_neox" else {"num_key_value_heads": 1}), **overrides}
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))


def train_args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=1,
                learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True,
                seed=0, disable_tqdm=True, logging_steps=4)
    base.update(kw)
    return TrainingArguments(**base)


def record(tok, data, out, dropout: float = 0.0, every: int = 2, trace_key: bytes | None = None, model=None,
           data_collator=None, trainer_kwargs: dict | None = None, retention: str = "even", **kw):
    """Record a run of ``model`` (default: the tiny Llama) into ``out/trace``; ``kw`` are TrainingArguments.

    Checkpoints every ``every`` steps, all kept (``retention="even"``: the tests name start steps; the library's
    default is geometric retention, tested in test_trace_checkpoints)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    trainer = TraceRecordingTrainer(model=model if model is not None else tiny(tok, dropout),
                                    args=train_args(out, **kw), train_dataset=data,
                                    data_collator=data_collator or QACollator.from_tokenizer(tok),
                                    trace_checkpoint_steps=every, trace_key=trace_key,
                                    trace_checkpoint_retention=retention, **(trainer_kwargs or {}))
    trainer.train()
    return trainer


def delete(run_dir, forget, tmp_path, start="suffix", **kwargs):
    """Redact, replay from the redacted store, run the oracle; return (replay trainer, verification report)."""
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify
    from hf_unlearn.trace.proof import prove_fresh_start

    run = open_run(run_dir)
    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    if start == "suffix":  # as forget does: a fresh start no proof covers, whose first step is affected, probed
        kwargs.setdefault("proven_start", prove_fresh_start(run, forget, kwargs.get("data_collator")))
    replay = RedactedReplayTrainer(run, tmp_path / "store", forget, tmp_path / "replay", start=start, **kwargs)
    replay.train()
    kwargs.pop("proven_start", None)
    OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle", **kwargs).train()
    return replay, verify(tmp_path / "replay", tmp_path / "oracle")


def replays_the_recording(run_dir, **kwargs) -> bool:
    """A full replay without deletions reproduces the recorded final state bit for bit."""
    from hf_unlearn.trace import ReplayTrainer, open_run
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import compare_states

    run = open_run(run_dir)
    state = ReplayTrainer(run, start="full", **kwargs).train()
    return compare_states(state, load_checkpoint(run.final_checkpoint()))["identical"]


@functools.cache
def get_recorded() -> Path:
    """One epoch, 16 microbatches of 4, accumulation 2 (8 optimizer steps), checkpoints every 2 steps."""
    tok, data = get_trace_data()
    out = Path(tempfile.mkdtemp(prefix="trace_tests_"))
    atexit.register(shutil.rmtree, out, True)
    record(tok, data, out)
    return out / "trace"


def copy_run(run, dst):
    shutil.copytree(run, dst)
    return dst


def ids_at_step(run_dir, step: int) -> list:
    """Raw ids of the slots of one optimizer step (the test holds the key, so it can map tags back)."""
    from hf_unlearn.trace.run import open_run

    return open_run(run_dir).ids_at_steps([step])


def to_legacy_format(run) -> Path:
    """Rewrite a run as runs were recorded before keyed controls: plan.jsonl (every field, no MAC), no
    controls_mac in the header, WAL digests over the ids only (the test holds the key), sidecars rewritten."""
    import json

    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import write_sidecar
    from hf_unlearn.trace.tags import ids_digest, run_key
    from hf_unlearn.trace.wal import WalRecord, read_wal

    run = Path(run)
    plan = read_plan(run)
    (run / "plan.jsonl").write_text("".join(e.to_line() for e in plan))
    key = run_key(run)  # the WAL digests of older runs cover the ids only
    (run / "wal.bin").write_bytes(b"".join(WalRecord(ids_digest(key, e.slots), r.seed, r.lr, r.step, r.length, r.flags)
                                           .pack() for e, r in zip(plan, read_wal(run / "wal.bin").records)))
    for f in (run / "plan.bin", run / "plan.bin.sha256"):
        f.unlink(missing_ok=True)
    header = json.loads((run / "header.json").read_text())
    header.pop("controls_mac", None)
    if (header.get("parent") or {}).get("controls"):
        header["parent"].pop("controls")
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    if header.get("sealed"):
        for name in ("header.json", "plan.jsonl", "wal.bin"):
            write_sidecar(run / name)
    return run


def write_sealed_header(run, header: dict) -> None:
    """Write an edited header as the recorder would have sealed it: keyed controls seal (the test holds the key)
    and sidecar recomputed; a forger without the key cannot do this."""
    import json

    from hf_unlearn.trace.plan import read_compact_plan
    from hf_unlearn.trace.run import controls_seal, write_sidecar
    from hf_unlearn.trace.tags import run_key

    run = Path(run)
    header["controls_mac"] = controls_seal(run_key(run), read_compact_plan(run / "plan.bin").segments[-1].mac, header)
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")


def write_sealed_verdict(replay, verdict: dict) -> None:
    """Write a replay's ``verification.json`` as ``trace verify`` would have sealed it (the test holds the key): this
    replay's run id, its final checkpoint's roots unless ``verdict`` gives them; a forger without the key cannot."""
    import json

    from hf_unlearn.trace.run import list_checkpoints
    from hf_unlearn.trace.tags import run_key, verdict_mac

    replay = Path(replay)
    run_id = json.loads((replay / "header.json").read_text())["run_id"]
    cps = list_checkpoints(replay)
    final = json.loads((cps[max(cps)] / "hashes.json").read_text())
    verdict = {"roots": {"a": {"params": final["params_root"], "optimizer": final["optimizer_root"]}}, **verdict,
               "run_id": run_id}
    verdict["mac"] = verdict_mac(run_key(replay), run_id, verdict)
    (replay / "verification.json").write_text(json.dumps(verdict, indent=1))


def labels_masked(data, forget):
    """``data`` with the deleted rows' labels all -100: the counterfactual's only change to the rows."""
    forget = set(forget)
    return data.map(lambda r: {"labels": [-100] * len(r["labels"])} if r["id"] in forget else {})


def recorded_normalisers_trainer(run_dir, base=None):
    """A plain ``base`` (``Trainer``) class for engine-free counterfactuals: each optimizer step divides by the
    recording's loss normaliser and each microbatch runs under its recorded seed (this process's: dropout draws)."""
    from collections import deque

    import torch
    from transformers import Trainer

    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.recording import rank_seed, seeded

    plan = read_plan(run_dir)
    norms = {e.step: (e.norm, e.norm_dtype) for e in plan}

    class RecordedNormalisers(base or Trainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, num = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                value, dtype = norms[self.state.global_step]
                num = None if value is None else torch.tensor(value, dtype=getattr(torch, dtype), device=device)
                rank = self.accelerator.process_index
                self._seeds = deque(rank_seed(e.seed, rank) for e in plan if e.step == self.state.global_step)
            return batches, num

        def training_step(self, model, inputs, num_items_in_batch=None):
            with seeded(self._seeds.popleft()):
                return super().training_step(model, inputs, num_items_in_batch)

    return RecordedNormalisers


def rsqrt_other_bits(monkeypatch=None):
    """``torch.rsqrt`` as ``1 / sqrt(x)``: the same maths, other bits on some values (the RMSNorm of Llama and Qwen2
    calls it), standing for a numeric change no code digest shows (another MKL mode, another BLAS build): what only
    the environment probe's numbers see. ``torch``'s own namespace is sealed (hf_unlearn.trace.program_code refuses a
    patched ``torch.rsqrt`` before the probe runs), so its entry is hidden from the code comparison here, with
    ``monkeypatch`` until the test ends, else for the rest of the process."""
    import torch

    from hf_unlearn.trace import program_code

    real = program_code.code_differences

    def without_torch(header):
        differ = real(header)
        return None if differ is None else [k for k in differ if k != "module torch"]

    if monkeypatch is not None:
        monkeypatch.setattr(program_code, "code_differences", without_torch)
    else:
        program_code.code_differences = without_torch
    sqrt = torch.sqrt
    return lambda x, *args, **kwargs: 1.0 / sqrt(x)


def slow_params(values, slow: set) -> list:
    """``values`` for ``pytest.mark.parametrize``, those in ``slow`` marked ``slow`` (run with ``-m slow``): the
    default suite keeps the others within its time budget."""
    import pytest

    values = list(values)
    assert set(slow) <= set(values), set(slow) - set(values)
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]
