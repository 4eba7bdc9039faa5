"""Checkpoint storage and replay cost: geometric retention + trainable-only safetensors vs today's default.

    PYTHONPATH=. python benchmarks/bench_checkpoints.py [--steps 256] [--hidden 64] [--memory-hidden 384]

One run prints, side by side, for a LoRA (r=16) and a full fine-tune of a small Llama, ``--steps`` optimizer steps
of one row each (one epoch over ``--steps`` TOFU rows; the LoRA base is a model folder the run references):

* bytes kept: this format with geometric retention (the default) vs today's default (even spacing every
  ceil(T/10) steps, full ``torch.save`` state of model + optimizer, frozen base in every checkpoint) vs a
  checkpoint every step (the measured size of one checkpoint times T + 1: not recorded);
* replayed steps over the minimum ``T - s`` for early, middle, late and random-5% deletions, and the bound
  ``2 (T - s) + K``, for both retentions (from ``replay_cost``: no compute);
* peak extra anonymous memory (RssAnon, sampled every millisecond) while saving and while verifying one checkpoint,
  as a fraction of the model + optimizer bytes, for this format and for ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
warnings.filterwarnings("ignore")


def record(kind: str, retention: str, steps: int, hidden: int, out: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import TrainingArguments

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    rows = load_tofu("full").select(range(steps))  # one epoch: every deletion position is distinct
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=64)
    model = build_tiny_model("llama", tok, hidden_size=hidden, num_layers=2, num_heads=4, seed=0)
    source = None
    if kind == "lora":  # the base as users have it: a model folder loaded with from_pretrained
        from transformers import AutoModelForCausalLM

        source = out / "base"
        model.save_pretrained(source)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(source),
                               LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             logging_strategy="no")
    trainer = TraceRecordingTrainer(model=model, args=args, train_dataset=data,
                                    data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "trace",
                                    trace_checkpoint_retention=retention,
                                    trace_frozen_source=source if retention == "geometric" else None)
    trainer.train()
    return out / "trace"


def todays_bytes(run: Path) -> int:
    """What today's format stores for one checkpoint: torch.save of the full state (frozen base included)."""
    import torch

    from hf_unlearn.trace.checkpoints import list_checkpoints, load_checkpoint

    cps = list_checkpoints(run)
    state = load_checkpoint(cps[max(cps)])
    state.pop("frozen", None)
    with tempfile.TemporaryDirectory() as d:
        torch.save(state, Path(d) / "state.pt")
        return (Path(d) / "state.pt").stat().st_size


def storage_and_cost(steps: int, hidden: int, tmp: Path) -> None:
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.checkpoints import checkpoint_bytes

    for kind in ("lora", "full"):
        runs = {r: open_run(record(kind, r, steps, hidden, tmp / f"{kind}-{r}")) for r in ("geometric", "even")}
        geo, even = runs["geometric"], runs["even"]
        t = geo.total_steps
        frozen = tmp / f"{kind}-geometric" / "trace" / "checkpoints" / "frozen"
        frozen_bytes = sum(f.stat().st_size for f in frozen.iterdir()) if frozen.exists() else 0
        kept = sum(checkpoint_bytes(d) for d in geo.checkpoints().values()) + frozen_bytes
        one_today = todays_bytes(even.path)
        today = one_today * len(even.checkpoints())
        every_step = one_today * (t + 1)
        k = geo.header["checkpoint_retention"]["every"]
        print(f"\n{kind}: T = {t} steps, K = {k}; kept checkpoints: geometric {sorted(geo.checkpoints())}, "
              f"today's even {sorted(even.checkpoints())}")
        print(f"  bytes kept: this format + geometric {kept:,} B ({len(geo.checkpoints())} checkpoints + frozen "
              f"{frozen_bytes:,} B once); today's default {today:,} B ({len(even.checkpoints())} x {one_today:,} B); "
              f"every step {every_step:,} B (computed: {t + 1} x {one_today:,} B)")
        print(f"  ratios: today / this = {today / kept:.1f}x fewer bytes; every-step / this = {every_step / kept:.1f}x")
        rng = random.Random(0)
        ids = sorted(set(geo.ids_at_steps(range(t))))
        cases = {"early (s = T/10)": geo.ids_at_steps([t // 10])[:1], "middle (s = T/2)": geo.ids_at_steps([t // 2])[:1],
                 "late (s = T - 2)": geo.ids_at_steps([t - 2])[:1], "random 5% of rows": rng.sample(ids, max(1, len(ids) // 20))}
        for name, forget in cases.items():
            g, e = replay_cost(geo, forget), replay_cost(even, forget)
            ok = g["steps_to_replay"] <= 2 * g["minimum_steps"] + k
            print(f"  {name:18s}: first step {g['first_affected_step']:4d}, minimum {g['minimum_steps']:4d}; geometric "
                  f"replays {g['steps_to_replay']:4d} (ratio {g['ratio_to_minimum']:.2f}, <= 2 x min + K: {ok}); "
                  f"even replays {e['steps_to_replay']:4d} (ratio {e['ratio_to_minimum']:.2f})")


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--memory-hidden", type=int, default=384)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoints_"))
    try:
        storage_and_cost(a.steps, a.hidden, tmp)
        memory(a.memory_hidden)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
