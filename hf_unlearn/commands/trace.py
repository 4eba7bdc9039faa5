"""`hf-unlearn trace ...`: inspect, cost, prove, redact, replay, oracle and verify a recorded run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import add_subcommands

FORGET_HELP = ("file of ids to delete: .jsonl (one JSON value a line: 3600 or \"3600\"), .json (a list), or text "
               "(one id a line; digit-only lines are ints)")
COLLATOR_HELP = ("the run's data collator when the trace cannot rebuild it: module:name (the collator) or "
                 "module:name() (a factory called with no arguments); the current directory is importable")

ACCEPT_HELP = ("run even where the run's steps are not proven to be reproduced by the engine (`trace prove` proves "
               "them); the output is never VERIFIED")


def register(parser) -> None:
    sub = add_subcommands(parser)
    p = sub.add_parser("inspect", help="summary and integrity check of every file of a recorded run")
    p.add_argument("run", help="the trace_dir of a TraceRecordingTrainer (or a replay's output)")
    p.add_argument("--deep", action="store_true",
                   help="also load every checkpoint and check its state against its hashes.json (reads them all)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=inspect_cmd)

    p = sub.add_parser("lineage", help="the pipeline a run belongs to, in training order: stage, run id, trainer, "
                                       "parent, rows, steps")
    p.add_argument("run", nargs="+", help="the pipeline's runs in training order, or only its last run (the earlier "
                                          "stages are found from the recorded parents)")
    p.add_argument("--json", action="store_true", help="print the stages as JSON")
    p.set_defaults(func=lineage_cmd)

    p = sub.add_parser("cost", help="where a suffix replay starts and how much of the run it re-executes (for a "
                                    "pipeline: every stage, added up)")
    p.add_argument("run", nargs="+", help="a recorded run; several: a pipeline's runs in training order (one run "
                                          "that starts from another recorded run's output is costed as its pipeline)")
    p.add_argument("--forget", required=True, help=FORGET_HELP)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cost_cmd)

    p = sub.add_parser("prove", help="re-run the recorded run with the replay engine and no deletion and match its "
                                     "state at every optimizer step (about one training run's compute, once; "
                                     "resumable); the proof is sealed into the run and deletions of proven steps can "
                                     "be VERIFIED")
    p.add_argument("run", help="the trace_dir of a TraceRecordingTrainer (under the run's own launch if it was "
                               "recorded by several processes)")
    p.add_argument("--collator", default=None, help=COLLATOR_HELP)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the sealed proof record as JSON")
    p.add_argument("--fresh-starts", action="store_true",
                   help="also prove a replay started afresh at each kept checkpoint after step 0, ahead of any "
                        "deletion (one step each); by default the deletion that starts there proves it")
    p.set_defaults(func=prove_cmd)

    p = sub.add_parser("redact", help="write a new token store without the deleted rows, plus a redaction receipt")
    p.add_argument("run")
    p.add_argument("--forget", required=True)
    p.add_argument("--out", required=True, help="folder of the redacted store (must not exist)")
    p.add_argument("--store", default=None, help="source store (default: RUN/private/store)")
    p.set_defaults(func=redact_cmd)

    p = sub.add_parser("replay", help="RedactedReplayTrainer: replay the run from the redacted store")
    p.add_argument("run")
    p.add_argument("--store", required=True, help="the redacted store (`trace redact --out`)")
    p.add_argument("--forget", required=True)
    p.add_argument("--out", required=True, help="output folder: a recorded run with the final state")
    p.add_argument("--full", action="store_true", help="replay from step 0 instead of the latest usable checkpoint")
    p.add_argument("--collator", default=None, help=COLLATOR_HELP)
    p.add_argument("--save-model", default=None, metavar="DIR",
                   help="also save the replayed model as one save_pretrained folder (a sharded FSDP2 run's too: "
                        "written by the main process from the full tensors)")
    p.add_argument("--accept-unproven", action="store_true", help=ACCEPT_HELP)
    p.set_defaults(func=replay_cmd)

    p = sub.add_parser("oracle", help="the counterfactual from the original store (deleted slots as weight-0 dummies)")
    p.add_argument("run")
    p.add_argument("--forget", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--baselines", action="store_true",
                   help="also compute the naive `filter` and `repack` counterfactuals (OUT/baselines/) for comparison")
    p.add_argument("--collator", default=None, help=COLLATOR_HELP)
    p.add_argument("--accept-unproven", action="store_true", help=ACCEPT_HELP)
    p.set_defaults(func=oracle_cmd)

    p = sub.add_parser("verify", help="exit 0 iff OUT and ORACLE are a replay and an oracle of one run for the same ids "
                                      "and their params AND optimizer state are bit-identical")
    p.add_argument("out", help="replay output (run folder, checkpoint folder or .pt file), or the output folder of a "
                               "pipeline deletion (`forget RUN_1 RUN_2 ... --oracle`): its whole chain is checked")
    p.add_argument("oracle", nargs="?", default=None, help="oracle output (not for a pipeline deletion's folder)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=verify_cmd)

    # housekeeping last: the deletion steps above are what a newcomer looks for
    p = sub.add_parser("compact", help="replace a sealed run's plan.bin, wal.bin and manifest.bin by one compact "
                                       "provenance.bin (same records; see docs/exact-deletion.md, Compacting a sealed run)")
    p.add_argument("run")
    p.set_defaults(func=compact_cmd)


def read_forget_file(path) -> list:
    """The ids of a deletion request (see :func:`hf_unlearn.data.ids.read_ids` for the typed forms)."""
    from ..data.ids import read_ids

    return read_ids(path)


def _quiet():
    import logging
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    def one_line(message, category, filename, lineno, file=None, line=None):
        print(f"hf-unlearn: warning: {message}", file=sys.stderr)

    warnings.showwarning = one_line


def _collator(args):
    from ..data.collators import load_collator

    return load_collator(args.collator) if args.collator else None


def inspect_cmd(args) -> int:
    from ..trace.run import check_run
    from ..trace.tags import run_key

    rep, header, _ = check_run(args.run, key=run_key(args.run, required=False), deep=args.deep)
    if args.json:
        print(json.dumps({"summary": rep.summary, "errors": rep.errors, "warnings": rep.warnings,
                          "hazards": rep.hazards, "notes": header.get("notes", []) + rep.notes}, indent=1))
        return 0 if rep.ok else 1
    s = rep.summary
    if "run" not in s:  # a file the rest depends on is missing or refused: say which, one line each
        for e in rep.errors:
            print(f"ERROR: {e}")
        print(f"integrity: FAILED ({len(rep.errors)} error(s)): {args.run} cannot be read further")
        return 1
    print(f"run {s['run']}: {'sealed' if s['sealed'] else 'NOT sealed'}, {s['optimizer_steps']} optimizer steps, "
          f"{s['microbatches']} microbatches, {s['slots']} slots ({s['dummy_slots']} dummy), "
          f"store rows {s['store_rows']}, deletion requests {s['deletion_requests']}")
    print(f"checkpoints at steps {s['checkpoints']} ({'states checked against hashes.json' if s['checkpoints_deep_checked'] else 'hashes.json sidecars checked; --deep checks the states'}); "
          + (f"plan, WAL and manifest compacted into {s['plan_file']} ({s['plan_bytes']} B)" if s.get("compact")
             else f"WAL {s['wal_bytes']} B, manifest {s['manifest_bytes']} B") + f"; {s['world_size']} process(es)")
    print(f"trainer {s['trainer']}" + (f" (config {header['trainer']['config_class']}"
                                       f"{', arguments ' + json.dumps(header['trainer']['kwargs']) if header['trainer'].get('kwargs') else ''})"
                                       if header.get("trainer") else ""))
    if header.get("reference_model"):  # a DPO run: what its reference is and where a replay loads it
        from ..trace.reference import describe_record

        print(describe_record(header["reference_model"]))
    packing = (header.get("dataset") or {}).get("packing")
    if packing:
        from ..trace.packing import map_status

        print(f"packing {packing['strategy']} (max_length {packing['max_length']}): {packing['documents']} documents, "
              f"{packing['fragments']} fragments in {packing['packed_rows']} packed rows; {map_status(args.run, header)}")
    print(f"model {header['model']['class']} ({header['model']['num_parameters']:,} params), optimizer "
          f"{header['optimizer']['class']}, torch {header['versions'].get('torch')}, "
          f"transformers {header['versions'].get('transformers')}")
    if header.get("checkpoint_retention"):
        from ..trace.retention import describe

        print(f"checkpoints: {describe(header['checkpoint_retention'])}")
    from ..trace.lineage import describe as describe_lineage

    print(f"lineage: {describe_lineage(header)}" + ("; `hf-unlearn trace lineage RUN` lists the pipeline"
                                                   if (header.get("lineage") or {}).get("parent") else ""))
    from ..trace.fidelity import fidelity_statement

    print(f"fidelity: {fidelity_statement(header)}")
    from ..trace.proof import proof_statement

    print(f"proof: {proof_statement(header)}")
    from ..trace.stack import stack_statement

    print(f"numeric stack: {stack_statement(header)}")
    for h in rep.hazards:
        print(f"HAZARD: {h}")
    for n in header.get("notes", []) + rep.notes:
        print(f"note: {n}")
    print(f"controls: {s.get('controls')} ({s.get('plan_file')}, {s.get('plan_bytes')} B)")
    for w in rep.warnings:
        print(f"WARNING: {w}")
    for e in rep.errors:
        print(f"ERROR: {e}")
    print("integrity: OK" if rep.ok else f"integrity: FAILED ({len(rep.errors)} error(s))")
    return 0 if rep.ok else 1


def compact_cmd(args) -> int:
    from ..trace.compact import compact_run

    info = compact_run(args.run)
    before = sum(info["replaced_bytes"].values())
    print(f"{args.run}: {' + '.join(f'{n} {b:,} B' for n, b in info['replaced_bytes'].items())} = {before:,} B -> "
          f"{info['file']} {info['bytes']:,} B ({before / max(1, info['bytes']):.1f}x smaller; order: {info['order']}, "
          f"seeds: {info['seeds']}, lengths: {info['lens']})")
    return 0


def lineage_cmd(args) -> int:
    from ..deletion.pipeline import open_pipeline
    from ..trace.lineage import describe, lineage_of

    _quiet()
    runs = open_pipeline(args.run)
    rows = []
    for k, run in enumerate(runs):
        parent = (lineage_of(run).get("parent") or {}).get("run_id")
        rows.append({"stage": k + 1, "run": str(run.path), "run_id": run.header["run_id"],
                     "trainer": (run.header.get("trainer") or {}).get("class", "transformers.trainer:Trainer"),
                     "parent": parent, "rows": run.header["dataset"].get("rows"), "steps": run.kept().total_steps,
                     "start": describe(run)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"stage {r['stage']}: {r['run']} run {r['run_id']} {r['trainer'].rsplit(':', 1)[-1]}, parent "
              f"{r['parent'] or 'external base'}, {r['rows']} rows, {r['steps']} steps")
        print(f"  {r['start']}")
    print(f"pipeline: {len(rows)} stage(s), each starting from the previous stage's output (weights roots checked)")
    return 0


def _pipeline_given(runs: list[str]) -> bool:
    from ..deletion.runs import _has_run_parent

    return len(runs) > 1 or _has_run_parent(runs[0])


def cost_cmd(args) -> int:
    from ..trace.replay import replay_cost
    from ..trace.run import open_run

    _quiet()
    if _pipeline_given(args.run):
        from ..deletion.pipeline import describe_pipeline_cost, open_pipeline, pipeline_cost

        c = pipeline_cost(open_pipeline(args.run), read_forget_file(args.forget))
        if args.json:
            print(json.dumps(c, indent=1, default=str))
            return 0
        for line in describe_pipeline_cost(c):
            print(line)
        return 0
    c = replay_cost(open_run(args.run[0], check_checkpoints=False), read_forget_file(args.forget))
    if args.json:
        print(json.dumps(c, indent=1))
        return 0
    already = f" ({c['already_deleted']} deleted by an earlier request)" if c["already_deleted"] else ""
    print(f"{c['forget_ids']} id(s){already} in {c['slots_deleted']} slot(s), {c['affected_steps']} affected optimizer "
          f"step(s) (first: {c['first_affected_step']}), {c['segments_emptied']} segment(s) emptied")
    from ..trace.replay import describe_cost

    for line in describe_cost(c):
        print(line)
    return 0


def redact_cmd(args) -> int:
    from ..trace.replay import already_deleted
    from ..trace.run import open_run
    from ..trace.store import redact_store

    _quiet()
    run = open_run(args.run, strict=False, check_checkpoints=False)
    forget = read_forget_file(args.forget)
    receipt = redact_store(args.store or run.store_path, forget, args.out, run.key, id_column=run.id_column,
                           already_deleted=already_deleted(run, forget))
    absent = f", {receipt['already_absent']} already deleted by an earlier request" if receipt["already_absent"] else ""
    print(f"redacted store {args.out}: {receipt['rows_before']} -> {receipt['rows_after']} rows "
          f"({receipt['deleted']} id(s) requested{absent}), sha256 {receipt['store_sha256'][:16]}...")
    for name, text in receipt["checks"].items():
        print(f"  {name}: {text}")
    print(f"receipt: {args.out}/redaction_receipt.json")
    return 0


def prove_cmd(args) -> int:
    from ..trace.proof import proof_statement, prove
    from ..trace.run import read_header

    _quiet()
    record = prove(args.run, data_collator=_collator(args), progress=args.progress, log=print,
                   fresh_starts=args.fresh_starts)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(f"{args.run}: {proof_statement(read_header(args.run))} "
              f"({record['wall_seconds']:.0f} s; sealed into header.json)")
        if record.get("diverged"):
            print(f"first divergence: {record['diverged']['why']}", file=sys.stderr)
    return 0 if record["proven"] else 1


def _before_deletion(args, run, forget, start: int | None, collator) -> dict | None:
    """The proof gate and the environment probe, before any compute (hf_unlearn.trace.proof); returns
    :func:`~hf_unlearn.trace.proof.before_deletion`'s outcome (``start_proof``: the replay's ``proven_start``)."""
    from ..trace.proof import before_deletion
    from ..trace.replay import replay_cost

    cost = None if start is None else replay_cost(run, forget)
    first = 0 if start is None or args.full else cost["start_checkpoint"]
    affected = None if cost is None else cost["first_affected_step"]
    checked = before_deletion(run, first, start is None, args.accept_unproven, collator, first_affected=affected)
    for line in checked["proof_lines"]:
        print(line)
    return checked


def replay_cmd(args) -> int:
    from ..trace.replay import RedactedReplayTrainer
    from ..trace.run import open_run

    _quiet()
    run, forget, collator = open_run(args.run), read_forget_file(args.forget), _collator(args)
    proven_start = _before_deletion(args, run, forget, 0, collator)["start_proof"]
    trainer = RedactedReplayTrainer(run, args.store, forget, args.out, start="full" if args.full else "suffix",
                                    data_collator=collator, proven_start=proven_start)
    final = trainer.train()
    s = trainer.replay_stats
    if not trainer.accelerator.is_main_process:
        return 0
    if args.save_model:
        from ..trace.sharding import save_consolidated

        save_consolidated(trainer.run, final, args.save_model)
        print(f"model saved (save_pretrained, one folder): {args.save_model}")
    if s["nothing_to_replay"]:
        print(f"nothing to replay: the ids' slots were deleted by an earlier request; output run {args.out} is sealed "
              "with the parent's final state and a deletion-log entry")
        return 0
    print(f"replayed {s['segments_replayed']} of {s['total_steps']} steps from checkpoint step {s['start_step']} "
          f"({s['optimizer_steps_taken']} optimizer steps taken); output run: {args.out}")
    _print_fidelity(trainer)
    _print_unproven(args, args.out, "replay")
    return 0


def _print_unproven(args, out, role: str) -> None:
    """What of the output's own steps is unproven, as `trace verify` will count it (its fresh start included)."""
    from ..trace.proven import output_unproven
    from ..trace.run import read_header

    own = output_unproven(read_header(out), out, role)
    if own:
        print(f"UNPROVEN{' (accepted)' if args.accept_unproven else ''}: {own['why']}")


