"""Single LoRA runs on the real SmolLM2-135M (grouped-query attention): recording overhead of SFT LoRA and DPO LoRA
against the plain trainers with the same checkpoint cadence, and `forget --oracle` of a late deletion against the
recording (issue #42's benchmark).

    PYTHONPATH=. python benchmarks/bench_real_configs.py [--sft-steps 12] [--dpo-steps 8] [--every 4] [--repeats 2]

Per kind, the plain trainer (``SFTTrainer`` / ``DPOTrainer`` with ``save_strategy="steps"``, ``save_steps=--every``:
Trainer checkpoints of the adapter and the optimizer) and the recording one (``trace_recording(...)``,
``trace_checkpoint_steps=--every``, the library's default retention, ``--self-check`` (default: the library's),
no Trainer checkpoints)
alternate, order rotated per repeat; CPU time (user + system of this process) and wall time of ``train()``, median
over the repeats, and the CPU time of construction plus ``train()`` (the recorder's preflight, whose dummy-weight
probe runs a forward and backward pass at construction, two for DPO). Then ``hf_unlearn.forget(RUN, ids, oracle=True)`` of one id served at the last step (a late
deletion): the replay's wall time against the recording's, and the oracle's. LoRA r=8 on q_proj and v_proj, fp32,
SDPA, batch 4 (SFT) / 2 pairs (DPO), TOFU rows, 64 tokens at most.

The late deletion's own compute (``--deletion-repeats N``, N > 0): ``forget(RUN, ids)`` without the oracle, CPU time
of the whole call (checks, environment probe, redaction, replay, merge, save), against the recording's CPU time; two
arms alternate: ``probe-once`` (the library: a probe step the replay re-runs with no deletion is left to it) and
``probe-twice`` (the probe runs every step itself, as before). The run is proven first when its recording was too
long to prove itself (``trace prove``: a one-time cost, not counted). ``--deletion-only``: one recording, no plain
arm.
"""

from __future__ import annotations

import argparse
import copy
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


