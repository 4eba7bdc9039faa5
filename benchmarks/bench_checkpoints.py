"""Checkpoint storage and replay cost: geometric retention + trainable-only safetensors vs the previous default.

    PYTHONPATH=. python benchmarks/bench_checkpoints.py [--steps 256] [--hidden 64] [--memory-hidden 384]
    PYTHONPATH=. python benchmarks/bench_checkpoints.py --model ../shared/models/SmolLM2-135M-Instruct \
        --kinds lora --lora-r 16 --steps 200 --seq-len 32 --replay late,middle,early

One run prints, side by side, for a LoRA (r=16) and a full fine-tune (a small Llama, or ``--model``), ``--steps``
optimizer steps of ``--batch`` rows each (one epoch over TOFU rows; the LoRA base is a model folder the run
references, ``trace_frozen_source``):

* bytes kept: this format with geometric retention (the default, K = T // 32) vs the previous default (even
  spacing every ceil(T/10) steps, each checkpoint's full state written by ``torch.save``, frozen base included) vs a
  checkpoint every step (the measured size of one checkpoint times the steps: not recorded). ``--even measured``
  records the even run too; ``--even rule`` applies its rule (``retention.dense_steps``) to the geometric run's plan;
* replayed steps over the minimum ``T - s`` for early (s = T/10), middle (T/2), late (T - 2) and random-5%
  deletions, against the bound ``2 (T - s) + K``, for both retentions (from ``replay_cost``: no compute); for the
  deletions named in ``--replay``, a real redacted replay and the oracle, compared bit for bit (VERIFIED), with
  their CPU seconds side by side;
* (tiny mode only) peak extra anonymous memory (RssAnon, sampled every millisecond) while saving and while
  verifying one checkpoint, as a fraction of the model + optimizer bytes, for this format and for
  ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
warnings.filterwarnings("ignore")


def prepare_real(model: Path, work: Path) -> Path:
    """A model folder ``from_pretrained`` loads: ``model`` itself, or its one ``.gguf`` de-quantized once into
    ``work/base`` (``save_pretrained`` refuses a GGUF-loaded model: its weights go into a plain model of its class)."""
    ggufs = sorted(model.glob("*.gguf"))
    if not ggufs:
        return model
    base = work / "base"
    if not (base / "model.safetensors").exists():
        import torch

        from hf_unlearn.models import load_model, load_tokenizer

        load_model(model, gguf_file=ggufs[0].name, dtype=torch.float32).save_pretrained(base)  # the library's path
        load_tokenizer(model, gguf_file=ggufs[0].name).save_pretrained(base)
    return base


def training_rows(tok, n: int, seq_len: int):
    """The first ``n`` TOFU rows whose plain prompt leaves room for an answer token in ``seq_len`` tokens."""
    from hf_unlearn.data import load_tofu, tokenize_qa
    from hf_unlearn.data.tokenize import format_prompt

    rows = load_tofu("full")
    fits = [i for i, q in enumerate(rows["question"])
            if len(tok(format_prompt(tok, q, False))["input_ids"]) < seq_len][:n]
    if len(fits) < n:
        raise SystemExit(f"only {len(fits)} TOFU rows fit in --seq-len {seq_len}: raise it or lower --steps")
    return tokenize_qa(rows.select(fits), tok, max_length=seq_len, use_chat_template=False)


def record(kind: str, retention: str, a, out: Path):
    """One recording; returns (trace folder, CPU seconds of ``train()``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    n = a.steps * a.batch  # one epoch: every deletion position is distinct
    if a.base is None:
        rows = load_tofu("full").select(range(n))
        tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
        data = tokenize_qa(rows, tok, max_length=a.seq_len)
        model = build_tiny_model("llama", tok, hidden_size=a.hidden, num_layers=2, num_heads=4, seed=0)
        source = None
        if kind == "lora":  # the base as users have it: a model folder loaded with from_pretrained
            source = out / "base"
            model.save_pretrained(source)
    else:
        tok = AutoTokenizer.from_pretrained(a.base)
        data = training_rows(tok, n, a.seq_len)
        source = a.base if kind == "lora" else None
    if source is not None or a.base is not None:
        model = AutoModelForCausalLM.from_pretrained(source or a.base)
    if kind == "lora":
        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    lr = a.lr or (1e-3 if a.base is None else 2e-4 if kind == "lora" else 1e-5)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=a.batch, max_steps=a.steps,
                             learning_rate=lr, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, logging_strategy="no")
    trainer = TraceRecordingTrainer(model=model, args=args, train_dataset=data,
                                    data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "trace",
                                    trace_checkpoint_retention=retention,
                                    trace_frozen_source=source if retention == "geometric" else None)
    cpu = time.process_time()
    trainer.train()
    return out / "trace", time.process_time() - cpu


