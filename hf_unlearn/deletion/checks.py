"""Everything :func:`~hf_unlearn.deletion.forget` refuses before any compute: the request (ids, their types, the
run or the data they name), the options of the path it takes, the run's program and trainer, the proof gate, the Hub
when publishing. What it returns is the plan the runs carry out (:mod:`~hf_unlearn.deletion.exact`,
:mod:`~hf_unlearn.deletion.approximate`, :mod:`~hf_unlearn.deletion.pipeline`).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..presets import check_preset
from ..validation import (
    check_model_source,
    check_new_output,
    check_options,
    check_repo_id,
    is_trace_run,
    load_request_ids,
    recorded_run_inside,
)
from .config import ALIASES, COMMON_METHOD_ARGS, DEFAULT_APPROXIMATE, EXACT, RECEIPT_FILE, ForgetConfig
from .erasure import check_not_retired
from .forget_receipt import _check_earlier_receipt
from .outputs import check_output
from .pipeline import open_pipeline, pipeline_cost, validate_pipeline
from .publishing import _check_earlier_deletions, _check_hub_access, _check_output_name
from .runs import _has_run_parent, _launched, _run_collator

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def _check_out_outside(source: str, out) -> None:
    """The output must not sit inside the source (a run, or the earlier deletion output whose replay it is, or a
    model folder): the summary's "to erase" names that folder (`rm -r`), which would erase the new output with it."""
    from .remains import _forget_output_of, _inside, _ledger_of

    held = _forget_output_of(Path(source)) or Path(source)
    if held.is_dir() and _inside(Path(out), held) and _ledger_of(Path(out)) is None:  # a service batch: `purge`
        raise UnlearnError(f"the output folder {out} is inside {held}, which still holds the deleted rows and is what "
                           "you erase once the deletion is kept (the summary's `rm -r`): choose a folder outside it")


def _validate(model_or_run, ids, config: ForgetConfig, data_collator=None) -> dict:
    request = load_request_ids(ids)
    launched = _launched()
    if launched > 1 and not is_trace_run(os.fspath(model_or_run)):
        raise UnlearnError(f"forget runs an approximate method in one process (this launch has {launched}): run "
                           "`hf-unlearn forget` without accelerate launch or torchrun")
    if launched > 1 and config.repo:
        raise UnlearnError("forget publishes from one process: under a launch of several processes leave --repo out "
                           "and push afterwards (`hf-unlearn hub push OUT/model --deletion --trace OUT/replay`)")
    check_new_output(config.output_dir, overwrite_marker=RECEIPT_FILE, overwrite=config.overwrite,
                     marker_check=_check_earlier_receipt)
    check_repo_id(config.repo)
    sources = [os.fspath(s) for s in model_or_run] if isinstance(model_or_run, (list, tuple)) else None
    if sources is not None and len(sources) == 1:
        model_or_run, sources = sources[0], None
    for src in sources or [os.fspath(model_or_run)]:
        _check_out_outside(src, config.output_dir)
    if sources is not None or _has_run_parent(os.fspath(model_or_run)):
        return _validate_pipeline(sources or [os.fspath(model_or_run)], request, config, data_collator)
    source = os.fspath(model_or_run)
    run = is_trace_run(source)
    if not run:
        _refuse_a_run_in_disguise(source, config, data_collator)
    method = config.method or (EXACT if run else DEFAULT_APPROXIMATE)
    plan: dict[str, Any] = {"ids": request, "source": source, "method": method}
    if config.tokenizer_path is not None:
        if method != EXACT:
            raise UnlearnError("--tokenizer is for exact deletion (a recorded run holds no tokenizer); an approximate "
                               "method saves the model's own")
        check_model_source(config.tokenizer_path, "tokenizer")
    if (config.collator is not None or data_collator is not None) and method != EXACT:
        raise UnlearnError("--collator (data_collator=) is for exact deletion of a recorded run; an approximate "
                           "method collates its own forget and retain rows")
    if config.collator is not None and data_collator is not None:
        raise UnlearnError("pass the run's collator once: --collator (config.collator) or data_collator=, not both")
    if method == EXACT:
        if not run:
            what = "does not exist" if not os.path.exists(source) else "is not a recorded run"
            raise UnlearnError(f"exact deletion needs a recorded run (the trace_dir of a TraceRecordingTrainer); "
                               f"{source!r} {what}; pass --method masc (or another method) for a model")
        plan.update(mode=EXACT, **_validate_run(source, request, oracle=config.oracle))
        plan["data_collator"] = _run_collator(plan["run"], config.collator, data_collator)
    else:
        if run:
            raise UnlearnError(f"{source!r} is a recorded run: it gets an exact deletion (--method exact, the default "
                               f"for runs); for {method!r}, pass the model folder instead")
        from ..methods.registry import get_method

        spec = get_method(method)
        check_options(learning_rate=config.learning_rate, num_train_epochs=config.num_train_epochs,
                      max_steps=config.max_steps, batch_size=config.batch_size, max_length=config.max_length,
                      lora_r=config.lora_r, max_new_tokens=config.max_new_tokens, eval_rows=config.eval_rows,
                      max_retain_rows=config.max_retain_rows)
        check_preset(config.preset)
        method_args = _method_args(spec, config.method_args)
        check_model_source(source)
        forget_rows, retain_rows = _split_data(config, request)
        plan.update(mode="approximate", spec=spec, method_args=method_args, forget_rows=forget_rows,
                    retain_rows=retain_rows)
    if config.repo:
        _check_output_name(config, request)
        _check_hub_access(config)
        _check_earlier_deletions(config, plan)
    return plan