def timed(fn) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=12)
    p.add_argument("--dpo-steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="checkpoint cadence of both arms")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tmp", default=None)
    p.add_argument("--only", choices=["sft", "dpo"], default=None)
    p.add_argument("--deletion-repeats", type=int, default=0, help="late deletions without the oracle, per arm")
    p.add_argument("--deletion-only", action="store_true", help="one recording (no plain arm), then the deletions")
    p.add_argument("--no-deletion", action="store_true", help="the recording overhead only (no forget --oracle)")
    p.add_argument("--self-check", default="default", choices=["default", "false", "1", "all"],
                   help="the recording's trace_self_check: the library's default (a run whose training took at most "
                        "AUTO_PROVE_SECONDS is proven whole at its end: about its compute again), false (the recording "
                        "alone), 1 (the first step replayed), all")
    a = p.parse_args()
    import torch

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(a.threads)
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_unlearn import forget, load_tofu, trace_recording
    from hf_unlearn.models import load_model, load_tokenizer
    from hf_unlearn.trace import open_run

    out = Path(tempfile.mkdtemp(prefix="bench_real_configs_", dir=a.tmp))
    try:
        tok, base = load_tokenizer(a.model), load_model(a.model, dtype=torch.float32)
        rows = load_tofu("full", SHARED / "data" / "tofu").select(range(4 * a.sft_steps + 1))
        answers = [" " + x for x in rows["answer"]]
        data = {"sft": Dataset.from_dict({"id": rows["id"][:-1], "prompt": rows["question"][:-1],
                                          "completion": answers[:-1]}),
                "dpo": Dataset.from_dict({"id": rows["id"][:2 * a.dpo_steps],
                                          "prompt": rows["question"][:2 * a.dpo_steps],
                                          "chosen": answers[:2 * a.dpo_steps],
                                          "rejected": answers[1:2 * a.dpo_steps + 1]})}
        steps = {"sft": a.sft_steps, "dpo": a.dpo_steps}

        def config(kind, name, arm):
            save = dict(save_strategy="steps", save_steps=a.every) if arm == "plain" else dict(save_strategy="no")
            common = dict(output_dir=str(out / name), max_steps=steps[kind], learning_rate=1e-4,
                          max_length=a.max_length, report_to=[], seed=0, use_cpu=True, logging_steps=1000,
                          disable_tqdm=True, **save)
            if kind == "sft":
                return SFTConfig(per_device_train_batch_size=4, **common)
            return DPOConfig(per_device_train_batch_size=2, dataset_num_proc=None, **common)

        def lora():
            return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")

        kinds = [a.only] if a.only else ["sft", "dpo"]
        self_check = {} if a.self_check == "default" else {
            "trace_self_check": {"false": False, "1": 1, "all": "all"}[a.self_check]}
        results = {}
        for kind in kinds:
            cls = {"sft": SFTTrainer, "dpo": DPOTrainer}[kind]
            times: dict[str, list[tuple[float, float]]] = {"plain": [], "trace": []}
            inits: dict[str, list[tuple[float, float]]] = {"plain": [], "trace": []}  # the trainer's construction
            for r in range(1 if a.deletion_only else a.repeats):
                for arm in ["trace"] if a.deletion_only else (["plain", "trace"] if r % 2 == 0 else ["trace", "plain"]):
                    name = f"{kind}-{arm}-{r}"
                    kw = {} if arm == "plain" else dict(trace_checkpoint_steps=a.every, trace_dir=out / name / "trace",
                                                        **self_check)
                    model = copy.deepcopy(base)
                    c, w = time.process_time(), time.perf_counter()
                    t = (cls if arm == "plain" else trace_recording(cls))(
                        model=model, args=config(kind, name, arm), train_dataset=data[kind],
                        processing_class=tok, peft_config=lora(), **kw)
                    made = (time.process_time() - c, time.perf_counter() - w)
                    times[arm].append(timed(t.train))
                    inits[arm].append(made)
                    print(f"  {kind} {arm} repeat {r}: {times[arm][-1][0]:.1f} s CPU, {times[arm][-1][1]:.1f} s wall "
                          f"(construction {made[0]:.1f} s CPU, {made[1]:.1f} s wall)", flush=True)
                    if arm == "plain":
                        shutil.rmtree(out / name, ignore_errors=True)
            if a.no_deletion:
                results[kind] = (times, None, None, None, 0.0, {}, inits)
                continue
            run = open_run(out / f"{kind}-trace-0" / "trace")
            ids = run.ids_at_steps([steps[kind] - 1])[:1]
            proven = prove_if_needed(run)
            deletions = late_deletions(forget, run.path, ids, out / f"{kind}-late", a.deletion_repeats)
            c, w = time.process_time(), time.perf_counter()
            receipt = forget(run.path, ids, out / f"{kind}-deletion", oracle=True, progress=False, log=lambda m: None)
            results[kind] = (times, time.process_time() - c, time.perf_counter() - w, receipt, proven, deletions,
                             inits)
        print(f"\nSmolLM2-135M, LoRA r=8 (q_proj, v_proj), fp32, SDPA, {a.threads} thread(s), checkpoints every "
              f"{a.every} steps in both arms; trace_self_check {a.self_check}; median of {1 if a.deletion_only else a.repeats} repeat(s), arms alternating")
        for kind in kinds:
            times, cpu, wall, receipt, proven, deletions, inits = results[kind]
            tc, tw = (statistics.median(x[i] for x in times["trace"]) for i in (0, 1))
            if times["plain"]:
                pc, pw = (statistics.median(x[i] for x in times["plain"]) for i in (0, 1))
                print(f"  {kind.upper()} {steps[kind]:2d} steps: plain {pc:6.1f} s CPU ({pw:6.1f} wall)  recorded "
                      f"{tc:6.1f} s CPU ({tw:6.1f} wall)  ratio {tc / pc:.3f}x CPU, {tw / pw:.3f}x wall  (train())")
                whole = {arm: statistics.median(i[0] + t[0] for i, t in zip(inits[arm], times[arm])) for arm in times}
                print(f"  {kind.upper()} {steps[kind]:2d} steps with the trainer's construction (the recorder's "
                      f"preflight probe included): plain {whole['plain']:6.1f} s CPU  recorded {whole['trace']:6.1f} s "
                      f"CPU  ratio {whole['trace'] / whole['plain']:.3f}x CPU")
            else:
                print(f"  {kind.upper()} {steps[kind]:2d} steps: recorded {tc:6.1f} s CPU ({tw:6.1f} wall)")
            if proven:
                print(f"      proven after recording (trace prove, not counted): {proven:.1f} s CPU")
            for arm, got in deletions.items():
                cpus = [x[0] for x in got]
                print(f"      late deletion without the oracle, {arm}: {statistics.median(cpus):.1f} s CPU "
                      f"(repeats {', '.join(f'{x:.1f}' for x in cpus)}) = {statistics.median(cpus) / tc:.2f}x the "
                      f"recording's CPU; wall {statistics.median(x[1] for x in got):.1f} s; probe steps run "
                      f"{got[0][2]}, left to the replay {got[0][3]}")
            if receipt is None:
                continue
            c = receipt.evidence["cost"]
            tm = receipt.timings
            print(f"      late deletion (1 id at step {steps[kind] - 1}): {receipt.verdict}; replayed "
                  f"{c['steps_to_replay']} of {c['total_steps']} steps from checkpoint {c['start_checkpoint']}: replay "
                  f"{tm['replay_s']:.1f} s wall = {tm['replay_s'] / tw:.2f}x the recording's wall; oracle "
                  f"{tm['oracle_s']:.1f} s wall; forget total {wall:.1f} s wall, {cpu:.1f} s CPU")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def prove_if_needed(run) -> float:
    """Prove ``run`` (``trace prove``) when its recording did not prove itself; returns the CPU seconds (0: proven)."""
    from hf_unlearn.trace.proof import prove, unproven_steps

    if not unproven_steps(run.header, 0, run.total_steps):
        return 0.0
    c = time.process_time()
    prove(run.path, progress=False)
    return time.process_time() - c


