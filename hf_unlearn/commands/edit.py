"""`hf-unlearn edit ...`: closed-form weight edits.

``edit qr-erase BASE --forget-model FT_F|--forget-adapter DIR|--task-matrices TM [--retain-...] --out EDITED`` edits
BASE (the model holding the knowledge) and saves a plain model with its tokenizer, the edit report (JSON, markdown,
layer-energy plot) and a model card with ``unlearning_info.json`` (so ``hf-unlearn hub push EDITED`` publishes it).
``edit task-matrices BASE --forget-split forget10 --out TM [--lora]`` fine-tunes the task models when the user has
only data.
"""

from __future__ import annotations

from ..utils import weights_follow_umask
from . import add_subcommands, add_tofu_splits


def _int_list(text: str) -> list[int]:
    import argparse

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block indices like 3,4,5, got {text!r}") from None


def register(parser) -> None:
    sub = add_subcommands(parser)
    p = sub.add_parser("qr-erase", help="QR-Erase: subtract the forget task's dominant subspace (minus the retain "
                       "subspace) from the weights", description=__doc__)
    p.add_argument("base", help="the model to edit: Hub id, local folder or .gguf file")
    forget = p.add_mutually_exclusive_group(required=True)
    forget.add_argument("--forget-model", help="BASE fully fine-tuned on the forget data (folder or Hub id)")
    forget.add_argument("--forget-adapter", help="a LoRA adapter of BASE trained on the forget data")
    forget.add_argument("--task-matrices", help="a folder from `hf-unlearn edit task-matrices` (forget + retain)")
    retain = p.add_mutually_exclusive_group()
    retain.add_argument("--retain-model", help="BASE fully fine-tuned on the retain data")
    retain.add_argument("--retain-adapter", help="a LoRA adapter of BASE trained on the retain data")
    p.add_argument("--out", required=True, help="output folder for the edited model (must not exist or be empty)")
    p.add_argument("--method", choices=["qr", "qr-truncated", "svd"], default="qr",
                   help="decomposition: column-pivoted QR (default), truncated QR, or the SVD baseline")
    rule = p.add_mutually_exclusive_group()
    rule.add_argument("--rank", type=int, default=None, help="directions kept per layer (default 16)")
    rule.add_argument("--energy", type=float, default=None, help="or: the spectrum energy fraction to keep, in (0, 1]")
    retain_rule = p.add_mutually_exclusive_group()
    retain_rule.add_argument("--retain-rank", type=int, default=None, help="rank of the retain subspace (default: as forget)")
    retain_rule.add_argument("--retain-energy", type=float, default=None, help="energy rule for the retain subspace")
    p.add_argument("--scale", type=float, default=1.0, help="multiplier of the subtracted update (default 1)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--localize", action="store_true", help="edit only blocks with normalised energy >= 1/|L|")
    where.add_argument("--top-k-layers", type=int, default=None, help="edit only the k blocks of highest energy")
    where.add_argument("--layers", type=_int_list, default=None, help="edit exactly these blocks, e.g. 3,4,5")
    p.add_argument("--modules", default=None, help="comma list of layer names to edit (e.g. q_proj,v_proj); default all")
    p.add_argument("--max-rank", type=int, default=128, help="qr-truncated + --energy: directions sketched at most")
    p.add_argument("--oversample", type=int, default=10, help="qr-truncated: extra sketch columns (default 10)")
    p.add_argument("--power-iters", type=int, default=1, help="qr-truncated: power iterations (default 1)")
    p.add_argument("--seed", type=int, default=0, help="qr-truncated: sketch seed (default 0)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the reference decompositions (principal angles and their timings in the report)")
    p.add_argument("--forget-ids", default=None,
                   help="file of the forget sample ids (for the model card's keyed tags; default: from --task-matrices)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype to load BASE in (decompositions always run in float32)")
    p.add_argument("--device", default="auto",
                   help="device to edit on: auto (cuda when available, else cpu), cpu, cuda, cuda:1, ... (the SVD "
                        "and the projections run there; CPQR always runs on the CPU, LAPACK)")
    p.set_defaults(func=run_qr_erase)

    t = sub.add_parser("task-matrices", help="fine-tune BASE on forget and on retain rows to get task matrices",
                       description="Fine-tune BASE (a plain Trainer, LoRA with --lora) once on the forget rows and "
                       "once on the retain rows of TOFU; writes OUT/forget, OUT/retain and OUT/task_matrices.json.")
    t.add_argument("base", help="Hub id, local folder or .gguf file")
    add_tofu_splits(t)
    t.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    t.add_argument("--lora", action="store_true", help="LoRA adapters instead of full fine-tunes (recommended on CPU)")
    t.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    t.add_argument("--epochs", type=float, default=3.0, help="epochs per fine-tune (default 3)")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-4 LoRA, 2e-5 full)")
    t.add_argument("--batch-size", type=int, default=8, help="rows per step (default 8)")
    t.add_argument("--max-length", type=int, default=128, help="tokens per QA pair (default 128)")
    t.add_argument("--max-forget-rows", type=int, default=None, help="use only the first N forget rows")
    t.add_argument("--max-retain-rows", type=int, default=200, help="use only the first N retain rows (default 200)")
    t.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    t.set_defaults(func=run_task_matrices)


def _staging(out):
    """A fresh sibling folder to build OUT in (renamed into place when everything succeeded)."""
    import shutil
    from pathlib import Path

    from ..errors import UnlearnError

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UnlearnError(f"{out} exists and is not empty; pick a new --out or remove it")
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return out, partial


