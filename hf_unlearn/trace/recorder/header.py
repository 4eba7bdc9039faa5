"""The run's header: what ``header.json`` says about the run (model, optimizer, arguments, versions, numeric stack,
determinism, hazards, dataset, collator, trainer, retention, sharding), with the machine's local paths withheld; the
model files beside it; a packed run's document map; the hazards found while training."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import time
import uuid
import warnings
from pathlib import Path

import torch

from ...data.collators import collator_spec, rebuild_collator
from ...errors import UnlearnError
from ...utils import LOCAL_PATH, withhold_local_path
from ...version import __version__
from ..fidelity import device_info
from ..hashing import batch_digest
from ..model_info import dropout_settings, frozen_parameters, peft_and_base
from ..packing import PACKED_IDS, document_map, write_map
from ..run import FORMAT
from ..sharding import engine_spec, unsharded_class
from ..stack import numeric_stack
from ..tags import tag
from ..trainers import DEFAULT_TRAINER, PROCESSING_CLASS_DIR
from .optimizers import jsonable, optimizer_spec

# TrainingArguments fields that hold a place on the user's machine, and fields (here and in a model config) that
# hold a Hub id or a local path: a replay never reads them (training_args_from_header), and the header is published
# with the run's provenance, so the local paths are withheld
# TrainingArguments that legitimately differ between the processes of one launch
PROCESS_LOCAL_ARGS = frozenset({"local_rank", "output_dir", "logging_dir", "run_name"})
PATH_ARGS = ("output_dir", "logging_dir", "resume_from_checkpoint", "deepspeed", "fsdp_config", "accelerator_config")
HUB_ID_OR_PATH = ("chat_template_path", "_name_or_path")


def _without_local_paths(record: dict) -> dict:
    """``record`` with the local paths in :data:`PATH_ARGS` and :data:`HUB_ID_OR_PATH` withheld (see
    :func:`hf_unlearn.utils.withhold_local_path`): the header carries no folder layout of the user's machine."""
    out = dict(record)
    for k in (*PATH_ARGS, *HUB_ID_OR_PATH):
        if isinstance(out.get(k), str) and out[k]:
            out[k] = LOCAL_PATH if k in PATH_ARGS else withhold_local_path(out[k])
    return out


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "datasets", "accelerate", "numpy", "peft"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    out["hf_unlearn"] = __version__
    return out


def build(trainer, served, fingerprint: str, hazards: list[str], notes: list[str]) -> dict:
    """The header of a recording about to start (:meth:`TraceRecordingMixin._trace_header_dict`, which DPO extends)."""
    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft, base = peft_and_base(model)
    config = getattr(base, "config", None)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    spec = collator_spec(trainer.data_collator, save_dir=trainer.trace_dir / "collator")
    if spec["rebuildable"]:  # prove it: rebuild from the saved files and collate real rows the same way
        rows = [{k: v for k, v in served[i].items() if k != trainer.id_column} for i in range(min(4, len(served)))]
        try:
            same = batch_digest(rebuild_collator(spec, trainer.trace_dir / "collator", model=model)(rows)) == \
                batch_digest(trainer.data_collator(rows))
        except Exception as e:  # noqa: BLE001
            same, spec["why"] = False, f"rebuilding it failed: {e}"
        if not same:
            spec.update(rebuildable=False, why=spec.get("why", "rebuilt from the trace it collates differently"))
    if not spec["rebuildable"]:
        notes.append(f"the data collator ({spec['class']}) cannot be rebuilt from the trace ({spec.get('why')}): "
                     "pass it to replays (data_collator= or --collator)")
    optimizer = {"class": type(opt).__name__, "source": trainer._trace_optimizer_source,
                 "defaults": {k: jsonable(v) for k, v in opt.defaults.items()},
                 "param_groups": [{"params": len(g["params"]), **{k: jsonable(v) for k, v in g.items()
                                                                  if k != "params"}} for g in opt.param_groups]}
    if trainer._trace_optimizer_source == "custom":
        ospec = optimizer_spec(opt, model)
        if not ospec["rebuildable"]:
            raise UnlearnError(f"a replay must rebuild the optimizer and cannot: {ospec['why']}")
        optimizer["rebuild"] = {k: v for k, v in ospec.items() if k != "param_names"}
    return {
        "format": FORMAT,
        "run_id": uuid.uuid4().hex,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sealed": False,
        "model": {"class": unsharded_class(type(base)).__name__, "module": unsharded_class(type(base)).__module__,
                  "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),
                  "attn_implementation": getattr(config, "_attn_implementation", None),
                  "num_parameters": sum(p.numel() for p in model.parameters()),
                  "frozen_parameters": frozen_parameters(model),
                  "peft": {"adapter_name": peft["name"], "type": str(peft["config"].peft_type)} if peft else None,
                  "config": _without_local_paths(config.to_dict()) if config is not None
                  else None},
        "optimizer": optimizer,
        "training_args": _without_local_paths({k: jsonable(v) for k, v in args.to_dict().items()}),
        "versions": _versions(),
        "numeric_stack": numeric_stack(args.device),
        "determinism": {"seed": args.seed, "data_seed": args.data_seed, "full_determinism": args.full_determinism,
                        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                        "cudnn_deterministic": torch.backends.cudnn.deterministic,
                        "cudnn_benchmark": torch.backends.cudnn.benchmark,
                        "dataloader_num_workers": args.dataloader_num_workers, "device": str(args.device),
                        "device_info": device_info(args.device),
                        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                        "dropout": dropout_settings(model), "neftune_noise_alpha": args.neftune_noise_alpha,
                        "per_microbatch_reseeding": True},
        "hazards": hazards,
        "notes": notes,
        "dataset": {"fingerprint": getattr(trainer.train_dataset, "_fingerprint", None), "rows": len(served),
                    "columns": served.column_names, "id_column": trainer.id_column,
                    "id_type": "str" if "string" in str(served.features[trainer.id_column].dtype) else "int",
                    "store_sha256": fingerprint},
        "collator": spec,
        "trainer": {**trainer._trace_trainer, "dropped_rows": len(trainer._trace_dropped),
                    "dropped_tags": sorted(tag(trainer._trace_key, i) for i in trainer._trace_dropped),
                    "callback_arguments": callback_arguments(trainer)},
        "dummy_token_id": trainer.dummy_token_id,
        "checkpoint_steps": trainer._trace_every,
        "checkpoint_retention": {"mode": trainer.trace_checkpoint_retention, "every": trainer._trace_every,
                                 "factor": trainer._trace_factor, "planned_steps": trainer._trace_total,
                                 "budget": trainer.trace_checkpoint_budget},
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "sharding": engine_spec(trainer),  # FSDP2: the sharding a replay must run (hf_unlearn.trace.sharding)
    }