def previous_format_bytes(run: Path, step: int) -> int:
    """What the previous format stored for one checkpoint: torch.save of the full state (frozen base included)."""
    import torch

    from hf_unlearn.trace.checkpoints import list_checkpoints, load_checkpoint

    state = load_checkpoint(list_checkpoints(run)[step])
    state.pop("frozen", None)
    with tempfile.TemporaryDirectory(dir=run.parent) as d:
        torch.save(state, Path(d) / "state.pt")
        del state
        return (Path(d) / "state.pt").stat().st_size


def deletion_cases(run, t: int, batch: int) -> dict:
    """early / middle / late / random 5%: one row of the step at T/10, T/2, T - 2; a seeded 5% of all rows."""
    rng = random.Random(0)
    ids = sorted(set(run.ids_at_steps(range(t))))
    return {"early": run.ids_at_steps([t // 10])[:1], "middle": run.ids_at_steps([t // 2])[:1],
            "late": run.ids_at_steps([t - 2])[:1], "random-5%": rng.sample(ids, max(1, len(ids) // 20))}


def real_deletion(run, forget, work: Path) -> dict:
    """Redact, replay the suffix from the redacted store, run the oracle (full replay, deleted rows as weight-0
    dummies) and compare bit for bit; CPU seconds of each ``train()`` measured in this process."""
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, redact_store, verify

    redact_store(run.store_path, forget, work / "store", run.key)
    replay = RedactedReplayTrainer(run, work / "store", forget, work / "replay", start="suffix")
    cpu = time.process_time()
    replay.train()
    replay_cpu = time.process_time() - cpu
    oracle = OracleReplayTrainer(run, forget, out_dir=work / "oracle")
    cpu = time.process_time()
    oracle.train()
    oracle_cpu = time.process_time() - cpu
    report = verify(work / "replay", work / "oracle")
    out = {"start": replay.start_step, "verified": bool(report["verified"]), "replay_cpu": replay_cpu,
           "oracle_cpu": oracle_cpu, "problems": report["provenance"]["problems"]}
    shutil.rmtree(work, ignore_errors=True)
    return out


def kept_bytes(run) -> tuple[int, int]:
    """Bytes of the kept checkpoint folders, and of the frozen store the run saved once (0 when referenced)."""
    from hf_unlearn.trace.checkpoints import checkpoint_bytes

    frozen = run.path / "checkpoints" / "frozen"
    frozen_bytes = sum(f.stat().st_size for f in frozen.iterdir()) if frozen.exists() else 0
    return sum(checkpoint_bytes(d) for d in run.checkpoints().values()) + frozen_bytes, frozen_bytes


def storage_and_cost(kind: str, a, tmp: Path) -> None:
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.retention import default_every, dense_steps, start_for

    # the previous default first: measured, then its checkpoints are removed before the geometric run (disk)
    even_costs, even_kept = {}, None
    if a.even == "measured":
        path, even_cpu = record(kind, "even", a, tmp / f"{kind}-even")
        even = open_run(path)
        even_kept = sorted(even.checkpoints())
        even_new_bytes, _ = kept_bytes(even)
        one_prev, step0_prev = previous_format_bytes(even.path, max(even_kept)), previous_format_bytes(even.path, 0)
        cases = deletion_cases(even, even.total_steps, a.batch)
        even_costs = {name: replay_cost(even, ids) for name, ids in cases.items()}
        even_ids = even.ids_at_steps(range(even.total_steps))
        shutil.rmtree(tmp / f"{kind}-even", ignore_errors=True)
        print(f"\n{kind}: even run recorded in {even_cpu:.0f} CPU s")
    path, geo_cpu = record(kind, "geometric", a, tmp / f"{kind}-geometric")
    geo = open_run(path)
    t = geo.total_steps
    k = geo.header["checkpoint_retention"]["every"]
    if a.even == "measured":
        assert geo.ids_at_steps(range(t)) == even_ids, "the two recordings must follow the same plan"
    else:  # the previous rule applied to this run's plan (no second recording)
        cases = deletion_cases(geo, t, a.batch)
        even_kept = dense_steps(t, default_every(t, "even"), "even")
        one_prev, step0_prev = previous_format_bytes(geo.path, t), previous_format_bytes(geo.path, 0)
        even_new_bytes = None
    kept, frozen_bytes = kept_bytes(geo)
    previous = one_prev * (len(even_kept) - 1) + step0_prev
    every_step_prev = one_prev * t + step0_prev
    from hf_unlearn.trace.checkpoints import checkpoint_bytes

    one_now = checkpoint_bytes(geo.checkpoints()[t])
    every_step_now = one_now * (t + 1) + frozen_bytes
    print(f"\n{kind}: T = {t} optimizer steps (batch {a.batch}), K = {k}; recording {geo_cpu:.0f} CPU s; kept "
          f"checkpoints: geometric {sorted(geo.checkpoints())}, previous default (even every "
          f"{default_every(t, 'even')}, {a.even}) {even_kept}")
    print(f"  bytes kept: this format + geometric {kept:,} B ({len(geo.checkpoints())} checkpoints + frozen "
          f"{frozen_bytes:,} B once); previous default {previous:,} B ({len(even_kept) - 1} x {one_prev:,} B + step 0 "
          f"{step0_prev:,} B, torch.save of the full state)"
          + (f"; even retention in this format {even_new_bytes:,} B" if even_new_bytes is not None else ""))
    print(f"  every step (computed, not recorded): previous format {every_step_prev:,} B; this format "
          f"{every_step_now:,} B ({t + 1} x {one_now:,} B + frozen once)")
    print(f"  ratios: previous default / this = {previous / kept:.1f}x fewer bytes; every step (previous format) / "
          f"this = {every_step_prev / kept:.1f}x; every step (this format) / this = {every_step_now / kept:.1f}x")
    worst, costs = 0.0, {}
    for name, forget in cases.items():
        g = costs[name] = replay_cost(geo, forget)
        ok = g["steps_to_replay"] <= 2 * g["minimum_steps"] + k
        worst = max(worst, g["steps_to_replay"] / (2 * g["minimum_steps"] + k))
        if name in even_costs:
            e_steps = even_costs[name]["steps_to_replay"]
        else:
            e_steps = t - start_for(g["first_affected_step"], even_kept)
        print(f"  {name:10s}: first step {g['first_affected_step']:4d}, minimum {g['minimum_steps']:4d}; geometric "
              f"replays {g['steps_to_replay']:4d} from step {g['start_checkpoint']} (ratio {g['ratio_to_minimum']:.2f}, "
              f"<= 2 x min + K = {2 * g['minimum_steps'] + k}: {ok}); previous default replays {e_steps:4d} (ratio "
              f"{e_steps / g['minimum_steps']:.2f})")
    print(f"  every deletion within 2 x min + K: {worst <= 1} (worst steps / bound = {worst:.2f})", flush=True)
    for name in sorted(a.replay, key=lambda n: costs[n]["steps_to_replay"]):  # the cheapest first
        r = real_deletion(geo, cases[name], tmp / f"{kind}-delete")
        assert r["start"] == costs[name]["start_checkpoint"], (r["start"], costs[name])
        print(f"  real {name} deletion: replay of {t - r['start']} steps from step {r['start']} {r['replay_cpu']:.0f} "
              f"CPU s, oracle ({t} steps from step 0) {r['oracle_cpu']:.0f} CPU s, replay / oracle = "
              f"{r['replay_cpu'] / r['oracle_cpu']:.2f}; "
              + ("VERIFIED (bit-identical to the oracle)" if r["verified"] else f"NOT VERIFIED {r['problems']}"),
              flush=True)
    shutil.rmtree(tmp / f"{kind}-geometric", ignore_errors=True)


_MEMORY_CHILD = r"""
import json, sys, tempfile, threading, time
from pathlib import Path
import torch
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
from hf_unlearn.trace.checkpoints import capture_state, load_checkpoint, save_checkpoint, verify_checkpoint_files

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak = [0]; stop = [False]
def sample():
    while not stop[0]:
        peak[0] = max(peak[0], anon()); time.sleep(0.001)
mode, hidden = sys.argv[1], int(sys.argv[2])
tok = build_tiny_tokenizer(["a b c d e f g h"], vocab_size=64)
model = build_tiny_model("llama", tok, hidden_size=hidden, num_layers=4, num_heads=4, seed=0)
model.resize_token_embeddings(8192)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
opt.step(); opt.zero_grad(set_to_none=True)
size = sum(t.numel() * t.element_size() for t in capture_state(model, opt, 1)["model"].values())
size += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
run = Path(tempfile.mkdtemp()); d = run / "checkpoints" / "step-00000001"
def measured(fn):
    base = anon(); peak[0] = base; stop[0] = False
    t = threading.Thread(target=sample); t.start(); fn(); stop[0] = True; t.join()
    return (peak[0] - base) / size
if mode == "safetensors":
    save = measured(lambda: save_checkpoint(run, 1, model, opt))
    verify = measured(lambda: verify_checkpoint_files(d))
else:
    d.mkdir(parents=True)
    save = measured(lambda: torch.save(capture_state(model, opt, 1), d / "state.pt"))
    verify = measured(lambda: torch.load(d / "state.pt", weights_only=True))
print(json.dumps({"bytes": size, "save": save, "verify": verify}))
"""


def memory(hidden: int) -> None:
    import json

    print(f"\npeak extra anonymous memory (RssAnon) over the model + optimizer bytes (Llama, hidden {hidden}, "
          "4 layers, vocab 8192, AdamW after one step):")
    for mode in ("safetensors", "torch.save"):
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, mode, str(hidden)], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        what = ("save_checkpoint / verify_checkpoint_files (streamed)" if mode == "safetensors"
                else "torch.save / torch.load (today's)")
        print(f"  {mode:11s} {what}: model + optimizer {r['bytes'] / 1e6:.1f} MB; while saving +{100 * r['save']:.1f}%"
              f" ({1 + r['save']:.2f}x), while verifying/loading +{100 * r['verify']:.1f}% ({1 + r['verify']:.2f}x)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64, help="tiny Llama's hidden size (without --model)")
    p.add_argument("--memory-hidden", type=int, default=384, help="the memory measurement's model (without --model)")
    p.add_argument("--model", type=Path, default=None,
                   help="a real model: a from_pretrained folder, or a folder with one .gguf (de-quantized once)")
    p.add_argument("--kinds", default="lora,full", help="comma-separated: lora, full")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="max tokens a row (default 64 tiny, 32 with --model)")
    p.add_argument("--batch", type=int, default=1, help="rows per optimizer step")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--replay", default="", help="comma-separated deletions to replay for real against the oracle: "
                   "early, middle, late, random-5%%")
    p.add_argument("--even", choices=("measured", "rule"), default="measured",
                   help="the previous default: recorded side by side, or its rule applied to the geometric run's plan")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    a = p.parse_args(argv)
    a.replay = [x for x in a.replay.split(",") if x]
    unknown = set(a.replay) - {"early", "middle", "late", "random-5%"}
    if unknown or not set(a.kinds.split(",")) <= {"lora", "full"}:
        p.error(f"--replay takes early, middle, late, random-5% and --kinds lora, full (got {a.replay}, {a.kinds})")
    a.seq_len = a.seq_len or (32 if a.model else 64)
    return a


def main() -> None:
    a = parse_args()
    tmp = a.work or Path(tempfile.mkdtemp(prefix="bench_checkpoints_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        a.base = prepare_real(a.model, tmp) if a.model else None
        for kind in a.kinds.split(","):
            storage_and_cost(kind, a, tmp)
        if a.model is None:
            memory(a.memory_hidden)
    finally:
        if a.work is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
