"""Recording an FSDP2 run on CPU (2 processes, gloo): overhead against the same run without recording, and the bytes
of one checkpoint against FSDP's own sharded checkpoint (torch.distributed.checkpoint) of the same state.

    PYTHONPATH=. python benchmarks/bench_trace_fsdp.py [--model tiny|PATH] [--steps 8] [--every 4] [--repeats 2]

It launches itself under ``torchrun --nproc_per_node 2``. FSDP2 on CPU needs the test-only stand-in of
``tests/fsdp_cpu.py`` (accelerate takes its FSDP branch only for GPU process groups); every parameter is checked to be
a DTensor shard. Two configurations alternate (order rotated per repeat, the minimum of the repeats reported): a plain
``Trainer`` with ``fsdp_config={"fsdp_version": 2}`` and no checkpoints, and ``TraceRecordingTrainer`` with the same
arguments and ``trace_checkpoint_steps=--every`` (sharded checkpoints: every process writes its shards; the
recorded ``train()`` includes the end-of-recording self-check, a replay of step 0 on both processes). Batch 2 per
process x accumulation 2 of TOFU rows, fp32. After the plain run, its model and optimizer state are saved with
``torch.distributed.checkpoint`` (sharded, one file per process): the bytes are compared with one recorded
checkpoint that holds optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="tiny (a 2-layer Llama) or a model folder (e.g. SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    return p.parse_args(argv)


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())


def worker(a) -> None:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(ROOT))
    from hf_unlearn import QACollator, TraceRecordingTrainer, load_tofu, load_tokenizer, tokenize_qa
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.models import build_tiny_model, load_model
    from hf_unlearn.runtime import init_processes, quiet_benchmark
    from hf_unlearn.trace.checkpoints import checkpoint_bytes, checkpoint_dir
    from tests import fsdp_cpu

    fsdp_cpu.enable()
    quiet_benchmark(1)
    state = init_processes(announce=False)
    out = Path(a.out)
    tiny = a.model == "tiny"
    if tiny:
        from tests.test_trace_common import get_trace_data

        tok, data = get_trace_data()
    else:
        tok = load_tokenizer(a.model)
        data = tokenize_qa(load_tofu("full"), tok, max_length=a.max_length)
    n = a.steps * 2 * 2 * state.num_processes
    data = data.select(range(min(n, len(data))))

    def model():
        return build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=0) if tiny \
            else load_model(a.model)

    def args(name):
        return TrainingArguments(str(out / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=a.steps, learning_rate=1e-4, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, disable_tqdm=True, fsdp=True,
                                 fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})

    collator = QACollator.from_tokenizer(tok)
    times = {"plain": [], "recorded": []}
    sizes = {}
    for r in range(a.repeats):
        for name in (["plain", "recorded"] if r % 2 == 0 else ["recorded", "plain"]):
            if state.is_main_process:
                shutil.rmtree(out / name, ignore_errors=True)
            state.wait_for_everyone()
            if name == "plain":
                trainer = Trainer(model=model(), args=args(name), train_dataset=data, data_collator=_DropIds(collator))
            else:
                trainer = TraceRecordingTrainer(model=model(), args=args(name), train_dataset=data,
                                                data_collator=collator, trace_dir=out / name / "trace",
                                                trace_checkpoint_steps=a.every)
            state.wait_for_everyone()
            t = time.perf_counter()
            trainer.train()
            state.wait_for_everyone()
            times[name].append(time.perf_counter() - t)
            fsdp_cpu.assert_sharded(trainer.model)
            if name == "plain" and r == 0:
                msd, osd = get_state_dict(trainer.model, trainer.optimizer)  # sharded: FSDP's own checkpoint
                dcp_save({"model": msd, "optimizer": osd}, checkpoint_id=str(out / "dcp"))
                state.wait_for_everyone()
                sizes["fsdp_dcp_bytes"] = folder_bytes(out / "dcp")
                sizes["fsdp_dcp_files"] = len([f for f in (out / "dcp").iterdir() if f.is_file()])
            if name == "recorded" and r == 0 and state.is_main_process:
                d = checkpoint_dir(out / name / "trace", a.steps)
                sizes["recorded_checkpoint_bytes"] = checkpoint_bytes(d)
                sizes["recorded_files"] = len([f for f in d.iterdir() if f.is_file()])
                per_rank = {}
                for f in d.glob("*-rank*.safetensors"):  # what each process wrote (its shards)
                    rank = f.name.split("-rank")[1].split("-")[0]
                    per_rank[rank] = per_rank.get(rank, 0) + f.stat().st_size
                sizes["recorded_bytes_per_process"] = per_rank
                sizes["recorded_checkpoint_step"] = a.steps
                sizes["params"] = sum(p.numel() for p in trainer.model.parameters())
            del trainer
    if state.is_main_process:
        best = {k: min(v) for k, v in times.items()}
        result = {"model": a.model, "steps": a.steps, "every": a.every, "processes": state.num_processes,
                  "repeats": a.repeats, "seconds": times, "best_s": best,
                  "overhead": best["recorded"] / best["plain"] - 1, **sizes,
                  "bytes_ratio": sizes["recorded_checkpoint_bytes"] / sizes["fsdp_dcp_bytes"]}
        (out / "result.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    a = parse_args()
    if "RANK" in os.environ:
        worker(a)
        return
    scratch = Path(a.out or tempfile.mkdtemp(prefix="hf_unlearn_bench_fsdp_"))
    scratch.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # one run key for both processes (importing the tests' helpers would give each process its own temporary one)
    env.setdefault("HF_UNLEARN_KEY_FILE", str(scratch / "id_tag.key"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           __file__, "--model", a.model, "--steps", str(a.steps), "--every", str(a.every), "--repeats",
           str(a.repeats), "--max-length", str(a.max_length), "--out", str(scratch)]
    subprocess.run(cmd, check=True, env=env)
    r = json.loads((scratch / "result.json").read_text())
    print(f"FSDP2 on CPU, {r['processes']} processes, model {r['model']} ({r['params']:,} params), {r['steps']} steps, "
          f"checkpoint every {r['every']}; best of {r['repeats']}")
    print(f"train(): plain {r['best_s']['plain']:.2f} s, recorded {r['best_s']['recorded']:.2f} s "
          f"(overhead {100 * r['overhead']:+.0f}%)")
    print(f"one recorded checkpoint (sharded, with optimizer state) {r['recorded_checkpoint_bytes']:,} B in "
          f"{r['recorded_files']} files, written per process {r['recorded_bytes_per_process']}; FSDP's sharded "
          f"torch.distributed.checkpoint {r['fsdp_dcp_bytes']:,} B in {r['fsdp_dcp_files']} files "
          f"(ratio {r['bytes_ratio']:.3f})")
    if a.out is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