def _validate_pipeline(sources: list[str], request: list, config: ForgetConfig, data_collator) -> dict:
    if config.method not in (None, EXACT):
        raise UnlearnError(f"several recorded runs (a pipeline) get an exact deletion; --method {config.method} takes "
                           "one model")
    for s in sources:
        if not is_trace_run(s):
            raise UnlearnError(f"{s!r} is not a recorded run: a pipeline deletion takes the stages' recorded runs "
                               "(trace folders), in training order")
    plan = {"ids": request, "source": sources[-1], "method": EXACT, "pipeline": True,
            **validate_pipeline(sources, request, oracle=config.oracle, collator=config.collator,
                                data_collator=data_collator)}
    if config.repo:
        _check_output_name(config, request)
        _check_hub_access(config)
        _check_earlier_deletions(config, plan)
    return plan


def check_request(source, ids) -> None:
    """The ids of a request checked against a recorded run, or against every stage of the pipeline a run ends (ids in
    no stage refused, naming them); nothing is computed."""
    if _has_run_parent(os.fspath(source)):
        pipeline_cost(open_pipeline([os.fspath(source)]), ids)
    else:
        _validate_run(os.fspath(source), ids)


def _refuse_unverified_parent(run) -> None:
    """A run that is an earlier deletion's replay whose own check against its oracle failed (its sealed
    ``verification.json`` says not verified): the rows it deleted were not shown deleted as the counterfactual, so a
    deletion from it cannot be either, however its own replay and oracle agree (both start from its dummies)."""
    from ..trace.verification import VERIFICATION_FILE, sealed_verdict

    verdict, _ = sealed_verdict(run.path)
    if verdict is not None and not verdict.get("verified"):
        raise UnlearnError(f"{run.path} is the output of an exact deletion that was NOT verified ({VERIFICATION_FILE}: "
                           f"{verdict.get('verdict') or 'replay and oracle differ'}); a deletion from it cannot be "
                           "verified: delete every id of both requests from the run it was replayed from")


def _validate_run(source: str, request: list, oracle: bool = False) -> dict:
    from ..data.ids import check_id_types
    from ..trace.run import open_run
    from ..trace.store import load_store

    check_not_retired(source)
    run = open_run(source)
    _refuse_unverified_parent(run)
    world = run.header.get("world_size", 1)
    if world != _launched():
        raise UnlearnError(f"{source} was recorded by {world} processes and replays only at that world size; this "
                           f"launch has {_launched()}: run forget under the run's own launch, `torchrun "
                           f"--nproc_per_node {world} -m hf_unlearn.cli forget ...` (or accelerate launch "
                           f"--multi_gpu --num_processes {world}; DDP and FSDP2 runs alike, docs/scale.md)")
    from ..trace.request import forget_tags

    forget_tags(run, request)  # ids the run never trained on: refused from its plan, before the store or a model loads
    from ..trace.packing import document_ids

    stored = document_ids(load_store(run.store_path), run.id_column)  # a packed run: its documents' ids
    check_id_types(request, stored[:1000], f"the run {source}")
    from ..trace.replay import replay_cost

    cost = replay_cost(run, request)
    from ..trace.guards import ProgramChangedError, program_refusal

    for start, who in ((cost["start_checkpoint"], "the replay"), *(((0, "the oracle"),) if oracle else ())):
        why = program_refusal(run.kept(), start) if cost["first_affected_step"] is not None else None
        if why:  # before any compute: a replay from there would not be the counterfactual of the run that trained
            raise ProgramChangedError(f"{source}: {who} cannot delete these ids: {why}")
    from ..trace.program_code import unsealed_code_refusal

    why = unsealed_code_refusal(run, cost["first_affected_step"])  # rows trained by code no seal covers
    if why:
        raise UnlearnError(why)
    from ..trace.unlisted import unlisted_hazard

    why = unlisted_hazard(run)  # a hazard the recorder of an earlier release did not name (MoE, metric schedules)
    if why:
        raise UnlearnError(why)
    from ..trace.trainers import recorded_trainer

    recorded_trainer(run.header)  # the replay rebuilds the run's trainer (e.g. trl.SFTTrainer): importable here?
    from ..trace.run_model import check_attention

    check_attention(run)  # an attention function the training script registered by name: registered here too?
    check_output(run)  # a LoRA run is published merged: mergeable here?
    from ..trace.checkpoints import check_frozen_source
    from ..trace.reference import check_reference_files

    check_frozen_source(run.path)  # the files a replay loads from outside the run: there, unchanged?
    check_reference_files(run)
    return {"run": run, "cost": cost, "hazards": list(run.header.get("hazards", [])),
            "controls": {"status": run.report.summary.get("controls"), "notes": list(run.report.notes)}}