def _print_fidelity(trainer) -> None:
    from ..trace.fidelity import fidelity_statement

    header = {**trainer.run.header, "fidelity": {**(trainer.run.header.get("fidelity") or {}),
                                                 "checkpoints_matched": trainer.replay_stats["checkpoints_matched"]}}
    print(f"fidelity: {fidelity_statement(header)}")
    kept = trainer.run.header.get("kept_model")
    if kept:
        print(f"kept model: {kept['why']}")


def oracle_cmd(args) -> int:

    from ..trace.replay import OracleReplayTrainer, filter_counterfactual, repack_counterfactual, save_state
    from ..trace.run import open_run

    _quiet()
    forget = read_forget_file(args.forget)
    run = open_run(args.run)
    collator = _collator(args)
    if args.baselines:
        import os

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from ..errors import UnlearnError

            raise UnlearnError("--baselines runs in one process: run `trace oracle --baselines` without accelerate launch")
        if run.header.get("reference_model"):  # a DPO run: refused before the oracle's compute, not after
            from ..errors import UnlearnError
            from ..trace.replay import PAIRS_BASELINE

            raise UnlearnError(PAIRS_BASELINE)
    probe = _before_deletion(args, run, forget, None, collator)["environment_probe"]
    trainer = OracleReplayTrainer(run, forget, out_dir=args.out, data_collator=collator, environment_probe=probe)
    trainer.train()
    if not trainer.accelerator.is_main_process:
        return 0
    print(f"oracle: full replay of {trainer.replay_stats['total_steps']} steps "
          f"({trainer.replay_stats['optimizer_steps_taken']} optimizer steps taken); output: {args.out}")
    _print_fidelity(trainer)
    _print_unproven(args, args.out, "oracle")
    if args.baselines:
        out = Path(args.out) / "baselines"
        save_state(filter_counterfactual(run, forget, data_collator=collator), out / "filter.pt")
        save_state(repack_counterfactual(run, forget, out / "_repack_tmp", data_collator=collator), out / "repack.pt")
        import shutil

        shutil.rmtree(out / "_repack_tmp", ignore_errors=True)
        print(f"baselines: {out}/filter.pt, {out}/repack.pt")
    return 0