def _check_sources(args) -> None:
    """Cheap checks of the task sources before the base model loads."""
    from pathlib import Path

    from ..editing.task_matrices import ADAPTER_CONFIG, read_task_folder
    from ..errors import UnlearnError

    for flag in ("forget_adapter", "retain_adapter"):
        path = getattr(args, flag)
        if path and not (Path(path) / ADAPTER_CONFIG).is_file():
            raise UnlearnError(f"--{flag.replace('_', '-')} {path} is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    if args.task_matrices and read_task_folder(args.task_matrices) is None:
        raise UnlearnError(f"--task-matrices {args.task_matrices} is not a folder written by `hf-unlearn edit "
                           "task-matrices` (no task_matrices.json)")


def _edit_device(name: str):
    """``--device`` as a torch.device, refused before anything loads when it does not exist here."""
    import torch

    from ..errors import UnlearnError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UnlearnError(f"--device {name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise UnlearnError(f"--device {name}: no such CUDA device here ({torch.cuda.device_count()} visible); "
                           "use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UnlearnError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def _base_tokenizer(base, load_tokenizer):
    """The base model's tokenizer, to save beside the edited weights; None for a local folder that holds none
    (the edit works on weights only and never needs one)."""
    from pathlib import Path

    from ..validation import TOKENIZER_FILES

    folder = Path(base)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    return load_tokenizer(base)


def run_qr_erase(args) -> int:
    import os
    import shutil

    import torch

    from ..data.ids import read_ids
    from ..editing.qr_erase import QREraseConfig, qr_erase
    from ..hub.mixin import write_model_card
    from ..models import load_model, load_tokenizer

    config = QREraseConfig(
        method=args.method, rank=args.rank, energy=args.energy, retain_rank=args.retain_rank,
        retain_energy=args.retain_energy, scale=args.scale, localize=args.localize, top_k_layers=args.top_k_layers,
        layers=args.layers, target_modules=args.modules.split(",") if args.modules else None, max_rank=args.max_rank,
        oversample=args.oversample, power_iters=args.power_iters, seed=args.seed, compare_subspaces=not args.no_compare,
    )  # options are checked before anything loads
    forget_ids = read_ids(args.forget_ids) if args.forget_ids else None
    device = _edit_device(args.device)
    _check_sources(args)
    out, partial = _staging(args.out)
    try:
        model = load_model(args.base, dtype=getattr(torch, args.dtype)).to(device)
        tokenizer = _base_tokenizer(args.base, load_tokenizer)
        forget = args.task_matrices or args.forget_adapter or args.forget_model
        retain = args.retain_adapter or args.retain_model
        print(f"== {config.method} edit of {args.base}: forget task {forget}"
              + (f", retain task {retain}" if retain else ""), flush=True)
        model, report = qr_erase(model, forget, retain, config, forget_ids=forget_ids)
        model.save_pretrained(partial)
        weights_follow_umask(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        else:
            print(f"note: {args.base} holds no tokenizer files, so the edited model is saved without one (the edit "
                  "never needs one)", flush=True)
        report.save(partial)
        write_model_card(partial, report.unlearning_card_info(),
                         base_model=args.base if "/" in str(args.base) and not os.path.exists(args.base) else None)
        if out.exists():
            out.rmdir()
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"edited {len(report.layers)} layers in {len(report.selected_blocks)} of {report.num_blocks} blocks "
          f"({report.selection}) in {report.seconds_total:.1f} s; mean rank {report.mean_rank():.1f}")
    totals = report.decomposition_seconds()
    if len(totals) > 1 and totals.get(config.method):
        print("decomposition time: " + ", ".join(f"{m} {s:.2f} s" for m, s in totals.items()))
    for m, a in report.max_angles().items():
        print(f"largest principal angle to the {m} subspace: {a:.1f} deg")
    print(f"saved to {out} (edit_report.md, layer_energies.png, README.md)")
    return 0


def run_task_matrices(args) -> int:
    from ..editing.finetune import make_task_matrices
    from ..errors import UnlearnError
    from ..models import load_model, load_tokenizer
    from .unlearn import load_tofu_splits, retain_split_for

    for flag in ("epochs", "batch_size", "max_length", "lora_r"):
        if getattr(args, flag) <= 0:
            raise UnlearnError(f"--{flag.replace('_', '-')} must be positive")
    retain_split = args.retain_split or retain_split_for(args.forget_split)
    forget, retain = load_tofu_splits(args, retain_split)
    tokenizer = load_tokenizer(args.base)
    model = load_model(args.base)
    print(f"== task matrices of {args.base}: {len(forget)} {args.forget_split} rows, {len(retain)} {retain_split} "
          f"rows, {'LoRA r=' + str(args.lora_r) if args.lora else 'full fine-tunes'}", flush=True)
    folder = make_task_matrices(
        model, tokenizer, forget, retain, args.out, base=str(args.base), lora=args.lora,
        info={"forget_split": args.forget_split, "retain_split": retain_split},
        lora_r=args.lora_r, epochs=args.epochs, learning_rate=args.lr, batch_size=args.batch_size,
        max_length=args.max_length, seed=args.seed,
    )
    print(f"saved {folder.path}/forget and {folder.path}/retain; next: hf-unlearn edit qr-erase {args.base} "
          f"--task-matrices {folder.path} --out EDITED --localize")
    return 0