def _refuse_a_run_in_disguise(source: str, config: ForgetConfig, data_collator) -> None:
    """Before anything loads, a source that is not a recorded run given as if it were one: a training output folder
    holding one (``runs/ft`` for ``runs/ft/trace``) with no approximate method named, or a model given options only an
    exact deletion uses (``--oracle`` on a checkpoint ran an approximate method and exited 0)."""
    inner = recorded_run_inside(source)
    if inner and config.method in (None, EXACT):
        raise UnlearnError(f"{source!r} is a training output folder holding the recorded run {inner!r}: pass "
                           f"`{inner}` for exact deletion (`hf-unlearn forget {inner} --ids FILE --out OUT`), or "
                           f"--method NAME for an approximate method on the model saved in {source!r}")
    exact_only = _exact_only_options(config, data_collator)
    if exact_only and config.method != EXACT:  # (--method exact on a model: refused below, naming what it needs)
        options = " and ".join(exact_only)
        raise UnlearnError(f"{options} {'is' if len(exact_only) == 1 else 'are'} for exact deletion of a recorded run "
                           f"(the trace_dir of a TraceRecordingTrainer); {source!r} is not one: a model without a "
                           f"recording gets an approximate method ({config.method or DEFAULT_APPROXIMATE}), with no "
                           f"replay or oracle to check; leave {options} out, or pass the run's trace folder")


def _exact_only_options(config: ForgetConfig, data_collator) -> list[str]:
    """The options given that only an exact deletion uses (their help says "exact:"), as the command spells them."""
    given = [f.name for f in fields(ForgetConfig) if str(f.metadata.get("help", "")).startswith("exact:")
             and getattr(config, f.name) != f.default]
    flags = [ALIASES.get(name, ("--" + name.replace("_", "-"),))[0] for name in given]
    return flags + (["data_collator="] if data_collator is not None else [])


def _method_args(spec, given: dict) -> dict:
    """The method's options from KEY=VALUE pairs, converted to their declared types; unknown keys are an error."""
    types = {**COMMON_METHOD_ARGS, **{o.field: o.type for o in spec.options}}
    out = {}
    for key, value in (given or {}).items():
        key = key.replace("-", "_")
        if key not in types:
            raise UnlearnError(f"{spec.name} has no option {key!r}; its options are {', '.join(sorted(types))}")
        try:
            out[key] = types[key](value) if isinstance(value, str) else value
        except ValueError:
            raise UnlearnError(f"option {key}={value!r} is not a valid {types[key].__name__}") from None
    return out


def load_rows(data: str | None, tofu_path: str | None = None):
    """The dataset the ids refer to (see ``ForgetConfig.data``)."""
    from ..data.embedded import load_embedded_tofu

    if hasattr(data, "column_names") and hasattr(data, "select"):  # a datasets.Dataset (Python API)
        return data
    if data in (None, "tofu"):
        from ..data import load_tofu

        return load_tofu("full", tofu_path)
    if data == "tofu-subset":
        return load_embedded_tofu()
    path = Path(data).expanduser()
    if not path.exists():
        raise UnlearnError(f"data {data!r} does not exist; pass 'tofu', 'tofu-subset', a .jsonl/.json/.parquet/.csv "
                           "file or a save_to_disk folder")
    import datasets

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise UnlearnError(f"{data} holds several splits ({', '.join(loaded)}); save the one the ids refer to")
        return loaded
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return datasets.Dataset.from_list(rows)
    if path.suffix == ".json":
        return datasets.Dataset.from_list(json.loads(path.read_text(encoding="utf-8")))
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    if path.suffix == ".csv":
        return datasets.Dataset.from_csv(str(path))
    raise UnlearnError(f"data file {data!r} must be .jsonl, .json, .parquet or .csv")