def verify_cmd(args) -> int:
    from ..trace.verification import verify

    _quiet()
    if args.oracle is None:
        out = Path(args.out)
        if (out / "receipt.json").is_file() and (out / "replay").is_dir() and not (out / "stage-1").is_dir():
            return _verify_single(args)
        return _verify_pipeline(args)
    report = verify(args.out, args.oracle)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if report["verified"] else 1
    for part in ("params", "optimizer"):
        r = report[part]
        print(f"{part:9s}: {r['tensors']} tensors, {r['elements']:,} elements, {len(r['mismatched_tensors'])} tensors "
              f"and {r['mismatched_elements']:,} elements differ, L2 distance {r['l2']:.6g}")
    roots = report["roots"]
    for side, name in (("a", args.out), ("b", args.oracle)):
        print(f"roots {name}: params {roots[side]['params'][:16]}... optimizer {roots[side]['optimizer'][:16]}...")
    for name, b in report["baselines"].items():
        print(f"baseline {name:7s} vs oracle: {b['params_mismatched_elements']:,} of {b['params_elements']:,} parameter "
              f"elements differ, L2 distance {b['params_l2']:.6g}")
    prov = report["provenance"]
    print(f"fidelity: {report['fidelity']}")
    for h in prov["hazards"]:
        print(f"HAZARD (not covered by this verdict): {h}")
    for n in prov.get("notes", []):
        print(f"note (not covered by this verdict): {n}")
    if report["verified"]:
        print(f"VERIFIED: parameters and optimizer state are bit-identical to the oracle of the same run for the same "
              f"{prov['deleted_ids']} deleted id(s)")
        return 0
    if report["identical"] and not prov["problems"]:  # never VERIFIED with steps the engine is not proven on
        print(report["verdict"] + ": " + "; ".join(u["why"] for u in prov["unproven"].values()), file=sys.stderr)
        return 1
    if report["identical"]:
        print("NOT VERIFIED: the states are bit-identical, but " + "; ".join(prov["problems"]), file=sys.stderr)
        return 1
    print("NOT IDENTICAL: the replay differs from the oracle"
          + (f" (also: {'; '.join(prov['problems'])})" if prov["problems"] else ""), file=sys.stderr)
    return 1