def _length(obj) -> int | None:
    try:
        return len(obj) if obj is not None and hasattr(obj, "__len__") else None
    except TypeError:  # an iterable dataset's sampler
        return None


def callback_arguments(trainer) -> dict:
    """What a recorded callback may read off the ``lr_scheduler`` and ``train_dataloader`` arguments besides the rates
    and the loader's length, as training starts, for a replay's stand-ins (:mod:`hf_unlearn.trace.replay.stand_ins`):
    the scheduler's class, its ``base_lrs`` and whether its ``get_lr()`` is a closed form of ``last_epoch`` (a
    ``LambdaLR``: every schedule ``lr_scheduler_type`` builds but the plateau one), so that it equals
    ``get_last_lr()`` outside ``step()``; the loader's dataset and sampler lengths and ``total_batch_size``. A deletion
    keeps every slot of the schedule (a deleted row's slot trains a dummy), so these are the counterfactual's too."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    loader = trainer.callback_handler.train_dataloader
    out = {}
    if scheduler is not None:
        base = getattr(scheduler, "base_lrs", None)
        try:
            base = [float(x) for x in base] if isinstance(base, (list, tuple)) else None
        except (TypeError, ValueError):  # not numbers: a replay names it unrecorded
            base = None
        out["scheduler"] = {
            "class": type(scheduler).__qualname__, "base_lrs": base,
            "get_lr_is_last_lr": getattr(type(scheduler), "get_lr", None) is torch.optim.lr_scheduler.LambdaLR.get_lr}
    if loader is not None:
        try:
            total = getattr(loader, "total_batch_size", None)
        except Exception:  # noqa: BLE001 - a loader whose property needs what it does not have
            total = None
        out["dataloader"] = {"dataset_len": _length(getattr(loader, "dataset", None)),
                             "sampler_len": _length(getattr(loader, "sampler", None)),
                             "batch_sampler_len": _length(getattr(loader, "batch_sampler", None)),
                             "total_batch_size": total if isinstance(total, int) else None}
    return out


def non_finite_hazard(trainer, what: str) -> None:
    """A NaN or infinity while recording: a hazard of the run, named with its step (sealed into the header)."""
    trainer._trace_non_finite = what
    hazard = (f"{what}: the run trained on non-finite numbers from there on (an fp16 overflow, a learning rate "
              "too high?); a deletion replays them, and its verdict says nothing about a usable model")
    if "hazards" in trainer._trace_header:  # the main process's header (sealed when training ends)
        trainer._trace_header["hazards"].append(hazard)
    warnings.warn(f"{trainer.trace_dir}: {hazard}", stacklevel=3)


def describe_packing(trainer, served, header: dict) -> None:
    """A packed run: write the public document map and describe it in the header (under the keyed seal)."""
    if PACKED_IDS not in served.column_names:
        return
    docs = [d for row in served[PACKED_IDS] for d in row]
    dataset = header["dataset"]
    dataset["id_type"] = "str" if isinstance(docs[0], str) else "int"  # the documents' ids, which requests name
    dataset["packing"] = {"strategy": trainer.args.packing_strategy, "max_length": trainer.args.max_length,
                          "documents": len(set(docs)), "fragments": len(docs), "packed_rows": len(served),
                          **write_map(trainer.trace_dir, document_map(served, trainer._trace_key, trainer.id_column))}


def save_model_files(trainer, run: Path) -> None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft, base = peft_and_base(model)
    for folder in ("model", PROCESSING_CLASS_DIR):
        if (run / folder).exists():
            shutil.rmtree(run / folder)
    base.config.save_pretrained(run / "model")
    if peft:
        peft["config"].save_pretrained(str(run / "model" / "adapter"))
    if trainer._trace_trainer["class"] != DEFAULT_TRAINER and trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(str(run / PROCESSING_CLASS_DIR))  # the rebuilt trainer takes it