def late_deletions(forget, run_path, ids, out: Path, repeats: int) -> dict:
    """``forget`` without the oracle, ``repeats`` times per arm, arms alternating: ``probe-once`` (the library) and
    ``probe-twice`` (every probe step run by the probe itself, as before the replay took over the ones it re-runs).
    Returns ``{arm: [(cpu_s, wall_s, probe steps run, steps left to the replay)]}``."""
    from hf_unlearn.trace import proof

    library = proof.before_deletion

    def probe_twice(*args, first_affected=None, **kwargs):
        return library(*args, **kwargs)

    got: dict[str, list] = {"probe-once": [], "probe-twice": []}
    for r in range(repeats):
        for arm in (["probe-once", "probe-twice"] if r % 2 == 0 else ["probe-twice", "probe-once"]):
            proof.before_deletion = library if arm == "probe-once" else probe_twice
            try:
                c, w = time.process_time(), time.perf_counter()
                receipt = forget(run_path, ids, out / f"{arm}-{r}", progress=False, log=lambda m: None)
                cpu, wall = time.process_time() - c, time.perf_counter() - w
            finally:
                proof.before_deletion = library
            probe = receipt.evidence["environment_probe"]
            got[arm].append((cpu, wall, probe["steps"], probe.get("by_the_replay", [])))
            print(f"  late deletion {arm} repeat {r}: {cpu:.1f} s CPU, {wall:.1f} s wall", flush=True)
            shutil.rmtree(out / f"{arm}-{r}", ignore_errors=True)
    return {k: v for k, v in got.items() if v}


if __name__ == "__main__":
    main()