def _verify_single(args) -> int:
    from ..deletion.pipeline import verify_single

    return _verify_folder(args, verify_single(args.out), (
        "VERIFIED: the replay is bit-identical to its oracle (provenance checked), the receipt's request is what it "
        "deleted, and the model folder (and a LoRA run's adapter folder) is the replayed state"),
        "NOT VERIFIED: the deletion's output folder does not hold what its receipt says")


def _verify_pipeline(args) -> int:
    from ..deletion.pipeline import verify_pipeline

    return _verify_folder(args, verify_pipeline(args.out), (
        "VERIFIED: every replayed stage is bit-identical to its oracle, each stage's replay and oracle start from the "
        "previous stage's (run ids and weights roots recomputed), and the model folder is the last stage's replayed "
        "state"), "NOT VERIFIED: the pipeline deletion's chain does not hold")


def _verify_folder(args, report: dict, verified: str, not_verified: str) -> int:
    """Print a deletion output folder's check (:func:`~hf_unlearn.deletion.pipeline.verify_single` or
    ``verify_pipeline``); exit 0 iff it verified."""
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if report["verified"] else 1
    for line in report["stages"]:
        print(line)
    if report["verified"]:
        print(verified)
        return 0
    for p in report["problems"]:
        print(f"PROBLEM: {p}", file=sys.stderr)
    print(not_verified, file=sys.stderr)
    return 1
