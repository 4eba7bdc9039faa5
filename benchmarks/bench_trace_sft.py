"""Exact deletion for trl.SFTTrainer: recording overhead against a plain SFTTrainer with the same checkpoint cadence,
where it goes, and a late deletion (suffix replay) against the oracle.

    PYTHONPATH=. python benchmarks/bench_trace_sft.py [--steps 32] [--every 8] [--repeats 3] [--padding-free]
                                                      [--profile] [--skip-deletion] [--checkpoint-costs] [--lora R]

Three configurations alternate (order rotated per repeat; median and range of the repeats reported, ratios side by
side): a plain ``SFTTrainer`` saving a resumable checkpoint every ``--every`` steps (model + optimizer + scheduler +
RNG + tokenizer), and ``trace_recording(SFTTrainer)`` with ``trace_checkpoint_steps=--every`` (no Trainer
checkpoints), with the end-of-recording self-check on and off. All start from the same weights, on TOFU
prompt-completion rows (completion-only loss), batch 4 x accumulation 2, ``max_length`` 128, fp32, SFTConfig's
defaults otherwise (activation checkpointing on). CPU time is user + system of this process (the steadier measure
on a shared machine); wall time is shown too. ``--padding-free`` records with ``padding_free=True``.

The recording runs are broken down by cause: the library functions below are wrapped with a CPU-time counter
(exclusive: a nested counted call is charged to itself, not to its caller), so each line is measured in the very
runs the ratio comes from. ``--profile`` runs one short recording under cProfile instead and prints the top entries.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")

# (label, module, attribute[, class]): the recording costs, each charged its exclusive CPU time (the first two, the
# self-check's, inclusive: what runs inside them is charged to them)
CAUSES = [
    ("self-check (replay of the first step(s), compare)", "hf_unlearn.trace.self_check", "self_check"),
    ("self-check: state hashes kept at step N (in memory)", "hf_unlearn.trace.recorder.selfcheck",
     "keep_reference"),
    ("checkpoint: tensor hashing (SHA-256)", "hf_unlearn.trace.hashing", "checkpoint_hashes"),
    ("checkpoint: safetensors writes", "hf_unlearn.trace.checkpoints", "_save_safetensors"),
    ("checkpoint: thinning (geometric retention)", "hf_unlearn.trace.checkpoints", "remove_checkpoint_dir"),
    ("checkpoint: rest (capture, meta, index, sidecars)", "hf_unlearn.trace.writer", "save_checkpoint"),
    ("dummy-weight probe (forward + backward, 2 rows)", "hf_unlearn.trace.recording",
     "_check_dummy_has_no_influence", "TraceRecordingMixin"),
    ("preflight checks (collator, columns, ids)", "hf_unlearn.trace.recording", "trace_preflight",
     "TraceRecordingMixin"),
    ("token store save + fingerprint", "hf_unlearn.trace.store", "save_store"),
    ("config + tokenizer save", "hf_unlearn.trace.recording.opening", "save_model_files"),
    ("header (collator rebuild check, ...)", "hf_unlearn.trace.recording", "_trace_header_dict",
     "TraceRecordingMixin"),
    ("plan / WAL / manifest appends", "hf_unlearn.trace.recording", "append", "TraceWriter"),
    ("per-batch digests", "hf_unlearn.trace.recording.segments", "batch_digest"),
    ("seal + sidecars", "hf_unlearn.trace.recording", "seal", "TraceWriter"),
]


class Breakdown:
    """Exclusive CPU seconds per cause, by wrapping the functions in :data:`CAUSES` (module or class attributes)."""

    def __init__(self):
        import importlib

        self.totals: dict[str, float] = {}
        self._stack: list[list[float]] = []
        self._inclusive = {CAUSES[0][0], CAUSES[1][0]}
        self._inside = 0
        self._undo = []
        for label, module, attr, *cls in CAUSES:
            owner = importlib.import_module(module)
            if cls:
                owner = getattr(owner, cls[0])
            original = getattr(owner, attr)
            setattr(owner, attr, self._wrap(label, original))
            self._undo.append((owner, attr, original))

    def _wrap(self, label, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            self._inside += label in self._inclusive
            self._stack.append([time.process_time(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= label in self._inclusive
                start, children = self._stack.pop()
                spent = time.process_time() - start
                self.totals[label] = self.totals.get(label, 0.0) + spent - children
                if self._stack:
                    self._stack[-1][1] += spent
        return wrapper

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out

    def close(self):
        for owner, attr, original in self._undo:
            setattr(owner, attr, original)


def stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def checkpoint_costs(model_path: str, out: Path, repeats: int = 3) -> None:
    """CPU seconds of one checkpoint, on their own: the trace's at step 0 and after a step (and their hashing), what a
    ``Trainer`` checkpoint writes, and building the model with and without its random initialisation."""
    import torch
    from safetensors.torch import save_file
    from transformers.initialization import no_init_weights

    from hf_unlearn import load_model
    from hf_unlearn.trace.checkpoints import FrozenTensors, capture_state, save_checkpoint
    from hf_unlearn.trace.hashing import checkpoint_hashes

    model = load_model(model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def cpu(label, f):
        xs = []
        for i in range(repeats):
            c = time.process_time()
            f(i)
            xs.append(time.process_time() - c)
        print(f"  {label:66s} {stats(xs)}", flush=True)

    def trace_checkpoint(step):
        return lambda i: save_checkpoint(out / f"s{step}-{i}", step, model, opt, frozen=FrozenTensors(out / f"s{step}-{i}"))

    def trainer_checkpoint(i):
        d = out / f"trainer-{i}"
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                  str(d / "model.safetensors"))
        torch.save(opt.state_dict(), d / "optimizer.pt")

    def build(skip):
        def f(i):
            if skip:
                with no_init_weights():
                    type(model)._from_config(model.config, dtype=torch.float32).tie_weights()
            else:
                type(model)._from_config(model.config, dtype=torch.float32)
        return f

    print(f"one checkpoint on its own (CPU s, median [min-max] of {repeats}):")
    cpu("trace checkpoint at step 0 (model only, no optimizer state yet)", trace_checkpoint(0))
    cpu("  of which SHA-256 of every tensor", lambda i: checkpoint_hashes(capture_state(model, opt, 0)))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    cpu("trace checkpoint after a step (model + AdamW moments)", trace_checkpoint(1))
    cpu("  of which SHA-256 of every tensor", lambda i: checkpoint_hashes(capture_state(model, opt, 1)))
    cpu("Trainer-style checkpoint (safetensors model + torch.save optimizer)", trainer_checkpoint)
    cpu("model built from its config, random initialisation", build(False))
    cpu("model built from its config, initialisation skipped (replays)", build(True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows-tokens", type=int, default=128, help="max_length (SFTConfig)")
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--tmp", default=None, help="scratch folder (checkpoints: ~1.6 GB each at 135M parameters)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core machine: 1)")
    p.add_argument("--padding-free", action="store_true")
    p.add_argument("--profile", action="store_true", help="one recording under cProfile, top 40 by own time")
    p.add_argument("--skip-deletion", action="store_true", help="no late deletion / oracle at the end")
    p.add_argument("--arms", default="sft+ckpt,trace,trace-nocheck")
    p.add_argument("--lora", type=int, default=0, help="train a LoRA of this rank on q/v (0: full fine-tune); the "
                                                       "base is referenced where it was loaded from, by default")
    p.add_argument("--checkpoint-costs", action="store_true", help="only time one checkpoint's parts on their own")
    a = p.parse_args()
    if a.checkpoint_costs:
        out = Path(tempfile.mkdtemp(prefix="bench_sft_ckpt_", dir=a.tmp))
        try:
            import torch

            torch.set_num_threads(a.threads)
            checkpoint_costs(a.model, out)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return
    import torch

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(a.threads)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_unlearn import (
        OracleReplayTrainer,
        RedactedReplayTrainer,
        load_model,
        load_tofu,
        load_tokenizer,
        redact_store,
        trace_recording,
        verify_replay,
    )
    from hf_unlearn.trace import open_run, replay_cost

    tmp = Path(tempfile.mkdtemp(prefix="bench_sft_", dir=a.tmp))
    try:
        tok = load_tokenizer(a.model)
        base = load_model(a.model)
        rows = load_tofu("full").select(range(8 * a.steps))
        data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"],
                                  "completion": [" " + x for x in rows["answer"]]})

        def run(kind: str, out: Path) -> tuple[float, float, dict]:
            checkpoints = kind == "sft+ckpt"
            args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.steps, learning_rate=2e-5, warmup_steps=1, max_grad_norm=1.0, report_to=[],
                             use_cpu=True, bf16=False, seed=0, disable_tqdm=True, logging_strategy="no",
                             max_length=None if a.padding_free else a.rows_tokens, padding_free=a.padding_free,
                             save_strategy="steps" if checkpoints else "no", save_steps=a.every)
            model = copy.deepcopy(base)
            if a.lora:
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=2 * a.lora, task_type="CAUSAL_LM",
                                                         target_modules=["q_proj", "v_proj"]))
            t, c = time.perf_counter(), time.process_time()  # dataset preparation included, as a user sees it
            if kind.startswith("trace"):
                trainer = trace_recording(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tok,
                                                      trace_dir=out / "trace", trace_checkpoint_steps=a.every,
                                                      trace_self_check=kind == "trace")
            else:
                trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
            trainer.train()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            fid = {}
            if kind.startswith("trace"):
                fid = open_run(out / "trace").header.get("fidelity", {}).get("recording", {})
            return wall, cpu, fid

        if a.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            print(run("trace", tmp / "profile")[:2])
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(60)
            return

        kinds = a.arms.split(",")
        times = {k: [] for k in kinds}
        kept = {k: [] for k in kinds}  # bytes the run leaves on disk (checkpoints; the trace folder)
        causes = {k: [] for k in kinds if k.startswith("trace")}
        meter = Breakdown()
        for r in range(a.repeats):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                out = tmp / f"{kind}-{r}"
                meter.take()
                wall, cpu, fid = run(kind, out)
                times[kind].append((wall, cpu))
                kept[kind].append(sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and not f.is_symlink()))
                if kind in causes:
                    causes[kind].append(meter.take())
                    print("    " + "; ".join(f"{label.split(' (')[0]} {v:.1f}" for label, v in causes[kind][-1].items()),
                          flush=True)
                check = f"  self-check {fid.get('steps')} reproduced={fid.get('reproduced')}" if fid else ""
                print(f"repeat {r} {kind:13s} wall {wall:7.1f} s  CPU {cpu:7.1f} s{check}", flush=True)
                if not (kind == "trace" and r == a.repeats - 1):
                    shutil.rmtree(out, ignore_errors=True)
        meter.close()
        print(f"\nrecording overhead, {a.steps} optimizer steps of 8 rows, checkpoints every {a.every} steps "
              f"(median [min-max] of {a.repeats}; ratio of medians, and per repeat):")
        ref = "sft+ckpt"
        for i, clock in enumerate(("wall", "CPU")):
            for k in kinds:
                xs = [x[i] for x in times[k]]
                line = f"  {clock:4s} {k:13s} {stats(xs)} s"
                if ref in times and k != ref:
                    per = [x[i] / y[i] for x, y in zip(times[k], times[ref])]
                    line += (f"  ratio {statistics.median(xs) / statistics.median([y[i] for y in times[ref]]):.3f}"
                             f" (per repeat {', '.join(f'{q:.3f}' for q in per)})")
                print(line)
        if ref in kept:
            print(f"bytes kept on disk (median of {a.repeats}; a plain run's checkpoints, a recording's trace folder):")
            for k in kinds:
                med = statistics.median(kept[k])
                print(f"  {k:13s} {med:14,.0f} B" + (f"  ratio {med / statistics.median(kept[ref]):.3f}"
                                                     if k != ref else ""))
        if "trace" in causes and ref in times:  # the self-check's own cost, measured in the same runs, taken out
            base_cpu = [y[1] for y in times[ref]]
            off = [t[1] - c.get(CAUSES[0][0], 0.0) - c.get(CAUSES[1][0], 0.0)
                   for t, c in zip(times["trace"], causes["trace"])]
            print(f"  CPU  trace minus its self-check {stats(off)} s  ratio "
                  f"{statistics.median(off) / statistics.median(base_cpu):.3f} (per repeat "
                  f"{', '.join(f'{x / y:.3f}' for x, y in zip(off, base_cpu))})")
        for k, runs in causes.items():
            print(f"\nwhere {k}'s CPU time goes (exclusive seconds, median [min-max] of {len(runs)}):")
            labels = [c[0] for c in CAUSES if any(c[0] in r_ for r_ in runs)]
            for label in labels:
                print(f"  {label:52s} {stats([r_.get(label, 0.0) for r_ in runs])}")
            print(f"  {'total of the above':52s} {stats([sum(r_.values()) for r_ in runs])}")
        if a.skip_deletion or "trace" not in kinds:
            return
        run_ = open_run(tmp / f"trace-{a.repeats - 1}" / "trace")
        forget = run_.ids_at_steps([run_.total_steps - 1])[:2]
        cost = replay_cost(run_, forget)
        redact_store(run_.store_path, forget, tmp / "store", run_.key)
        t, c = time.perf_counter(), time.process_time()
        RedactedReplayTrainer(run_, tmp / "store", forget, tmp / "replay").train()
        replay_s = (time.perf_counter() - t, time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        OracleReplayTrainer(run_, forget, out_dir=tmp / "oracle").train()
        oracle_s = (time.perf_counter() - t, time.process_time() - c)
        report = verify_replay(tmp / "replay", tmp / "oracle")
        p_, o_ = report["params"], report["optimizer"]
        print(f"\nlate deletion of {len(forget)} rows: suffix replay of {cost['steps_to_replay']} of {cost['total_steps']} "
              f"steps {replay_s[1]:.0f} s CPU ({replay_s[0]:.0f} s wall), oracle (full replay) {oracle_s[1]:.0f} s CPU "
              f"({oracle_s[0]:.0f} s wall), ratio {replay_s[1] / oracle_s[1]:.2f}; {p_['mismatched_elements']} of "
              f"{p_['elements']:,} parameter and {o_['mismatched_elements']} of {o_['elements']:,} optimizer elements "
              f"differ -> {'VERIFIED' if report['verified'] else 'NOT VERIFIED'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