def _split_data(config: ForgetConfig, request: list):
    """(forget rows, retain rows): the rows with the request's ids, and a seeded sample of the others."""
    from ..data.ids import check_id_types

    rows = load_rows(config.data, config.tofu_path)
    column = config.id_column
    if column not in rows.column_names:
        raise UnlearnError(f"the data has no id column {column!r} (columns: {', '.join(rows.column_names)}); pass "
                           "--id-column")
    text = {"question", "answer"} <= set(rows.column_names)
    if not text and not {"input_ids", "labels"} <= set(rows.column_names):
        raise UnlearnError("the data needs question/answer columns (or tokenised input_ids/labels)")
    all_ids = rows[column]
    check_id_types(request, all_ids[:1000], "the data")
    position = {i: n for n, i in enumerate(all_ids)}
    unknown = [i for i in request if i not in position]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) of the request are not in the data: {unknown[:10]}"
                           f"{' ...' if len(unknown) > 10 else ''}")
    wanted = set(request)
    forget_rows = rows.select([position[i] for i in request])
    others = [n for n, i in enumerate(all_ids) if i not in wanted]
    if not others:
        raise UnlearnError("every row of the data is in the request: nothing is left to retain")
    import random

    if config.max_retain_rows and len(others) > config.max_retain_rows:
        others = sorted(random.Random(config.seed).sample(others, config.max_retain_rows))
    return forget_rows, rows.select(others)


def _before_compute(plan: dict, config: ForgetConfig) -> None:
    """The proof gate and the environment probe (hf_unlearn.trace.proof), in every process of the deletion, before
    any compute of it: unproven steps refused unless accepted, the first recorded step re-run here."""
    if plan.get("mode") == EXACT and plan.get("pipeline"):
        return _pipeline_proven(plan, config)
    if plan.get("mode") != EXACT or "run" not in plan:
        return
    from ..trace.proof import before_deletion

    plan.update(before_deletion(plan["run"], plan["cost"]["start_checkpoint"], config.oracle, config.accept_unproven,
                                plan["data_collator"], first_affected=plan["cost"]["first_affected_step"]))


def _pipeline_proven(plan: dict, config: ForgetConfig) -> None:
    """A pipeline deletion is VERIFIED stage by stage, so every stage it replays must be proven on the steps its
    replay (and oracle) run: refused before any compute, naming the stage, otherwise. (An unproven pipeline deletion
    is not offered: its receipt has one verdict per stage, and none may read VERIFIED on unproven steps.)"""
    from ..trace.issued import issue
    from ..trace.proof import (
        ProofError,
        environment_refusal,
        guard_gap,
        probe_environment,
        start_proof,
        unproven_statement,
    )

    if config.accept_unproven:
        raise UnlearnError("--accept-unproven is for one recorded run; a pipeline deletion needs every stage it "
                           "replays proven (hf-unlearn trace prove STAGE_RUN for each)")
    who = "the oracle and the replay" if config.oracle else "the replay"
    first_replayed = True
    for s, run in zip(plan["pipeline_cost"]["stages"], plan["runs"]):
        if not s["replayed"]:
            continue
        gap = environment_refusal(run)
        if gap:
            raise ProofError(f"stage {s['stage']}: {gap}")
        gap = guard_gap(run, config.oracle)  # first: proving the stage would not help
        if gap:
            raise ProofError(f"stage {s['stage']}: {gap}; refusing before any compute")
        lo = 0 if config.oracle else s["start_checkpoint"]
        # a fresh start at the stage's checkpoint is proven where it is used (unless a proof found that it fails): by
        # the stage's replay (its first step, before the first affected one) or, that step affected, by a probe here
        why = unproven_statement(run.header, run.path, lo, run.kept().total_steps, who, fresh_start=False)
        if why is None and config.oracle and s["start_checkpoint"]:
            why = unproven_statement(run.header, run.path, s["start_checkpoint"], run.kept().total_steps, who,
                                     fresh_start=False)
        if why:
            raise ProofError(f"stage {s['stage']}: {run.path}: {why}; refusing before any compute")
        # the deleting environment probed on each stage it replays, as a single run's deletion is (what a stage
        # computes differs: its model, an adapter, a reference model); only the first replayed stage starts at its own
        # checkpoint (the later ones from the new parent, every step affected), and its steps before the first
        # affected one are compared by its replay as they run
        start, affected = s["start_checkpoint"], (s.get("cost") or {}).get("first_affected_step")
        how = start_proof(run, start, affected) if first_replayed else None
        try:
            probe = probe_environment(run, s.get("collator"), fresh_start=start if how and how["proven_by"] == "probe"
                                      else None, replayed=range(start, affected) if how and affected is not None
                                      else range(0))
        except ProofError as e:
            raise ProofError(f"stage {s['stage']}: {e}") from None
        if how and how["proven_by"] == "probe" and not probe.get("skipped"):  # its fresh start, probed above
            s["proven_start"] = issue("start", run.kept(), how)
        s["environment_probe"] = probe
        first_replayed = False
