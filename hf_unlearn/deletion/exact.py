"""The exact-deletion run of one recorded run: the redacted store, the suffix replay, the oracle when asked, the
model saved with its card, and the evidence the receipt carries (every process of a multi-process launch replays its
share; the main one writes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..validation import TOKENIZER_FILES
from .config import ForgetConfig
from .forget_receipt import ForgetReceipt, _receipt
from .outputs import card_fields, save_consolidated_output, save_output
from .preference_terms import preference_terms
from .publishing import _own_settings
from .runs import with_replay_progress

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def _exact(plan: dict, config: ForgetConfig, out: Path, tokenizer, log) -> ForgetReceipt:
    from ..hub.mixin import write_model_card
    from ..hub.publish import hashed_files
    from ..trace.fidelity import fidelity_statement
    from ..trace.issued import untagged
    from ..trace.proof import proof_statement
    from ..trace.proven import output_unproven
    from ..trace.replay import OracleReplayTrainer, RedactedReplayTrainer, already_deleted
    from ..trace.stack import stack_statement
    from ..trace.store import redact_store
    from ..trace.trainers import PROCESSING_CLASS_DIR, load_processing_class
    from ..trace.verification import verify

    run, ids, cost, timings = plan["run"], plan["ids"], plan["cost"], {}
    if tokenizer is None and config.tokenizer_path is not None:
        from ..models import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer_path)
    if tokenizer is None and (run.path / PROCESSING_CLASS_DIR).is_dir():  # a TRL run keeps its tokenizer
        tokenizer = load_processing_class(run.path / PROCESSING_CLASS_DIR)
    log(f"exact deletion of {len(ids)} id(s) from the recorded run {plan['source']}: {cost['slots_deleted']} slot(s) "
        f"in {cost['affected_steps']} of {cost['total_steps']} steps; suffix replay from checkpoint step "
        f"{cost['start_checkpoint']} ({100 * cost['fraction_replayed']:.0f}% of the run)")
    from ..trace.replay import describe_cost

    for line in describe_cost(cost):  # the minimum (T - s), the steps replayed and their ratio, before any compute
        log(line)
    for hazard in plan["hazards"]:
        log(f"HAZARD (recorded with the run): {hazard}")
    for note in plan["controls"]["notes"]:
        log(f"note: {note}")
    for line in plan.get("proof_lines", []):  # the environment probe and the proof (hf_unlearn.trace.proof)
        log(line)
    t = time.perf_counter()
    # rows an earlier request deleted (a request may repeat an id; the service serves it so) or the trainer dropped
    # before training: absent from the store
    redaction = redact_store(run.store_path, ids, out / "store", run.key, id_column=run.id_column,
                             already_deleted=already_deleted(run, ids))
    timings["redact_s"] = time.perf_counter() - t
    if plan.get("processes") is not None:
        plan["processes"].wait_for_everyone()  # the other processes replay from the redacted store from here
    log(f"redacted store: {redaction['rows_before']} -> {redaction['rows_after']} rows; "
        f"{redaction['checks']['id_column_scanned']}")
    t = time.perf_counter()
    replay = with_replay_progress(RedactedReplayTrainer, "replay (redacted store)", config.progress)(
        run, out / "store", ids, out / "replay", data_collator=plan["data_collator"], proven_start=plan.get("start_proof"))
    final = replay.train()
    timings["replay_s"] = time.perf_counter() - t
    stats = replay.replay_stats
    log(f"replayed {stats['segments_replayed']} of {stats['total_steps']} steps from step {stats['start_step']} "
        f"in {timings['replay_s']:.0f} s")
    # what of the replay's own steps is unproven, read from its sealed output as `trace verify` reads it: its fresh
    # start too, when nothing proved it (not probed under --accept-unproven); the receipt lists them with the plan's
    own = output_unproven(json.loads((out / "replay" / "header.json").read_text()), out / "replay", "replay")
    if own and own["starts"]:
        log(f"UNPROVEN{' (accepted)' if config.accept_unproven else ''}: {own['why']}")
    report, oracle_dummies = None, 0
    if config.oracle:
        t = time.perf_counter()
        oracle = with_replay_progress(OracleReplayTrainer, "oracle (full replay)", config.progress)(
            run, ids, out_dir=out / "oracle", data_collator=plan["data_collator"],
            environment_probe=plan.get("environment_probe"))
        oracle.train()
        oracle_dummies = oracle.replay_stats.get("deleted_rows_trained_as_dummies") or 0
        report = verify(out / "replay", out / "oracle")
        timings["oracle_s"] = time.perf_counter() - t
        p, o = report["params"], report["optimizer"]
        log(f"replay vs oracle: {p['mismatched_elements']} of {p['elements']:,} parameter and "
            f"{o['mismatched_elements']} of {o['elements']:,} optimizer elements differ: "
            + ("VERIFIED bit-identical" if report["verified"] else
               f"bit-identical, but NOT VERIFIED: {'; '.join(report['provenance']['problems'])}"
               if report["identical"] and report["provenance"]["problems"] else report["verdict"]))
    model_dir = out / "model"
    if plan.get("processes") is not None:  # a run of several processes (an FSDP2 run's shards): one folder
        replayed = save_consolidated_output(run, final, out / "replay", model_dir)
    else:  # a LoRA run: the adapter merged into its base (what is published), the adapter itself kept beside it
        replayed = save_output(replay, out / "replay", model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
        if replayed.get("adapter_dir"):  # the adapter is loaded on its own too (a PEFT adapter folder)
            tokenizer.save_pretrained(replayed["adapter_dir"])
    elif not any((model_dir / f).is_file() for f in TOKENIZER_FILES):  # the replay may have saved the run's own
        kept = run.path / "collator"
        where = (f"the run keeps its collator's tokenizer in {kept}: pass --tokenizer {kept}" if
                 any((kept / f).is_file() for f in TOKENIZER_FILES) else "pass --tokenizer")
        log(f"note: no tokenizer given, so the model folder holds none; {where} (tokenizer= from Python) to save it "
            "with the model")
    saved_files = hashed_files(model_dir)  # config, tokenizer, ... as saved: the receipt checks them
    card_info = replay.unlearning_card_info()
    if card_info["extra"].get("exact_deletion"):
        card_info["extra"]["exact_deletion"] = card_fields(card_info["extra"]["exact_deletion"], replayed)
    write_model_card(model_dir, card_info, base_model=config.base_model, datasets=config.datasets,
                     not_ids=_own_settings(card_info))
    exact = card_info["extra"].get("exact_deletion", {})
    evidence = {
        "cost": cost,
        "redaction": {"rows_before": redaction["rows_before"], "rows_after": redaction["rows_after"],
                      "store_sha256": redaction["store_sha256"], "id_check": redaction["checks"]["id_column_scanned"],
                      "receipt": str(out / "store" / "redaction_receipt.json")},
        "replay": {**stats, "output": str(out / "replay")},
        # VERIFIED needs the states bit-identical AND the two folders a replay and an oracle of this run and request
        "verified": None if report is None else bool(report["verified"]),
        "hazards": plan["hazards"],  # what the recording could not pin down (random collator, CUDA kernels, ...)
        "controls": plan["controls"],  # keyed (seeds, lrs, steps, ... under the run key) or unkeyed (an older run)
        # what the engine was shown to reproduce: the recording's self-check and guards, and this replay's own
        # checkpoints and per-step fingerprints (the oracle's are in evidence.oracle)
        "fidelity": fidelity_statement(json.loads((out / "replay" / "header.json").read_text())),
        "numeric_stack": stack_statement(run.header),  # threads, CPU capability, versions the replays ran with
        "proof": proof_statement(run.header),  # the engine reproduced the whole run (hf_unlearn.trace.proof)?
        # accepted with --accept-unproven: never VERIFIED; the same steps and starts `trace verify` names
        "unproven_steps": sorted(set(plan.get("unproven_steps", [])) | set((own or {}).get("steps", []))
                                 | set((report or {}).get("unproven_steps", []))),
        "unproven_starts": sorted(set((own or {}).get("starts", [])) | set((report or {}).get("unproven_starts", []))),
        "environment_probe": untagged(plan.get("environment_probe")),  # this process re-ran recorded steps
        # how the replay's fresh start at its kept checkpoint was proven: by the proof, its own first step, a probe
        "start": stats.get("start_proof"),
    }
    log(f"fidelity: {evidence['fidelity']}")
    log(f"numeric stack: {evidence['numeric_stack']}")
    if preference_terms([run]):  # what a DPO deletion's counterfactual keeps (the receipt's guarantee line)
        evidence["preference"] = preference_terms([run])
    if replayed.get("merged_adapter"):
        evidence["output"] = {"kind": "merged adapter", "adapter": replayed["adapter_dir"],
                              "replayed_params_root": exact.get("replayed_params_root"),
                              **({"base_dtype": replayed["base_dtype"]} if replayed.get("base_dtype") else {})}
        log(f"output: the replayed adapter merged into its base in {model_dir} (what is published); the adapter "
            f"itself in {replayed['adapter_dir']}" + (f" (load its base in {replayed['base_dtype']} to merge it to "
                                                      "the published model)" if replayed.get("base_dtype") else ""))
    if run.header.get("kept_model"):  # load_best_model_at_end: the output is the counterfactual of the kept model
        evidence["kept_model"] = run.header["kept_model"]
        log(f"kept model: {run.header['kept_model']['why']}")
    if report is not None and oracle_dummies:
        evidence["oracle_dummies"] = oracle_dummies
        log(f"note: the oracle trained {oracle_dummies} deleted row(s) or document(s) as dummies, not as the rows "
            "without weight (a packed row's documents, or a collator that builds labels from the tokens): for them the "
            "verdict does not show that the loss ignores their tokens (the recording's probe and the per-microbatch "
            "dummy check are the evidence there)")
    if report is not None:
        evidence["oracle"] = {"output": str(out / "oracle"), "roots": report["roots"],
                              "identical": bool(report["identical"]),
                              "problems": list(report["provenance"]["problems"]),
                              "params_mismatched_elements": report["params"]["mismatched_elements"],
                              "optimizer_mismatched_elements": report["optimizer"]["mismatched_elements"],
                              "params_elements": report["params"]["elements"],
                              "optimizer_elements": report["optimizer"]["elements"],
                              "fidelity": report["provenance"]["fidelity"].get("oracle")}
    return _receipt(plan, config, out, model_dir, evidence, timings, optimizer_root=exact.get("optimizer_root", ""),
                    trace_params_root=exact.get("replayed_params_root") or exact.get("params_root"),
                    saved_files=saved_files, published_root=exact.get("params_root"))


def _exact_peer(plan: dict, config: ForgetConfig) -> None:
    """A process other than the main one of a multi-process exact deletion: it replays its share of the run (and of
    the oracle) with the main process, which writes everything (store, model, card, receipt)."""
    from ..trace.replay import OracleReplayTrainer, RedactedReplayTrainer

    out, run, ids = Path(config.output_dir), plan["run"], plan["ids"]
    plan["processes"].wait_for_everyone()  # the main process redacted the store
    RedactedReplayTrainer(run, out / "store", ids, out / "replay", data_collator=plan["data_collator"],
                          proven_start=plan.get("start_proof")).train()
    if config.oracle:
        OracleReplayTrainer(run, ids, out_dir=out / "oracle", data_collator=plan["data_collator"],
                            environment_probe=plan.get("environment_probe")).train()  # as the main process's
