"""One deletion request through a training pipeline (SFT, then a second fine-tune, DPO, a LoRA on the result, ...).

The stages are recorded runs, each starting from the previous one's output (:mod:`hf_unlearn.trace.lineage`
records and checks that). A row deleted from stage k changes stage k's output, hence the start of every later stage,
so :func:`run_pipeline`:

* deletes nothing before the first stage that holds an id of the request (those stages are unchanged);
* replays the first affected stage from its latest usable checkpoint, from a store without the rows (as ``forget``
  does for one run);
* replays every later stage **from step 0, from the new parent's output** (no checkpoint of it is valid any more),
  with its own recorded controls (slots, seeds, learning rates, accumulation, normalisers, the optimizer built as
  recorded) and its own ids of the request deleted; a LoRA stage's frozen base is the new parent's output;
* with ``oracle``: the oracle of the first affected stage is its full replay from step 0 on the original store, and
  the oracle of each later stage starts from the oracle of the stage before; each stage's replay is compared with its
  oracle bit for bit (:func:`hf_unlearn.trace.verification.verify`).

``OUT/stage-K/{store,replay,oracle}`` hold each replayed stage; ``OUT/model`` the last stage's model; the receipt's
``evidence.pipeline`` one entry per stage (run ids, start and output roots, replay == oracle). :func:`verify_pipeline`
checks the chain again from the folders: each stage's replay and oracle start from the previous stage's replay and
oracle output (by run id and weights root, recomputed), and each stage's replay equals its oracle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text, private_dir
from .config import EXACT
from .forget_receipt import _receipt, load_receipt
from .outputs import card_fields
from .preference_terms import preference_terms
from .publishing import _own_settings
from .runs import _run_collator, with_replay_progress

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


# ---- before any compute ----------------------------------------------------------------------------------------
def stage_ids(run, ids) -> list:
    """The ids of ``ids`` that stage ``run`` served (or deleted before, or dropped before training, or holds in its
    token store where its plan never reached them: ``max_steps`` shorter than an epoch)."""
    from ..trace.packing import document_tags, is_packed, load_map
    from ..trace.replay import never_trained_tags
    from ..trace.request import unplanned_store_ids
    from ..trace.run import read_deletion_log
    from ..trace.tags import tag

    if is_packed(run.header):
        known = set(document_tags(load_map(run)))
    else:
        known = {s for e in (run.served_plan or run.plan) for s in e.slots if s}
    known |= {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    known |= never_trained_tags(run)
    key = run.key
    rest = [i for i in ids if tag(key, i) not in known]
    unreached = set(unplanned_store_ids(run, rest)) if rest else set()  # the store is read only for these
    return [i for i in ids if tag(key, i) in known or i in unreached]


def open_pipeline(sources) -> list:
    """The stages' runs, in training order: the runs given (checked to be a pipeline), or, for one run, the pipeline
    found from its recorded parents."""
    from ..trace.lineage import check_pipeline, find_pipeline, open_quietly

    runs = [open_quietly(s) for s in sources]
    if len(runs) == 1:
        runs = find_pipeline(runs[0])
    check_pipeline(runs)
    return runs


def pipeline_cost(runs, ids) -> dict:
    """Per stage: its ids, and what a deletion replays (the first affected stage from a checkpoint, every later one in
    full); ``total_steps_replayed`` against ``pipeline_steps`` (the oracle of the whole pipeline replays all of them).
    An id in no stage is an error (listed)."""
    from ..trace.replay import replay_cost

    per = [stage_ids(r, ids) for r in runs]
    seen = {i for p in per for i in p}
    unknown = [i for i in dict.fromkeys(ids) if i not in seen]
    if unknown:
        _refuse_id_types(runs, unknown)
        raise UnlearnError(f"{len(unknown)} id(s) to forget appear in no stage of the pipeline "
                           f"({', '.join(str(r.path) for r in runs)}): {unknown[:20]}"
                           f"{' ...' if len(unknown) > 20 else ''}; check the forget list")
    stages, first = [], None
    for k, (run, sids) in enumerate(zip(runs, per)):
        total = run.kept().total_steps
        entry = {"stage": k + 1, "run": str(run.path), "run_id": run.header["run_id"], "ids": len(sids),
                 "total_steps": total,
                 "trainer": (run.header.get("trainer") or {}).get("class", "transformers.trainer:Trainer")}
        if first is None:
            cost = replay_cost(run, sids) if sids else None
            if cost is None or cost["first_affected_step"] is None:
                entry.update(replayed=False, steps_to_replay=0, why=_unchanged_why(cost), **({"cost": cost} if cost else {}))
            else:
                first = k
                entry.update(replayed=True, start_checkpoint=cost["start_checkpoint"],
                             steps_to_replay=cost["steps_to_replay"], cost=cost,
                             why=f"first affected stage: suffix replay from checkpoint step {cost['start_checkpoint']}")
        else:
            entry.update(replayed=True, start_checkpoint=0, steps_to_replay=total,
                         why=f"its start changed (stage {first + 1}'s deletion changes every later stage's parent): "
                             f"replayed in full from the new parent"
                             + (f", its own {len(sids)} id(s) deleted" if sids else ""))
            if sids:
                entry["cost"] = replay_cost(run, sids)
        entry["ids_list"] = sids
        stages.append(entry)
    replayed = sum(s["steps_to_replay"] for s in stages)
    total = sum(s["total_steps"] for s in stages)
    return {"stages": stages, "first_affected_stage": None if first is None else first + 1,
            "total_steps_replayed": replayed, "pipeline_steps": total,
            "fraction_replayed": replayed / total if total else 0.0}


def _refuse_id_types(runs, unknown: list) -> None:
    """Ids found in no stage whose type no stage uses (``"14"`` where every stage's ids are ints): the type is the
    error to name, as for one run, not their absence."""
    from ..data.ids import check_id_types

    types = {t for t in ({"int": int, "str": str}.get(r.header["dataset"].get("id_type")) for r in runs) if t}
    if len(types) != 1:
        return
    check_id_types(unknown, types.pop(), what=f"the pipeline ({', '.join(str(r.path) for r in runs)})")


def _unchanged_why(cost: dict | None) -> str:
    """Why a stage before the first affected one is not replayed (``cost``: its :func:`replay_cost`, None without
    ids)."""
    if cost is None:
        return "no id of the request in this stage (unchanged)"
    never, before = cost["never_trained"], cost["already_deleted"]
    parts = ([f"{before} deleted by an earlier request"] if before else []) + \
        ([f"{never} never trained on (dropped by the trainer's dataset preparation, or rows of its store the plan "
          "never reached: max_steps shorter than an epoch)"] if never else [])
    return f"its id(s): {'; '.join(parts)} (unchanged)"


def describe_pipeline_cost(cost: dict) -> list[str]:
    lines = []
    for s in cost["stages"]:
        lines.append(f"stage {s['stage']} ({s['trainer'].rsplit(':', 1)[-1]}, {s['total_steps']} steps, "
                     f"{s['ids']} id(s)): " + (f"replays {s['steps_to_replay']} step(s): {s['why']}" if s["replayed"]
                                               else f"not replayed: {s['why']}"))
    first = cost["first_affected_stage"]
    if first is None:
        lines.append("nothing to replay: no stage holds a row of the request any more")
        return lines
    later = [s for s in cost["stages"] if s["stage"] > first]
    lines.append(f"pipeline: {cost['total_steps_replayed']} of {cost['pipeline_steps']} steps replayed "
                 f"({100 * cost['fraction_replayed']:.1f}%)"
                 + (f"; a deletion in stage {first} replays every later stage in full "
                    f"({sum(s['total_steps'] for s in later)} steps of {len(later)} stage(s))" if later else "")
                 + "; --oracle adds a full replay of every stage from the first affected one "
                 f"({sum(s['total_steps'] for s in cost['stages'] if s['stage'] >= first)} steps)")
    return lines


def validate_pipeline(sources, request, oracle: bool = False, collator=None, data_collator=None) -> dict:
    """Every check that costs no training, before any: the pipeline, the ids, each replayed stage's program and
    trainer, world size and collator."""
    from ..trace.guards import ProgramChangedError, program_refusal
    from ..trace.program_code import unsealed_code_refusal
    from ..trace.trainers import recorded_trainer
    from ..trace.unlisted import unlisted_hazard

    runs = open_pipeline(sources)
    cost = pipeline_cost(runs, request)
    if cost["first_affected_stage"] is None:  # no model changes: say why per stage, before any probe or load
        held = [s for s in cost["stages"] if s["ids"]]
        never = [s for s in held if (s.get("cost") or {}).get("never_trained")]
        raise UnlearnError("nothing to replay, no model of the pipeline changes: " + "; ".join(
            f"stage {s['stage']}: {s['why']}" for s in held)
            + (f"; the rows never trained on stay only in the token store of their stage "
               f"({', '.join(s['run'] + '/private/store' for s in never)}) and of any run it was replayed from: "
               "erase them there" if never else ""))
    for s, run in zip(cost["stages"], runs):
        if not s["replayed"]:
            continue
        where = f"stage {s['stage']} ({run.path})"
        _refuse_stale_reference(where, run, runs, cost)
        if cost["first_affected_stage"] < s["stage"]:
            _refuse_copied_modules(where, run)
        world = run.header.get("world_size", 1)
        if world != 1:
            raise UnlearnError(f"{where} was recorded by {world} processes; forget replays one-process runs only")
        start = s["start_checkpoint"]
        for st, who in ((start, "the replay"), *(((0, "the oracle"),) if oracle else ())):
            why = program_refusal(run.kept(), st)
            if why:
                raise ProgramChangedError(f"{where}: {who} cannot run: {why}")
        # rows trained by code no seal covers (a later stage's every step is affected: its start changes)
        why = unsealed_code_refusal(run, s["cost"]["first_affected_step"] if cost["first_affected_stage"] == s["stage"]
                                    else 0)
        if why:
            raise UnlearnError(f"stage {s['stage']}: {why}")
        why = unlisted_hazard(run) if s.get("ids") else None  # only where this stage's own rows are deleted
        if why:
            raise UnlearnError(f"stage {s['stage']}: {why}")
        recorded_trainer(run.header)
        s["collator"] = _run_collator(run, collator, data_collator)
    hazards = [f"stage {s['stage']}: {h}" for s, r in zip(cost["stages"], runs) for h in r.header.get("hazards", [])]
    return {"mode": EXACT, "runs": runs, "run": runs[-1], "pipeline_cost": cost, "hazards": hazards,
            "controls": {"status": "; ".join(f"stage {k + 1}: {r.report.summary.get('controls')}"
                                             for k, r in enumerate(runs)),
                         "notes": [n for r in runs for n in r.report.notes]}}


def _refuse_stale_reference(where: str, run, runs, cost: dict) -> None:
    """A stage replayed because its start changed whose (DPO) reference model is not its parent: only a reference
    that is the parent is replaced, so replay and oracle both keep the recorded one (bit-identical, VERIFIED). That is
    the counterfactual only when the reference is unchanged by the deletion: the weights a stage up to the first
    affected one started from. Any other reference (an earlier replayed stage's output, or a model derived from one:
    cast, edited) is refused; so is one the library cannot tell apart from those (a model of unknown origin)."""
    from ..trace.lineage import lineage_of, reference_is_parent

    ref = run.header.get("reference_model") or {}
    if ref.get("kind") not in ("initial", "model") or reference_is_parent(run):
        return
    first = cost["first_affected_stage"]
    k = next(j for j, r in enumerate(runs) if r is run) + 1
    if first is None or k <= first:
        return  # every stage before it is unchanged: so is its reference
    unchanged = {lineage_of(r).get("start_root") for r in runs[:first]} - {None}
    if ref.get("params_root") in unchanged:
        return
    made = next((j + 1 for j, r in enumerate(runs[first - 1:k - 1], start=first - 1)
                 if ref.get("params_root") == lineage_of(runs[j + 1]).get("start_root")), None)
    what = (f"stage {made}'s output, which this deletion changes" if made else
            f"none of the weights stages 1..{first} started from (unchanged by this deletion), so it may derive "
            "from a stage this deletion changes")
    raise UnlearnError(f"{where}: its reference model (root {str(ref.get('params_root'))[:16]}...) is not its parent "
                       f"but {what}; only a reference that is the parent is replaced, so its replay would keep the "
                       "old reference and not be the counterfactual pipeline: record the stage with its parent as "
                       "reference (ref_model=None) to delete through it")


def _refuse_copied_modules(where: str, run) -> None:
    """A LoRA stage whose adapter also trains full copies of modules (PEFT ``modules_to_save``): the copies were
    initialised from the old parent's weights and are adapter tensors (kept as recorded when the base is replaced),
    so a replay from a new parent would start them from the old parent: not the counterfactual. Refused."""
    from ..trace.lineage import ADAPTER

    cps = run.checkpoints()
    names = json.loads((cps[min(cps)] / "hashes.json").read_text()).get("params", {}) if cps else {}
    copied = sorted({n.split(".modules_to_save.")[0] for n in names if ".modules_to_save." in n and ADAPTER.search(n)})
    if copied:
        raise UnlearnError(f"{where}: its adapter trains full copies of {', '.join(copied[:4])} (modules_to_save), "
                           "initialised from the old parent's weights; a replay from the new parent would keep them: "
                           "record the stage without modules_to_save to delete through it")
    if any(".lora_magnitude_vector." in n for n in names):  # DoRA: the magnitudes are the old base's weight norms
        raise UnlearnError(f"{where}: its adapter is DoRA (use_dora): its magnitude vectors were initialised from the "
                           "old parent's weight norms and a replay from the new parent would keep them: record the "
                           "stage with a plain LoRA to delete through it")


# ---- the deletion ----------------------------------------------------------------------------------------------
def _start_from(stage, folder: Path) -> dict:
    """The replay arguments of ``stage`` starting from the output of the replayed run in ``folder``: its weights, the
    parent's record and, for a DPO stage whose reference was its parent, the new parent's model as the reference
    (:func:`hf_unlearn.trace.reference.load_reference_model` with ``override``)."""
    from ..trace.lineage import (
        cast_weights,
        lineage_of,
        open_quietly,
        output_model,
        output_weights,
        reference_is_parent,
        weights_root,
    )

    run = open_quietly(folder)
    needs_model = (run.header.get("model") or {}).get("peft") or reference_is_parent(stage)
    model = output_model(run) if needs_model else None  # built (and merged) once: the weights and the reference
    weights = dict(model.state_dict()) if model is not None else output_weights(run)
    parent = {"run_id": run.header["run_id"], "origin_run_id": run.header.get("origin_run_id"),
              "output_root": weights_root(weights), "via": "pipeline", "steps": run.kept().total_steps,
              "trainer": (run.header.get("trainer") or {}).get("class", "transformers.trainer:Trainer")}
    cast = (lineage_of(stage).get("parent") or {}).get("cast")  # the stage loaded its parent in this dtype
    if cast:  # it starts from the parent's output cast as recorded (the replay checks that start root)
        weights = cast_weights(weights, cast)
        parent.update(cast=cast, start_root=weights_root(weights))
    kw = dict(start_weights=weights, start_parent=parent)
    if reference_is_parent(stage):
        from ..trace.reference import reference_as_recorded, reference_root

        ref = reference_as_recorded(stage, model)  # loaded with the recorded reference's dtype and attention
        if reference_root(ref) != parent.get("start_root", parent["output_root"]):
            raise UnlearnError(f"{stage.path}: the new parent's model as the DPO reference has another root than its "
                               "output weights; refusing")
        kw["ref_model"] = ref
    return kw


def run_pipeline(plan: dict, config, out: Path, tokenizer, log):
    """Replay the affected stages in order (see the module docstring); returns the receipt."""
    from ..hub.mixin import write_model_card
    from ..hub.publish import hashed_files
    from ..trace.fidelity import fidelity_statement
    from ..trace.issued import untagged
    from ..trace.lineage import lineage_of, open_quietly, output_root, parent_path
    from ..trace.replay import OracleReplayTrainer, RedactedReplayTrainer, already_deleted
    from ..trace.store import redact_store
    from ..trace.trainers import PROCESSING_CLASS_DIR, load_processing_class
    from ..trace.verification import verify

    runs, cost, timings = plan["runs"], plan["pipeline_cost"], {}
    log(f"exact deletion of {len(plan['ids'])} id(s) from a pipeline of {len(runs)} recorded run(s):")
    for line in describe_pipeline_cost(cost):
        log("  " + line)
    for hazard in plan["hazards"]:
        log(f"HAZARD (recorded with the run): {hazard}")
    prev_replay = prev_oracle = None
    stages, replay, verified = [], None, []
    for s, run in zip(cost["stages"], runs):
        k = s["stage"]
        entry = {"stage": k, "run_id": run.header["run_id"], "origin_run_id": run.header.get("origin_run_id"),
                 "trainer": s["trainer"], "ids": s["ids"], "total_steps": s["total_steps"],
                 "start_root": lineage_of(run).get("start_root"), "parent_run_id": (lineage_of(run).get("parent")
                                                                                      or {}).get("run_id")}
        if not s["replayed"]:
            entry.update(replayed=False, why=s["why"], output_root=output_root(run))
            stages.append(entry)
            continue
        d = out / f"stage-{k}"
        d.mkdir(parents=True)
        ids = s["ids_list"]
        store = run.store_path
        t = time.perf_counter()
        if ids:
            # rows an earlier request deleted (its deletion log) or the trainer dropped before training: not in store
            red = redact_store(run.store_path, ids, d / "store", run.key, id_column=run.id_column,
                               already_deleted=already_deleted(run, ids))
            store = d / "store"
            entry["redaction"] = {"rows_before": red["rows_before"], "rows_after": red["rows_after"],
                                  "store_sha256": red["store_sha256"], "id_check": red["checks"]["id_column_scanned"]}
        kw = {"proven_start": s["proven_start"]} if s.get("proven_start") else {}  # its fresh start, probed
        entry["environment_probe"] = untagged(s.get("environment_probe"))  # recorded steps re-run here with no deletion
        if prev_replay is not None:
            kw = dict(start="full", **_start_from(run, prev_replay))
            entry["new_start_root"] = kw["start_parent"].get("start_root", kw["start_parent"]["output_root"])
            entry["reference_replaced"] = "ref_model" in kw
        log(f"stage {k}: {s['why']}")
        replay = with_replay_progress(RedactedReplayTrainer, f"stage {k} replay", config.progress)(
            run, store, ids, d / "replay", data_collator=s["collator"], **kw)
        replay.train()
        _remember_parent(d / "replay", prev_replay if prev_replay is not None else parent_path(run))
        timings[f"stage_{k}_replay_s"] = time.perf_counter() - t
        stats = replay.replay_stats
        entry.update(replayed=True, why=s["why"], start_step=stats["start_step"],
                     steps_replayed=stats["segments_replayed"],
                     replay={"output": str(d / "replay"), "run_id": _run_id(d / "replay"),
                             "output_root": output_root(open_quietly(d / "replay")),
                             "fidelity": fidelity_statement(json.loads((d / "replay" / "header.json").read_text()))})
        log(f"stage {k}: replayed {stats['segments_replayed']} of {stats['total_steps']} steps from step "
            f"{stats['start_step']} in {timings[f'stage_{k}_replay_s']:.0f} s")
        if config.oracle:
            t = time.perf_counter()
            okw = _start_from(run, prev_oracle) if prev_oracle is not None else {}
            with_replay_progress(OracleReplayTrainer, f"stage {k} oracle", config.progress)(
                run, ids, out_dir=d / "oracle", data_collator=s["collator"], environment_probe=s.get("environment_probe"),
                **okw).train()
            report = verify(d / "replay", d / "oracle")
            timings[f"stage_{k}_oracle_s"] = time.perf_counter() - t
            ok = bool(report["verified"])
            verified.append(ok)
            entry["oracle"] = {"output": str(d / "oracle"), "run_id": _run_id(d / "oracle"),
                               "output_root": output_root(open_quietly(d / "oracle")), "identical": bool(report["identical"]),
                               "verified": ok, "problems": list(report["provenance"]["problems"]),
                               "params_mismatched_elements": report["params"]["mismatched_elements"],
                               "optimizer_mismatched_elements": report["optimizer"]["mismatched_elements"]}
            log(f"stage {k}: replay vs oracle: " + ("VERIFIED bit-identical" if ok else
                                                     "bit-identical, NOT VERIFIED" if report["identical"]
                                                     else "NOT identical"))
            prev_oracle = d / "oracle"
        prev_replay = d / "replay"
        stages.append(entry)
    plan["last_replay"] = prev_replay
    if replay is None:
        raise UnlearnError("nothing to replay: every id of the request was deleted from the pipeline before or never "
                           "trained on (see each stage's line above)")
    if not tokenizer and (runs[-1].path / PROCESSING_CLASS_DIR).is_dir():
        tokenizer = load_processing_class(runs[-1].path / PROCESSING_CLASS_DIR)
    model_dir = out / "model"
    exact = {}
    if (runs[-1].header.get("model") or {}).get("peft"):  # what is published: the adapter merged into its base
        from ..trace.lineage import output_model, weights_root

        merged = output_model(open_quietly(prev_replay))
        merged.save_pretrained(str(model_dir))
        exact["params_root"] = weights_root(merged.state_dict())
    else:
        replay.save_model(str(model_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    saved_files = hashed_files(model_dir)
    card_info = replay.unlearning_card_info()
    if exact and card_info["extra"].get("exact_deletion"):  # the card names the published (merged) weights' root
        card_info["extra"]["exact_deletion"] = card_fields(card_info["extra"]["exact_deletion"],
                                                           {**exact, "merged_adapter": True})
    write_model_card(model_dir, card_info, base_model=config.base_model, datasets=config.datasets,
                     not_ids=_own_settings(card_info))
    exact = {**card_info["extra"].get("exact_deletion", {}), **exact}
    evidence = {"pipeline": stages, "pipeline_cost": {k: v for k, v in cost.items() if k != "stages"},
                "verified": None if not config.oracle else all(verified), "hazards": plan["hazards"],
                "controls": plan["controls"]}
    if preference_terms(runs):  # what a DPO stage's counterfactual keeps, and a reference from outside the pipeline
        evidence["preference"] = preference_terms(runs)
    return _receipt(plan, config, out, model_dir, evidence, timings, optimizer_root=exact.get("optimizer_root", ""),
                    trace_params_root=exact.get("params_root"), saved_files=saved_files)


def _remember_parent(folder: Path, parent) -> None:
    """A replayed stage's parent folder, kept where the recording keeps it (``private/lineage.json``): a later request
    finds the pipeline from the replayed last stage."""
    from ..trace.lineage import PRIVATE_FILE

    if parent is not None:
        atomic_write_text(private_dir(folder) / PRIVATE_FILE.name,
                          json.dumps({"parent_path": str(Path(parent).resolve())}, indent=1), private=True)


def _run_id(folder: Path) -> str:
    return json.loads((Path(folder) / "header.json").read_text())["run_id"]


# ---- checking a pipeline deletion again --------------------------------------------------------------------------
def verify_pipeline(out) -> dict:
    """Check a pipeline deletion's output folder from its files: each replayed stage's replay equals its oracle
    (bit for bit, provenance checked), each stage's replay and oracle start from the previous stage's replay and
    oracle output (run id and weights root, recomputed from the checkpoints), the first replayed stage is a replay
    of the receipt's run, the receipt's roots are the folders', and the model folder is the last replay's state.
    Returns ``{"verified": bool, "problems": [...], "stages": [...]}``."""
    from ..trace.lineage import lineage_of, open_quietly, output_root, start_root_from
    from ..trace.verification import verify

    out = Path(out)
    receipt = load_receipt(out)
    stages = (receipt.get("evidence") or {}).get("pipeline")
    if not stages:
        raise UnlearnError(f"{out}/receipt.json is not a pipeline deletion's receipt (no evidence.pipeline)")
    problems, lines = [], []
    prev = {"replay": None, "oracle": None}
    first = None  # the index of the first replayed stage
    for k, st in enumerate(stages):
        name = f"stage {k + 1}"
        if st.get("stage") != k + 1:
            problems.append(f"{name}: the receipt lists stage {st.get('stage')} here: the chain was reordered")
        if k and st.get("parent_run_id") != stages[k - 1].get("run_id"):
            problems.append(f"{name}: the receipt says it starts from run {st.get('parent_run_id')}, not stage {k}'s "
                            f"run {stages[k - 1].get('run_id')}")
        if not st.get("replayed"):
            if any(prev.values()):
                problems.append(f"{name}: not replayed although an earlier stage was: its start changed")
            lines.append(f"{name}: unchanged ({st.get('why')})")
            continue
        d = out / f"stage-{k + 1}"
        folders = {"replay": d / "replay", "oracle": d / "oracle"}
        if not (folders["oracle"] / "header.json").is_file():
            problems.append(f"{name}: no oracle output ({folders['oracle']}): the deletion was not checked against "
                            "the oracle")
            break
        first = k if first is None else first
        report = verify(folders["replay"], folders["oracle"])
        if not report["verified"]:
            problems.append(f"{name}: replay vs oracle " + ("bit-identical but not proven: " + "; ".join(
                report["provenance"]["problems"][:2] or [u["why"] for u in report["provenance"]["unproven"].values()])
                if report["identical"] else "NOT identical"))
        runs = {role: open_quietly(f) for role, f in folders.items()}
        for role, run in runs.items():
            if run.header.get("origin_run_id") != st.get("origin_run_id"):
                problems.append(f"{name}: the {role} is of recorded run {run.header.get('origin_run_id')}, not the "
                                f"receipt's stage run {st.get('origin_run_id')}")
            root = output_root(run)
            if root != (st.get(role) or {}).get("output_root"):
                problems.append(f"{name}: the {role}'s output root {root[:16]}... is not the receipt's "
                                f"{str((st.get(role) or {}).get('output_root'))[:16]}...")
            lin = lineage_of(run)
            before = prev[role]
            if before is None:
                if (run.header.get("parent") or {}).get("mode") not in ("replay", "oracle"):
                    problems.append(f"{name}: the {role} folder is not a replay output")
                if lin.get("start_root") != st.get("start_root"):
                    problems.append(f"{name}: the {role} starts from root {str(lin.get('start_root'))[:16]}..., not "
                                    f"the recorded stage's start {str(st.get('start_root'))[:16]}...")
                cast = (lin.get("parent") or {}).get("cast")  # loaded in another dtype: its parent's root is recorded
                started = (lin.get("parent") or {}).get("output_root") if cast else lin.get("start_root")
                if k and started != stages[k - 1].get("output_root"):
                    problems.append(f"{name}: the {role} does not start from stage {k}'s recorded output")
                if k and (lin.get("parent") or {}).get("run_id") != stages[k - 1].get("run_id"):
                    problems.append(f"{name}: the {role} starts from run {(lin.get('parent') or {}).get('run_id')}, "
                                    f"not from stage {k}'s recorded run {stages[k - 1].get('run_id')}: stage {k} was "
                                    "replayed (its evidence is missing from the receipt) or it is another pipeline")
            else:
                parent = lin.get("parent") or {}
                if parent.get("run_id") != before.header["run_id"]:
                    problems.append(f"{name}: the {role} starts from run {parent.get('run_id')}, not from stage {k}'s "
                                    f"{role} output (run {before.header['run_id']}): a swapped parent")
                if lin.get("start_root") != start_root_from(before, parent.get("cast")):
                    problems.append(f"{name}: the {role} starts from root {str(lin.get('start_root'))[:16]}..., not "
                                    f"stage {k}'s {role} output")
                try:
                    _refuse_copied_modules(f"{name}: the {role}", run)
                except UnlearnError as e:
                    problems.append(str(e).split(";")[0] + ": kept from the old parent")
                ref = run.header.get("reference_model") or {}
                unchanged = {e.get("start_root") for e in stages[:first + 1]}  # roots this deletion left alone
                if ref.get("kind") in ("initial", "model") and ref.get("params_root") != lin.get("start_root") \
                        and ref.get("params_root") not in unchanged:
                    problems.append(f"{name}: the {role}'s reference model (root {str(ref.get('params_root'))[:16]}"
                                    "...) is neither its new parent nor a model this deletion left unchanged: a "
                                    "stale reference")
        prev = runs
        lines.append(f"{name}: replay == oracle {'VERIFIED' if report['verified'] else 'NOT verified'}"
                     + (f", starts from stage {k}'s replayed output" if k and stages[k - 1].get("replayed") else ""))
    problems += _request_problems(out, receipt, stages)
    problems += _output_problems(out, receipt, prev.get("replay"), "the last stage's")
    return {"verified": not problems, "problems": problems, "stages": lines}


def verify_single(out) -> dict:
    """Check a single run's deletion output folder (``forget RUN --oracle``'s ``OUT``) from its files, as
    :func:`verify_pipeline` checks a pipeline's: the replay equals the oracle (bit for bit, provenance checked), the
    receipt's request is what the replay deleted, its final state root is the replay's, and ``OUT/model`` holds the
    receipt's model (a model edited after the deletion is not VERIFIED). Returns ``{"verified", "problems",
    "stages", "report"}`` (``report``: :func:`~hf_unlearn.trace.verification.verify`'s, None without an oracle)."""
    from ..trace.lineage import open_quietly
    from ..trace.verification import verify

    out = Path(out)
    receipt = load_receipt(out)
    replay, oracle = out / "replay", out / "oracle"
    problems, lines, report = [], [], None
    if not (replay / "header.json").is_file():
        raise UnlearnError(f"{out} holds no replay output ({replay}): it is not the output folder of `hf-unlearn "
                           "forget RUN`")
    if not (oracle / "header.json").is_file():
        problems.append(f"no oracle output ({oracle}): the deletion was not checked against the oracle (run "
                        "`hf-unlearn forget RUN --oracle`)")
    else:
        report = verify(replay, oracle)
        if not report["verified"]:
            problems.append("replay vs oracle " + ("bit-identical but not proven: " + "; ".join(
                report["provenance"]["problems"][:2] or [u["why"] for u in report["provenance"]["unproven"].values()])
                if report["identical"] else "NOT identical"))
        lines.append(f"replay == oracle {'VERIFIED' if report['verified'] else 'NOT verified'}")
    problems += _request_problems(out, receipt, [{"replayed": True}], folder=lambda k: replay)
    problems += _output_problems(out, receipt, open_quietly(replay), "the replayed")
    return {"verified": not problems, "problems": problems, "stages": lines, "report": report}


def _output_problems(out: Path, receipt: dict, last, whose: str) -> list[str]:
    """The receipt's final state root against the last replay's state (``last``: its run), and ``OUT/model`` against
    the receipt's published root."""
    from ..hub.publish import build_manifest
    from ..trace.lineage import output_checkpoint, output_root

    problems = []
    final = (receipt.get("state_hashes") or {}).get("trace_params_root")
    if last is not None:
        hashes = json.loads((output_checkpoint(last) / "hashes.json").read_text())
        merged = output_root(last) if (last.header.get("model") or {}).get("peft") else None
        if final not in (hashes["params_root"], merged):
            problems.append(f"the receipt's final state root is not {whose} state")
    model_dir = out / "model"
    if not model_dir.is_dir() or build_manifest(model_dir)["params_root"] != receipt["state_hashes"]["params_root"]:
        problems.append(f"{model_dir} does not hold the receipt's model (weights root differs or folder missing: "
                        "edited after the deletion?)")
    from .outputs import adapter_problems

    problems += adapter_problems(out, last)  # OUT/adapter (a LoRA run's): the replayed adapter, config and tensors
    return problems


def _request_problems(out: Path, receipt: dict, stages: list, folder=None) -> list[str]:
    """The receipt's request against what the replayed stages deleted (keyed tags, where the stage's key is the
    request's): each replayed stage deleted no id outside the request, and every id of the request was deleted by a
    replayed stage, or before (an earlier deletion's log), in a stage the replay's recorded parents reach. A receipt
    relabelled with ids a deletion did not touch (a stage-1 id on a stage-2-only deletion) is not verified."""
    from ..trace.lineage import find_pipeline, open_quietly, parent_path
    from ..trace.request import never_trained_tags, unplanned_store_tags
    from ..trace.run import read_deletion_log
    from ..trace.verification import deleted_tags

    request = receipt.get("request") or {}
    want, fp = set(request.get("tags") or []), request.get("key_fingerprint")
    problems, covered, first = [], set(), None
    for k, st in enumerate(stages):
        where = folder(k) if folder is not None else out / f"stage-{k + 1}" / "replay"
        if not st.get("replayed") or not (where / "header.json").is_file():
            continue
        if json.loads((where / "header.json").read_text()).get("key_fingerprint") != fp:
            if (where / "private" / "hmac.key").is_file():
                return []  # a run with its own key (trace_key=): its tags are not comparable with the request's
            return [f"stage {k + 1}: the receipt's request is under key {fp}, not the key of the stage's tags: it "
                    "cannot be shown to be what this deletion deleted"]
        first = where if first is None else first
        log = read_deletion_log(where)
        extra = set((log[-1].get("forget_tags") or []) if log else []) - want
        if extra:
            problems.append(f"stage {k + 1}: its replay deleted {len(extra)} id(s) that are not in the receipt's "
                            "request: another deletion's stage")
        covered |= deleted_tags(where)
    missing = want - covered
    parent = parent_path(open_quietly(first)) if first is not None else None
    if missing and parent is not None and (parent / "header.json").is_file():
        try:
            for run in find_pipeline(parent):  # the unchanged stages before the first replayed one
                missing -= deleted_tags(run.path)
                if missing:  # or never trained on there: dropped by its trainer, or rows its plan never reached
                    missing -= never_trained_tags(run) | unplanned_store_tags(run)
        except UnlearnError:
            pass
    if missing:
        problems.append(f"{len(missing)} id(s) of the receipt's request were deleted by no replayed stage (nor "
                        "before, in a stage before them): the receipt claims ids this deletion did not delete")
    return problems
