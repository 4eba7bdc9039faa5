"""One call from a deletion request to published proof: ``hf_unlearn.forget(model_or_run, ids, ...)``.

(The module is ``forgetting``, not ``forget``: a submodule named ``forget`` would replace the function
``hf_unlearn.deletion.forget`` on the package as soon as it was imported.)

* A **recorded run** (the ``trace_dir`` of a ``TraceRecordingTrainer``) gets an exact deletion: the replay cost, a
  redacted store without the rows, a suffix replay from it, optionally the trace oracle with a bit-for-bit check.
* A **model** (local folder, GGUF file or Hub id) gets an approximate method from the method registry (MASC by
  default, any ``hf_unlearn.methods.registry`` name), evaluated before and after on the forget rows and on a sample
  of the retained rows.

Either way the output folder holds the model (``model/``: safetensors, tokenizer when known, model card with the
state-hash roots) and ``receipt.json``: what was deleted as keyed tags (never raw ids), how, the evidence, the state
hashes, and, with ``repo=``, the published commit and tag and the outcome of downloading it again and re-checking
every tensor's hash. Bad input is refused before any compute; a failed call leaves no output folder behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..utils import weights_follow_umask

RECEIPT_FILE = "receipt.json"
RECEIPT_FORMAT = "hf_unlearn.forget_receipt.v1"
EXACT = "exact"
DEFAULT_APPROXIMATE = "masc"
COMMON_METHOD_ARGS = {"retain_loss": str, "lambda_forget": float, "lambda_retain": float}


@dataclass
class ForgetConfig:
    """Options of :func:`forget` (and of ``hf-unlearn forget``, which is generated from these fields)."""

    output_dir: str = field(metadata={"help": "output folder (new or empty): model/, receipt.json and the evidence"})
    method: str | None = field(default=None, metadata={
        "help": "'exact' (needs a recorded run; the default for one) or an approximate method of the registry "
                "(default for a model: masc)"})
    data: str | None = field(default=None, metadata={
        "help": "rows the ids refer to, for approximate methods: 'tofu' (TOFU full; the default), 'tofu-subset' (the "
                "10 authors shipped with the package), a .jsonl/.json/.parquet/.csv file or a save_to_disk folder "
                "with question/answer (or input_ids/labels) and an id column; from Python also a datasets.Dataset"})
    tofu_path: str | None = field(default=None, metadata={
        "help": "local TOFU folder for data='tofu' (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)"})
    id_column: str = field(default="id", metadata={"help": "the data's id column (default id)"})
    tokenizer_path: str | None = field(default=None, metadata={
        "help": "exact: tokenizer (folder or Hub id) saved with the model, which a recorded run does not hold (from "
                "Python, tokenizer= takes the object)"})
    collator: str | None = field(default=None, metadata={
        "help": "exact: the run's data collator when the trace cannot rebuild it: module:name (the collator) or "
                "module:name() (a factory); from Python, data_collator= takes the object"})
    oracle: bool = field(default=False, metadata={
        "help": "exact: also run the trace oracle (a full replay from step 0 on the original store) and check the "
                "replay against it bit for bit"})
    learning_rate: float | None = field(default=None, metadata={
        "help": "approximate: learning rate (default 1e-5, also with the preset)"})
    num_train_epochs: float | None = field(default=None, metadata={
        "help": "approximate: epoch budget over the forget rows (a cap for methods that stop themselves; default 5, "
                "10 with --preset open-unlearning)"})
    max_steps: int = field(default=-1, metadata={"help": "approximate: step budget (default: num_train_epochs)"})
    batch_size: int | None = field(default=None, metadata={
        "help": "approximate: forget (and retain) rows per step (default 4, 8 with --preset open-unlearning)"})
    max_length: int | None = field(default=None, metadata={
        "help": "approximate: tokens per QA pair (default 256, 512 with --preset open-unlearning)"})
    preset: str | None = field(default=None, metadata={
        "help": "approximate: 'open-unlearning' = OpenUnlearning's budget, conventions and method defaults "
                "(hf_unlearn.presets); options given explicitly win, also when equal to the default"})
    lora: bool = field(default=False, metadata={"help": "approximate: train a LoRA adapter, merged into the saved model"})
    lora_r: int = field(default=8, metadata={"help": "approximate: LoRA rank (default 8)"})
    seed: int = field(default=0, metadata={"help": "seed for training and the retain sample (default 0)"})
    method_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "approximate: method options as KEY=VALUE (the method's own options, e.g. alpha=0.2 for masc, and "
                "retain_loss, lambda_forget, lambda_retain)"})
    max_retain_rows: int | None = field(default=400, metadata={
        "help": "approximate: retained rows used as the retain set, a seeded sample (default 400; 0 = all)"})
    eval_rows: int = field(default=40, metadata={
        "help": "rows evaluated before and after on each side (forget, retained sample; default 40; 0 = no "
                "evaluation)"})
    max_new_tokens: int = field(default=48, metadata={"help": "tokens generated per answer for ROUGE-L (default 48)"})
    repo: str | None = field(default=None, metadata={
        "help": "publish to this Hub repo (org/name) as the next deletion-NNNN tag, then download and verify it"})
    private: bool = field(default=False, metadata={"help": "create the Hub repo private"})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or the saved login)"})
    endpoint: str | None = field(default=None, metadata={"help": "Hub URL (default: HF_ENDPOINT or huggingface.co)"})
    base_model: str | None = field(default=None, metadata={"help": "Hub id of the base model, for the card"})
    datasets: list[str] | None = field(default=None, metadata={"help": "dataset Hub ids for the card"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace an earlier output of this command in output_dir (one whose receipt.json is a forget receipt)"})
    progress: bool = field(default=True, metadata={"help": "progress bars on every long stage"})
    accept_unproven: bool = field(default=False, metadata={
        "help": "exact: delete even where the run's steps are not proven to be reproduced by the engine (`hf-unlearn "
                "trace prove RUN` proves them); the receipt names the unproven steps and the deletion is never "
                "VERIFIED"})


@dataclass
class ForgetReceipt:
    """What :func:`forget` did; ``receipt.json`` is :meth:`to_dict`. It holds keyed tags, never raw ids."""

    mode: str
    method: str
    source: str
    output_dir: str
    request: dict
    evidence: dict
    state_hashes: dict
    model_dir: str
    published: dict | None = None
    timings: dict = field(default_factory=dict)
    created: str = ""
    versions: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every check that ran passed (oracle identity, Hub verification)."""
        exact_ok = self.evidence.get("verified", True) is not False or self._accepted_unproven
        return exact_ok and (self.published is None or bool(self.published.get("verify_ok")))

    @property
    def guarantee(self) -> str:
        """What the deletion proves, and what it does not, in one sentence (in the summary and ``receipt.json``)."""
        if self.mode == EXACT:
            verified = self.evidence.get("verified")
            hazards = self.evidence.get("hazards") or []
            caveat = (f"; but the run has {len(hazards)} recorded hazard(s) (see evidence.hazards), so the replay may "
                      "not reproduce what the original training computed") if hazards else ""
            from .preference_terms import preference_clause

            caveat = preference_clause(self.evidence.get("preference"), bool(self.evidence.get("pipeline"))) + caveat
            if (self.evidence.get("output") or {}).get("kind") == "merged adapter":
                caveat = ("; the published model is the replayed adapter merged into its base (merge_and_unload with "
                          "the recorded numeric stack; the adapter itself is kept in evidence.output.adapter)" + caveat)
            if verified is True and self.evidence.get("pipeline"):
                return ("exact through the pipeline: each stage from the first one holding a row replayed with the rows' "
                        "loss contributions set to zero (a store without them), every later stage replayed from step 0 "
                        "from the new parent's output with its recorded controls, each stage bit-identical to its "
                        "oracle (the oracle of each stage starting from the oracle of the stage before; same replay "
                        "engine)" + caveat)
            if verified is True:
                return ("exact: the recorded run with the rows' loss contributions set to zero, replayed from a store "
                        "without them, bit-identical to the oracle (a full replay from step 0 on the original store: "
                        "this checks the redaction and the suffix start; both use the same replay engine)" + caveat)
            unproven = self.evidence.get("unproven_steps")
            if unproven:
                from ..trace.proof import ranges

                caveat += (f"; steps {ranges(unproven)} are not proven to be reproduced by the engine (accepted with "
                           "--accept-unproven): it is not VERIFIED")
            if verified is False:
                if self._accepted_unproven:
                    return ("bit-identical to the oracle, but not VERIFIED: the engine is not proven on every step the "
                            "replay and the oracle ran" + caveat)
                if self._identical_but_unproven:
                    return ("exact deletion NOT verified: the states are bit-identical but the replay and oracle "
                            "folders are not proven to be a replay and an oracle of this run and request (see "
                            "evidence.oracle.problems); do not publish it as exact")
                return "exact deletion NOT verified: the replay differs from the oracle; do not publish it as exact"
            return ("exact replay from a store without the rows, not checked against the oracle (oracle=True / "
                    "--oracle checks it bit for bit)" + caveat)
        measured = "the evaluation before/after shows its measured effect" if self.evidence.get("after") else \
            "no evaluation was run (eval_rows=0)"
        return (f"approximate ({self.method}): no proof that the rows' influence is gone (the model may still reveal "
                f"them); {measured}")

    def to_dict(self) -> dict:
        return {"format": RECEIPT_FORMAT, **asdict(self), "guarantee": self.guarantee, "ok": self.ok}

    @property
    def _accepted_unproven(self) -> bool:
        """Bit-identical with provenance holding, not VERIFIED only for steps the user accepted as unproven."""
        oracle = self.evidence.get("oracle") or {}
        return bool(self.evidence.get("unproven_steps")) and bool(oracle.get("identical")) and not oracle.get("problems")

    @property
    def _identical_but_unproven(self) -> bool:
        """Not verified although the states are bit-identical: the folders' provenance failed."""
        return self.evidence.get("verified") is False and bool((self.evidence.get("oracle") or {}).get("identical"))

    @property
    def verdict(self) -> str:
        """The oracle check in a few words (exact deletion): VERIFIED needs bit-identity and provenance."""
        verified = self.evidence.get("verified")
        if verified is None:
            return "not checked against the oracle (oracle=True / --oracle runs it)"
        if verified:
            return "VERIFIED bit-identical to the oracle"
        if self._accepted_unproven:
            from ..trace.proof import ranges

            return (f"bit-identical to the oracle; steps {ranges(self.evidence['unproven_steps'])} of the engine "
                    "unproven (accepted; not verified)")
        if self._identical_but_unproven:
            return "bit-identical to the oracle but NOT VERIFIED (provenance: see evidence.oracle.problems)"
        return "NOT identical to the oracle"

    def summary_rows(self) -> list[tuple[str, str]]:
        """(stage, outcome) rows for the closing table."""
        rows = [("request", f"{self.request['count']} id(s) as keyed tags (key {self.request['key_fingerprint']})")]
        ev = self.evidence
        if self.mode == EXACT and ev.get("pipeline"):
            pc = ev["pipeline_cost"]
            rows.append(("replay cost", f"{pc['total_steps_replayed']} of {pc['pipeline_steps']} pipeline steps "
                                        f"({100 * pc['fraction_replayed']:.0f}%), from stage {pc['first_affected_stage']}"))
            for st in ev["pipeline"]:
                rows.append((f"stage {st['stage']}", (f"replayed {st['steps_replayed']} of {st['total_steps']} steps "
                             f"from step {st['start_step']}" + (f"; {st['oracle']['params_mismatched_elements']} "
                                                               "parameter elements differ from its oracle"
                                                               if st.get("oracle") else ""))
                             if st["replayed"] else f"unchanged: {st['why']}"))
            rows.append(("exact deletion", self.verdict))
        elif self.mode == EXACT:
            c = ev["cost"]
            rows.append(("replay cost", f"from checkpoint step {c['start_checkpoint']}: {c['steps_to_replay']} of "
                                        f"{c['total_steps']} steps ({100 * c['fraction_replayed']:.0f}%), minimum "
                                        f"{c.get('minimum_steps')}"))
            rows.append(("redaction", f"store {ev['redaction']['rows_before']} -> {ev['redaction']['rows_after']} rows; "
                                      f"{ev['redaction']['id_check']}"))
            rows.append(("exact deletion", self.verdict))
        else:
            stop = ev.get("stopped_step")
            rows.append((self.method, f"{ev['steps']} steps in {ev['train_seconds']:.0f} s"
                                      + (f", stopped itself at step {stop}" if stop is not None else "")))
            for name in ("forget", "retain"):
                b, a = ev.get("before", {}).get(name), ev.get("after", {}).get(name)
                if a:
                    rows.append((f"eval {name}", _eval_line(b, a)))
            if ev.get("rouge_l"):
                rows.append(("eval", ev["rouge_l"]))
        if (ev.get("output") or {}).get("kind") == "merged adapter":
            rows.append(("output", f"the replayed adapter merged into its base (model/, published); the adapter in "
                                   f"{ev['output']['adapter']}"))
        rows.append(("state hashes", _state_hashes_line(self.state_hashes)))
        if self.published and self.published.get("error"):
            rows.append(("published", f"FAILED: {self.published['error']}"))
        elif self.published:
            p = self.published
            rows.append(("published", f"{p['repo']} {p['tag']} (commit {p['commit'][:12]})"
                         + ("; it held this model already: nothing pushed, no new tag" if p.get("already_published")
                            else "")))
            rows.append(("hub verify", p["verify_summary"]))
        rows.append(("guarantee", self.guarantee))
        from .remains import still_holding

        return rows + still_holding(self)  # it ends with what still holds the deleted rows, and how to erase it

    def summary_table(self) -> str:
        rows = self.summary_rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _state_hashes_line(h: dict) -> str:
    """The saved model's roots, each under its one name (``hub push`` and ``hub verify`` print the same names), and
    which of them is the replayed state's (as in the run's deletion log)."""
    from ..hub.publish import ROOT_NAMES

    replayed = " (the replayed state's, as in the run's deletion log)"
    parts = []
    for name in ("params_root", "state_dict_root"):
        if h.get(name):
            parts.append(f"{ROOT_NAMES[name]} {h[name][:16]}..." + (replayed if h.get("trace_params_root") == h[name]
                                                                    else ""))
            replayed = "" if h.get("trace_params_root") == h[name] else replayed
    if replayed and h.get("trace_params_root"):  # a merged LoRA output: the replayed adapter+base is another root
        parts.append(f"replayed adapter+base root {h['trace_params_root'][:16]}...{replayed}")
    if h.get("optimizer_root"):
        parts.append(f"optimizer root {h['optimizer_root'][:16]}...")
    return ", ".join(parts)


def _eval_line(before: dict | None, after: dict) -> str:
    parts = []
    for metric in ("answer_loss", "probability", "rouge_l"):
        if after.get(metric) is None:
            continue
        b = (before or {}).get(metric)
        parts.append(f"{metric} {'' if b is None else f'{b:.3f} -> '}{after[metric]:.3f}")
    return f"{after['items']} rows: " + ", ".join(parts)


def forget(model_or_run, ids, output_dir: str | os.PathLike | None = None, *, config: ForgetConfig | None = None,
           tokenizer=None, data_collator=None, log: Callable[[str], None] | None = None,
           **options) -> ForgetReceipt:
    """Honour a deletion request end to end and return its receipt (also written to ``OUTPUT_DIR/receipt.json``).

    Args:
        model_or_run: a recorded run folder (exact deletion) or a model: local folder, ``.gguf`` file or Hub id.
        ids: the ids to forget: a list, or a file (typed JSON Lines ``ids.jsonl``, a JSON list, or one per line).
        output_dir: where the model, the evidence and the receipt go (new or empty).
        config: a :class:`ForgetConfig`; or give its fields as keyword arguments (``method="npo"``, ``repo=...``).
        tokenizer: saved with an exact deletion's model (a recorded run does not hold one); approximate methods load
            the model's own.
        data_collator: exact deletion only: the run's collator, when the trace cannot rebuild it (the standard
            ``transformers`` collators and ``QACollator`` are rebuilt; a run recorded with another one says so).
        log: where progress lines go (default ``print``).

    A run recorded by N processes (DDP or FSDP2) is deleted under a launch of N processes (``torchrun
    --nproc_per_node N -m hf_unlearn.cli forget ...``): every process replays its share, the main process writes the
    store, the model (one ``save_pretrained`` folder) and the receipt and returns it; the others return None.
    """
    if config is None:
        known = {f.name for f in fields(ForgetConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UnlearnError(f"forget() got unknown option(s) {unknown}; the options are {sorted(known)}")
        if output_dir is None:
            raise UnlearnError("forget() needs output_dir= (a new or empty folder)")
        config = ForgetConfig(output_dir=os.fspath(output_dir), **options)
    elif options or output_dir is not None:
        raise UnlearnError("pass either config= or keyword options (and output_dir), not both")
    log = log or (lambda msg: print(msg, flush=True))
    plan = _validate(model_or_run, ids, config, data_collator)  # every check that costs no compute, before any
    if _launched() > 1:  # a run recorded by N processes, under its launch: the others replay, the main one writes
        from ..runtime import init_processes

        plan["processes"] = init_processes(announce=False)
        plan["processes"].wait_for_everyone()  # every process validated before the main one writes
    _before_compute(plan, config)  # every process: the deleting environment is each process's
    if plan.get("processes") is not None and not plan["processes"].is_main_process:
        _exact_peer(plan, config)
        return None
    from ..validation import output_folder

    started = time.perf_counter()
    publish_error = None
    with output_folder(config.output_dir, marker=RECEIPT_FILE, overwrite=config.overwrite,
                       marker_check=_check_earlier_receipt) as out, \
            _library_progress(config.progress):
        if plan.get("pipeline"):
            from .pipeline import run_pipeline

            receipt = run_pipeline(plan, config, out, tokenizer, log)
        elif plan["mode"] == EXACT:
            receipt = _exact(plan, config, out, tokenizer, log)
        else:
            receipt = _approximate(plan, config, out, log)
        if config.repo:
            try:
                receipt.published = _publish(receipt, plan, config, out, log)
            except Exception as e:  # the deletion is done and kept: the receipt says the publish failed, and how to retry
                publish_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                receipt.published = {"repo": config.repo, "error": publish_error, "verify_ok": False}
        receipt.timings["total_s"] = time.perf_counter() - started
        _write_receipt(receipt, plan["ids"], out)
    if publish_error is not None:
        raise UnlearnError(f"the deletion is done and saved in {out} (receipt.json), but publishing to {config.repo} "
                           f"failed: {publish_error}; retry with `hf-unlearn hub push {out / 'model'} --repo "
                           f"{config.repo} --deletion`")
    return receipt


# -- validation ------------------------------------------------------------------------------------------------
def _validate(model_or_run, ids, config: ForgetConfig, data_collator=None) -> dict:
    from ..validation import check_new_output, check_options, check_repo_id, is_trace_run, load_request_ids

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
        from ..validation import check_model_source

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
        from ..presets import check_preset

        check_preset(config.preset)
        method_args = _method_args(spec, config.method_args)
        from ..validation import check_model_source

        check_model_source(source)
        forget_rows, retain_rows = _split_data(config, request)
        plan.update(mode="approximate", spec=spec, method_args=method_args, forget_rows=forget_rows,
                    retain_rows=retain_rows)
    if config.repo:
        _check_output_name(config, request)
        _check_hub_access(config)
        _check_earlier_deletions(config, plan)
    return plan


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
    from ..trace.proof import ProofError, unproven_statement

    if config.accept_unproven:
        raise UnlearnError("--accept-unproven is for one recorded run; a pipeline deletion needs every stage it "
                           "replays proven (hf-unlearn trace prove STAGE_RUN for each)")
    who = "the oracle and the replay" if config.oracle else "the replay"
    for s, run in zip(plan["pipeline_cost"]["stages"], plan["runs"]):
        if not s["replayed"]:
            continue
        lo = 0 if config.oracle else s["start_checkpoint"]
        why = unproven_statement(run.header, run.path, lo, run.kept().total_steps, who)
        if why:
            raise ProofError(f"stage {s['stage']}: {run.path}: {why}; refusing before any compute")


def _refuse_a_run_in_disguise(source: str, config: ForgetConfig, data_collator) -> None:
    """Before anything loads, a source that is not a recorded run given as if it were one: a training output folder
    holding one (``runs/ft`` for ``runs/ft/trace``) with no approximate method named, or a model given options only an
    exact deletion uses (``--oracle`` on a checkpoint ran an approximate method and exited 0)."""
    from ..validation import recorded_run_inside

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
    from ..commands.forget import ALIASES

    given = [f.name for f in fields(ForgetConfig) if str(f.metadata.get("help", "")).startswith("exact:")
             and getattr(config, f.name) != f.default]
    flags = [ALIASES.get(name, ("--" + name.replace("_", "-"),))[0] for name in given]
    return flags + (["data_collator="] if data_collator is not None else [])


def _has_run_parent(source: str) -> bool:
    """A recorded run that starts from another recorded run's output (a pipeline stage; its lineage is replayed)."""
    from ..validation import is_trace_run

    if not is_trace_run(source):
        return False
    try:
        header = json.loads((Path(source) / "header.json").read_text())
    except (OSError, ValueError):
        return False
    return ((header.get("lineage") or {}).get("parent") or {}).get("kind") == "run" if isinstance(header, dict) \
        else False


def check_request(source, ids) -> None:
    """The ids of a request checked against a recorded run, or against every stage of the pipeline a run ends (ids in
    no stage refused, naming them); nothing is computed."""
    if _has_run_parent(os.fspath(source)):
        from .pipeline import open_pipeline, pipeline_cost

        pipeline_cost(open_pipeline([os.fspath(source)]), ids)
    else:
        _validate_run(os.fspath(source), ids)


def _validate_pipeline(sources: list[str], request: list, config: ForgetConfig, data_collator) -> dict:
    from ..validation import is_trace_run
    from .pipeline import validate_pipeline

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


def _check_output_name(config: ForgetConfig, request: list) -> None:
    """Before any compute: an output folder named after the ids (``forget-3600-3601``) is refused when publishing.
    Nothing published carries a local path, but such a name travels with every log line, receipt and copy."""
    from ..hub.leaks import IdScanner

    hits = IdScanner(request).scan_text(Path(config.output_dir).name, "output folder name")
    if hits:
        raise UnlearnError(f"the output folder {Path(config.output_dir).name!r} is named after the ids it deletes "
                           f"({hits[0].what}); choose a name without them (e.g. deletion-0001); nothing was done")


def _deleted_in_source(plan: dict, key: bytes) -> set[str]:
    """Keyed tags (library key) of the ids the source no longer holds: an exact source run's deletion log (when the
    run tags with the library key), or the ``forget_request.json`` of a model folder published by a deletion."""
    from ..keys import key_fingerprint

    tags: set[str] = set()
    if plan["mode"] == EXACT:
        from ..trace.run import read_deletion_log

        run = plan["run"]
        if key_fingerprint(run.key) == key_fingerprint(key):
            tags |= {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
        return tags
    request = Path(plan["source"]) / "forget_request.json"
    if request.is_file():
        try:
            data = json.loads(request.read_text())
        except (OSError, json.JSONDecodeError):
            return tags
        if data.get("key_fingerprint") == key_fingerprint(key):
            tags |= set(data.get("tags") or [])
    return tags


def _source_params_root(plan: dict) -> str | None:
    """The weights root of a model folder given as the source (computed from its safetensors files, not read from
    its manifest), or None for a recorded run, a Hub id or a folder without safetensors weights."""
    from ..hub.publish import hash_safetensors, safetensors_files
    from ..trace.hashing import StateHashes

    source = Path(str(plan.get("source", "")))
    if plan["mode"] == EXACT or not source.is_dir() or not safetensors_files(source):
        return None
    return StateHashes(params=hash_safetensors(source)[0]).params_root


def _published_params_root(config: ForgetConfig, tag: str, cache: str) -> str | None:
    from huggingface_hub import hf_hub_download

    from ..hub.publish import MANIFEST_FILE

    try:
        path = hf_hub_download(config.repo, MANIFEST_FILE, revision=tag, token=config.token,
                               endpoint=config.endpoint, cache_dir=cache)
        return json.loads(Path(path).read_text()).get("params_root")
    except Exception:  # no manifest there: this tag cannot vouch for the source
        return None


def _check_earlier_deletions(config: ForgetConfig, plan: dict) -> None:
    """Before any compute: every deletion already published to ``--repo`` (its ``deletion-NNNN`` tags) must be
    contained in this one (the request's ids plus those the source has already lost), else this push would put
    the earlier deletion's rows back into the published model."""
    import tempfile

    from huggingface_hub import HfApi, hf_hub_download

    from ..hub.cards import forget_request
    from ..hub.publish import DELETION_TAG, FORGET_REQUEST_FILE, hub_error
    from ..keys import load_key

    api = HfApi(endpoint=config.endpoint, token=config.token)
    try:
        refs = api.list_repo_refs(config.repo)
    except Exception as e:  # a repository that does not exist yet has no earlier deletion
        if getattr(getattr(e, "response", None), "status_code", None) == 404 or "404" in str(e):
            return
        raise hub_error(e, f"--repo {config.repo}") from None
    earlier = sorted((t.name for t in refs.tags if DELETION_TAG.match(t.name)), key=lambda n: int(n.split("-")[1]))
    if not earlier:
        return
    key = load_key()
    ours = set(forget_request(plan["ids"], key)["tags"]) | _deleted_in_source(plan, key)
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_earlier_") as cache:
        root = _source_params_root(plan)
        if root is not None:  # the source is one of the published deletions: it and every one before it are inside
            for k in range(len(earlier) - 1, -1, -1):  # (each push checked this against the tags before it)
                if _published_params_root(config, earlier[k], cache) == root:
                    earlier = earlier[k + 1:]
                    break
        for tag in earlier:
            try:
                path = hf_hub_download(config.repo, FORGET_REQUEST_FILE, revision=tag, token=config.token,
                                       endpoint=config.endpoint, cache_dir=cache)
                request = json.loads(Path(path).read_text())
            except Exception as e:
                raise UnlearnError(f"--repo {config.repo}: cannot read {tag}'s {FORGET_REQUEST_FILE} ({e}); without it "
                                   "this deletion cannot be shown to keep the earlier one's rows out") from None
            if request.get("key_fingerprint") != forget_request([], key)["key_fingerprint"]:
                raise UnlearnError(f"--repo {config.repo}: {tag} was published with another id-tagging key "
                                   f"({request.get('key_fingerprint')}); this deletion cannot be shown to include it")
            missing = set(request.get("tags") or []) - ours
            if missing:
                raise UnlearnError(
                    f"--repo {config.repo}: {tag} already published a deletion of {len(missing)} id(s) that this one "
                    f"neither deletes nor starts without, so they would be back in the published model; start from "
                    f"its output (the earlier forget's OUT/replay for a recorded run, or OUT/model), add its ids to "
                    "this request, or serve the requests from one ledger (`hf-unlearn requests`); nothing was done")


def _validate_run(source: str, request: list, oracle: bool = False) -> dict:
    from ..data.ids import check_id_types
    from ..trace.run import open_run
    from ..trace.store import load_store
    from .erasure import check_not_retired

    check_not_retired(source)
    run = open_run(source)
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
    from ..trace.trainers import recorded_trainer

    recorded_trainer(run.header)  # the replay rebuilds the run's trainer (e.g. trl.SFTTrainer): importable here?
    from .outputs import check_output

    check_output(run)  # a LoRA run is published merged: mergeable here?
    return {"run": run, "cost": cost, "hazards": list(run.header.get("hazards", [])),
            "controls": {"status": run.report.summary.get("controls"), "notes": list(run.report.notes)}}


def _run_collator(run, reference: str | None, given):
    """The collator the replay runs with: the one given, else ``None`` (rebuilt from the trace by the replay), which
    is checked here, before any compute, to be rebuildable."""
    if given is not None:
        if not callable(given):
            raise UnlearnError(f"data_collator= must be a callable collator, not a {type(given).__name__}")
        return given
    if reference is not None:
        from ..data.collators import load_collator

        return load_collator(reference)
    spec = run.header.get("collator") or {}
    if not spec.get("rebuildable"):
        why = spec.get("why")
        raise UnlearnError(f"the run's data collator ({spec.get('class', 'unknown')}) cannot be rebuilt from the trace"
                           f"{f' ({why})' if why else ''}; pass it: --collator module:callable (data_collator= from "
                           "Python)")
    return None


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


def parse_method_args(pairs: Iterable[str] | None) -> dict[str, str]:
    """``["alpha=0.2", "k=5"]`` -> ``{"alpha": "0.2", "k": "5"}`` (types are applied per method later)."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UnlearnError(f"method option {pair!r} must be KEY=VALUE, e.g. alpha=0.2")
        out[key.strip()] = value.strip()
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


def _check_hub_access(config: ForgetConfig) -> None:
    """Before any compute: the Hub answers and takes the token (a publish that fails after training wastes it)."""
    from huggingface_hub import HfApi, constants

    from ..hub.publish import hub_error
    from ..validation import hub_unreachable

    endpoint = config.endpoint or constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        raise UnlearnError("--repo publishes to the Hub, but HF_HUB_OFFLINE=1 keeps it off; unset it (or drop --repo)")
    problem = hub_unreachable(endpoint)
    if problem is not None:
        raise UnlearnError(f"--repo: the Hub at {endpoint} cannot be reached ({problem}); set HF_ENDPOINT to a "
                           "reachable Hub (e.g. `hf-unlearn hub serve`) or drop --repo")
    try:
        HfApi(endpoint=endpoint, token=config.token).whoami()
    except Exception as e:
        raise hub_error(e, f"--repo {config.repo}") from None


# -- exact deletion --------------------------------------------------------------------------------------------
def with_replay_progress(trainer_cls, desc: str, enabled: bool):
    """A replay trainer class that advances a progress bar per replayed optimizer step (segment)."""
    from tqdm.auto import tqdm

    class WithProgress(trainer_cls):
        def train(self, *args, **kwargs):
            total = sum(1 for seg in self.run.segments() if seg[0].step >= self.start_step)
            with tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False) as self._bar:
                return super().train(*args, **kwargs)

        def _run_segment(self, model, seg):
            taken = super()._run_segment(model, seg)
            self._bar.update(1)
            return taken

    WithProgress.__name__ = trainer_cls.__name__
    return WithProgress


def _exact(plan: dict, config: ForgetConfig, out: Path, tokenizer, log) -> ForgetReceipt:
    from ..hub.mixin import write_model_card
    from ..hub.publish import hashed_files
    from ..trace.fidelity import fidelity_statement
    from ..trace.proof import proof_statement
    from ..trace.replay import OracleReplayTrainer, RedactedReplayTrainer, never_trained_tags
    from ..trace.stack import stack_statement
    from ..trace.store import redact_store
    from ..trace.tags import tag
    from ..trace.trainers import PROCESSING_CLASS_DIR, load_processing_class
    from ..trace.verification import verify
    from ..validation import TOKENIZER_FILES

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
    never_trained = never_trained_tags(run)  # rows the trainer dropped before training: absent from the store
    redaction = redact_store(run.store_path, ids, out / "store", run.key, id_column=run.id_column,
                             already_deleted=[i for i in ids if tag(run.key, i) in never_trained])
    timings["redact_s"] = time.perf_counter() - t
    if plan.get("processes") is not None:
        plan["processes"].wait_for_everyone()  # the other processes replay from the redacted store from here
    log(f"redacted store: {redaction['rows_before']} -> {redaction['rows_after']} rows; "
        f"{redaction['checks']['id_column_scanned']}")
    t = time.perf_counter()
    replay = with_replay_progress(RedactedReplayTrainer, "replay (redacted store)", config.progress)(
        run, out / "store", ids, out / "replay", data_collator=plan["data_collator"])
    final = replay.train()
    timings["replay_s"] = time.perf_counter() - t
    stats = replay.replay_stats
    log(f"replayed {stats['segments_replayed']} of {stats['total_steps']} steps from step {stats['start_step']} "
        f"in {timings['replay_s']:.0f} s")
    report = None
    if config.oracle:
        t = time.perf_counter()
        with_replay_progress(OracleReplayTrainer, "oracle (full replay)", config.progress)(
            run, ids, out_dir=out / "oracle", data_collator=plan["data_collator"]).train()
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
        from .outputs import save_consolidated_output

        replayed = save_consolidated_output(run, final, out / "replay", model_dir)  # a LoRA run's merged too
    else:  # a LoRA run: the adapter merged into its base (what is published), the adapter itself kept beside it
        from .outputs import save_output

        replayed = save_output(replay, out / "replay", model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    elif not any((model_dir / f).is_file() for f in TOKENIZER_FILES):  # the replay may have saved the run's own
        kept = run.path / "collator"
        where = (f"the run keeps its collator's tokenizer in {kept}: pass --tokenizer {kept}" if
                 any((kept / f).is_file() for f in TOKENIZER_FILES) else "pass --tokenizer")
        log(f"note: no tokenizer given, so the model folder holds none; {where} (tokenizer= from Python) to save it "
            "with the model")
    saved_files = hashed_files(model_dir)  # config, tokenizer, ... as saved: the receipt checks them
    card_info = replay.unlearning_card_info()
    if card_info["extra"].get("exact_deletion"):
        from .outputs import card_fields

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
        "unproven_steps": plan.get("unproven_steps", []),  # accepted with --accept-unproven: never VERIFIED
        "environment_probe": plan.get("environment_probe"),  # this process re-ran recorded steps with no deletion
    }
    log(f"fidelity: {evidence['fidelity']}")
    log(f"numeric stack: {evidence['numeric_stack']}")
    from .preference_terms import preference_terms

    if preference_terms([run]):  # what a DPO deletion's counterfactual keeps (the receipt's guarantee line)
        evidence["preference"] = preference_terms([run])
    if replayed.get("merged_adapter"):
        evidence["output"] = {"kind": "merged adapter", "adapter": replayed["adapter_dir"],
                              "replayed_params_root": exact.get("replayed_params_root")}
        log(f"output: the replayed adapter merged into its base in {model_dir} (what is published); the adapter "
            f"itself in {replayed['adapter_dir']}")
    if run.header.get("kept_model"):  # load_best_model_at_end: the output is the counterfactual of the kept model
        evidence["kept_model"] = run.header["kept_model"]
        log(f"kept model: {run.header['kept_model']['why']}")
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


def _launched() -> int:
    """The processes of this launch (``WORLD_SIZE``, 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _exact_peer(plan: dict, config: ForgetConfig) -> None:
    """A process other than the main one of a multi-process exact deletion: it replays its share of the run (and of
    the oracle) with the main process, which writes everything (store, model, card, receipt)."""
    from ..trace.replay import OracleReplayTrainer, RedactedReplayTrainer

    out, run, ids = Path(config.output_dir), plan["run"], plan["ids"]
    plan["processes"].wait_for_everyone()  # the main process redacted the store
    RedactedReplayTrainer(run, out / "store", ids, out / "replay", data_collator=plan["data_collator"]).train()
    if config.oracle:
        OracleReplayTrainer(run, ids, out_dir=out / "oracle", data_collator=plan["data_collator"]).train()


# -- approximate unlearning ------------------------------------------------------------------------------------
def _preset_values(config: ForgetConfig, spec, n_forget_rows: int) -> dict:
    """The budget keywords: the options ``config`` sets (not None) over ``config.preset``'s values over the command's
    own budget (:data:`hf_unlearn.presets.COMMAND_BUDGET`)."""
    from ..presets import COMMAND_BUDGET, training_preset

    own = {"num_train_epochs": "num_train_epochs", "learning_rate": "learning_rate",
           "per_device_train_batch_size": "batch_size", "max_length": "max_length"}
    given = {key: getattr(config, name) for key, name in own.items() if getattr(config, name) is not None}
    values = {**COMMAND_BUDGET, **training_preset(config.preset, spec.name, n_forget_rows, fixed=spec.preset,
                                                  overrides=given)}
    values["per_device_eval_batch_size"] = values["per_device_train_batch_size"]
    return values


def _approximate(plan: dict, config: ForgetConfig, out: Path, log) -> ForgetReceipt:
    from ..eval.qa import evaluate_qa
    from ..hub.mixin import write_model_card
    from ..models import load_model, load_tokenizer
    from ..utils import has_cuda

    spec, timings = plan["spec"], {}
    forget_rows, retain_rows = plan["forget_rows"], plan["retain_rows"]
    model_dir = out / "model"
    try:
        args = spec.make_config(**{
            **_preset_values(config, spec, len(forget_rows)),
            **dict(output_dir=str(model_dir), max_steps=config.max_steps, seed=config.seed, save_strategy="no",
                   report_to=[], logging_steps=10, disable_tqdm=not config.progress, dataloader_pin_memory=has_cuda(),
                   id_column=config.id_column), **plan["method_args"]})
    except (TypeError, ValueError) as e:
        raise UnlearnError(f"{spec.name}: {str(e).splitlines()[0]}") from None
    t = time.perf_counter()
    tokenizer = load_tokenizer(plan["source"])
    model = load_model(plan["source"])
    timings["load_s"] = time.perf_counter() - t
    peft_config = None
    if config.lora:
        from peft import LoraConfig
        from transformers.pytorch_utils import Conv1D

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM",
                                 # GPT-2's Conv1D stores weights transposed (peft warns and flips it otherwise)
                                 fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()))
    sets = None
    if config.eval_rows:
        sets = {"forget": forget_rows.select(range(min(config.eval_rows, len(forget_rows)))).to_list(),
                "retain": retain_rows.select(range(min(config.eval_rows, len(retain_rows)))).to_list()}
    before = after = {}
    from ..data.prompts import prompt_format

    eval_kw = dict(max_length=args.max_length, max_new_tokens=config.max_new_tokens, progress=config.progress,
                   use_chat_template=prompt_format(args.prompt_format, tokenizer),  # the format it trains with
                   attention_mask=args.attention_mask)
    from ..eval.qa import rouge_missing

    skipped = rouge_missing() if sets else None  # said once, and kept in the receipt
    if skipped:
        log(skipped)
    if sets:
        t = time.perf_counter()
        before = evaluate_qa(model, tokenizer, sets, **eval_kw)
        timings["eval_before_s"] = time.perf_counter() - t
    trainer = spec.trainer_class(model=model, args=args, forget_dataset=forget_rows, retain_dataset=retain_rows,
                                 processing_class=tokenizer, peft_config=peft_config)
    log(f"{spec.name} on {len(forget_rows)} forget row(s) of {plan['source']} ({len(retain_rows)} retained rows as "
        f"the retain set{', LoRA' if config.lora else ''})")
    t = time.perf_counter()
    trainer.train()
    timings["train_s"] = time.perf_counter() - t
    unlearned = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_peft:
        unlearned = unlearned.merge_and_unload()
    if sets:
        t = time.perf_counter()
        after = evaluate_qa(unlearned, tokenizer, sets, **eval_kw)
        timings["eval_after_s"] = time.perf_counter() - t
    unlearned.save_pretrained(model_dir)
    weights_follow_umask(model_dir)
    tokenizer.save_pretrained(model_dir)
    card_info = trainer.unlearning_card_info()
    extra = card_info.setdefault("extra", {})
    if after:
        card_info["evaluation"] = {**(card_info.get("evaluation") or {}),
                                   **{f"{s}_{m}": v for s, r in after.items() for m, v in r.items()
                                      if m != "items" and v is not None}}
        extra["evaluation_before"] = {f"{s}_{m}": v for s, r in before.items() for m, v in r.items()
                                      if m != "items" and v is not None}
    write_model_card(model_dir, card_info, base_model=config.base_model or _hub_id(plan["source"]),
                     datasets=config.datasets, not_ids=_own_settings(card_info))
    evidence = {"method": spec.name, "hyperparameters": card_info.get("hyperparameters", {}),
                "steps": trainer.state.global_step, "train_seconds": timings["train_s"],
                "stopped_step": extra.get("stopped_step"), "stopped_by_rule": extra.get("stopped_by_rule"),
                "forget_rows": len(forget_rows), "retain_rows": len(retain_rows), "before": before, "after": after,
                **({"rouge_l": skipped} if skipped else {})}
    return _receipt(plan, config, out, model_dir, evidence, timings)


def _hub_id(source: str) -> str | None:
    from ..validation import looks_like_hub_id

    return source if looks_like_hub_id(source) and not os.path.exists(source) else None


# -- receipt and publishing ------------------------------------------------------------------------------------
def _receipt(plan, config, out: Path, model_dir: Path, evidence, timings, *, optimizer_root: str = "",
             trace_params_root: str | None = None, saved_files: dict | None = None,
             published_root: str | None = None) -> ForgetReceipt:
    """``state_hashes``: ``params_root`` is the root of the saved safetensors (what the Hub manifest and ``hub verify``
    check; tied duplicates once); for an exact deletion ``trace_params_root`` and ``optimizer_root`` are the replayed
    state's roots as the trace hashes it (the full state dict), the ones in the run's deletion log."""
    from ..hub.cards import forget_request
    from ..hub.publish import build_manifest
    from ..keys import load_key
    from ..version import __version__

    manifest = build_manifest(model_dir, optimizer_root=optimizer_root)
    saved_root = published_root or trace_params_root  # a LoRA run's: the merged weights, not the replayed adapter's
    if plan["mode"] == EXACT and saved_root not in (manifest["params_root"], manifest["state_dict_root"]):
        # the oracle check compared the replay's checkpoints; the receipt is about the saved folder: same state?
        raise UnlearnError(f"internal check: the weights saved in {model_dir} (root {manifest['params_root'][:16]}...) "
                           f"are not the replayed state (root {str(saved_root)[:16]}...) the evidence is about; "
                           "nothing was kept")
    if saved_files is not None:
        from ..hub.publish import CARD_INFO_FILE

        now = {k: v for k, v in manifest["file_hashes"].items() if k != CARD_INFO_FILE}  # the card's info file is new
        changed = sorted(k for k in now.keys() | saved_files.keys() if now.get(k) != saved_files.get(k))
        if changed:
            raise UnlearnError(f"internal check: {', '.join(changed)} in {model_dir} changed after the replayed model "
                               "was saved; the evidence would not be about this folder; nothing was kept")
    return ForgetReceipt(
        mode=plan["mode"], method=plan["method"], source=plan["source"], output_dir=str(out),
        request=forget_request(plan["ids"], load_key()), evidence=evidence,
        state_hashes={"params_root": manifest["params_root"], "state_dict_root": manifest["state_dict_root"],
                      "optimizer_root": optimizer_root or None,
                      "trace_params_root": trace_params_root, "root": manifest["root"],
                      "manifest_tensors": len(manifest["params"])},
        model_dir=str(model_dir), timings=timings, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        versions={"hf_unlearn": __version__, **_versions()},
    )


def _versions() -> dict:
    from ..hub.cards import library_versions

    return {k: v for k, v in library_versions().items() if k in ("torch", "transformers")}


def _publish(receipt: ForgetReceipt, plan: dict, config: ForgetConfig, out: Path, log) -> dict:
    model_dir = Path(receipt.model_dir)
    t = time.perf_counter()
    result, report = _push_and_verify(model_dir, plan, config, out)
    receipt.timings["publish_s"] = time.perf_counter() - t
    log(f"{'already published (nothing pushed, no new tag):' if result.already_published else 'published'} "
        f"{result.repo_id} {result.tag} (commit {result.commit[:12]}, {len(result.files)} files)")
    ok, summary = _published_is_this_deletion(report, result, receipt.state_hashes["params_root"])
    log(f"hub verify {config.repo}@{result.tag}: {summary}")
    return {"repo": result.repo_id, "url": result.url, "commit": result.commit, "tag": result.tag,
            "files": result.files, "params_root": result.params_root, "verify_ok": ok,
            "verify_summary": summary, "verify_checked_tensors": report.checked,
            "verified_params_root": report.params_root, "verified_commit": report.commit,
            "kept_local": sorted(result.skipped_provenance), "already_published": result.already_published}


def _published_is_this_deletion(report, result, params_root: str) -> tuple[bool, str]:
    """``hub verify`` proves a revision matches its own manifest and card; the receipt needs more: that the
    revision downloaded is the commit just pushed and holds *this* model (its root is the receipt's)."""
    if not report.ok:
        return False, report.summary().splitlines()[0]
    problems = []
    if report.params_root != params_root:
        from ..hub.publish import ROOT_NAMES

        problems.append(f"the downloaded {result.tag} has {ROOT_NAMES['params_root']} {report.params_root[:16]}..., "
                        f"not this deletion's {params_root[:16]}...")
    if report.commit and report.commit != result.commit:
        problems.append(f"{result.tag} resolved to commit {report.commit[:12]}, not the pushed {result.commit[:12]}")
    if problems:
        return False, "FAILED: self-consistent, but not the model of this receipt: " + "; ".join(problems)
    return True, report.summary().splitlines()[0]


@contextlib.contextmanager
def _library_progress(enabled: bool):
    """The libraries' own bars (Hub transfers, datasets' "Saving the dataset", transformers' "Writing model shards")
    only when progress is wanted; their earlier setting is restored afterwards."""
    if enabled:
        yield
        return
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    before = (are_progress_bars_disabled(), datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled())
    disable_progress_bars()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not before[0]:
            enable_progress_bars()
        if before[1]:
            datasets.enable_progress_bars()
        if before[2]:
            hf_logging.enable_progress_bar()


def _push_and_verify(model_dir: Path, plan: dict, config: ForgetConfig, out: Path):
    import tempfile

    from ..hub.publish import load_card_info, push_unlearned
    from ..hub.verify import verify_on_hub

    card_info = load_card_info(model_dir)
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_push_") as tmp:
        trace_dir = _provenance_view(Path(plan.get("last_replay") or out / "replay"), Path(tmp) / "trace") \
            if plan["mode"] == EXACT else None
        result = push_unlearned(model_dir, config.repo, card_info=card_info, deletion=True,
                                private=config.private or None, token=config.token, endpoint=config.endpoint,
                                base_model=config.base_model, datasets=config.datasets, trace_dir=trace_dir,
                                not_ids=_own_settings(card_info))
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_verify_") as cache:  # a fresh download, not a cached copy
        report = verify_on_hub(config.repo, result.tag, token=config.token, endpoint=config.endpoint,
                               cache_dir=cache, expect_root=result.state_dict_root or result.params_root,
                               expect_commit=result.commit, expect_files_root=result.files_root or None,
                               expect_card_sha256=result.card_sha256 or None)
        # anchored: weights, config/tokenizer files, card and commit checked against the push's own record
    return result, report


# card fields forget() fills from its own options and counts: a number there equal to a forget id is a setting or a
# count, not the id (the publisher's id scanner would refuse it otherwise, e.g. 20 epochs and forget id 20)
OWN_SETTINGS = ("num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                "max_length", "seed")
OWN_COUNTS = ("num_forget", "num_retain", "num_confirmation_rows")


def _own_settings(card_info: dict) -> dict:
    """``not_ids`` for the publisher: the whole-number settings and counts above, as the card holds them."""
    hyper, extra = card_info.get("hyperparameters") or {}, card_info.get("extra") or {}
    values = {**{f"hyperparameters.{k}": hyper.get(k) for k in OWN_SETTINGS},
              **{f"extra.{k}": extra.get(k) for k in OWN_COUNTS}}
    out = {path: int(v) for path, v in values.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()}
    # its own evaluation before/after: a ROUGE-L of 0.0 or a probability of 1.0 is not forget id 0 or 1
    from ..hub.leaks import own_numbers

    out.update(own_numbers(card_info.get("evaluation") or {}, "evaluation"))
    out.update(own_numbers(extra.get("evaluation_before") or {}, "extra.evaluation_before"))
    return out  # the trainer declares the rest of its own numbers (MASC: every number its stop_reason quotes)


PROVENANCE_FILES = ("header.json", "plan.bin", "plan.jsonl", "wal.bin", "manifest.bin", "provenance.bin", "deletion_log.jsonl",
                    "verification.json")


def _provenance_view(run: Path, dest: Path) -> Path:
    """The replayed run's publishable files only (an allowlist): never ``private/`` (key, store), checkpoints or
    the model copy, whatever the publisher's own filter would let through."""
    import shutil

    dest.mkdir(parents=True)
    for name in PROVENANCE_FILES:
        for f in (run / name, run / f"{name}.sha256"):
            if f.is_file():
                shutil.copy2(f, dest / f.name)
    return dest


def _write_receipt(receipt: ForgetReceipt, ids: list, out: Path) -> None:
    """Write ``receipt.json`` atomically, after checking it carries no raw id (it is built from tags only)."""
    from ..utils import atomic_write_text

    text = json.dumps(receipt.to_dict(), indent=1, default=str)
    leaked = [i for i in ids if isinstance(i, str) and json.dumps(i) in text]
    if leaked:  # a string id quoted anywhere in the receipt: refuse (numbers are checked by the tests' fuzzing)
        raise UnlearnError(f"internal check: the receipt would contain raw id {leaked[0]!r}; nothing was written")
    atomic_write_text(out / RECEIPT_FILE, text + "\n")


def _check_earlier_receipt(marker: Path) -> None:
    """--overwrite replaces an earlier output of forget, not a folder that merely holds a file named receipt.json."""
    try:
        load_receipt(marker)
    except UnlearnError:
        raise UnlearnError(f"--overwrite replaces only an earlier output of forget, and {marker} is not a forget "
                           "receipt; choose a new folder") from None


def load_receipt(path: str | os.PathLike) -> dict:
    """Read a ``receipt.json`` (or the one inside an output folder)."""
    p = Path(path)
    p = p / RECEIPT_FILE if p.is_dir() else p
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UnlearnError(f"cannot read the receipt {p}: {e}") from None
    if data.get("format") != RECEIPT_FORMAT:
        raise UnlearnError(f"{p} is not an hf_unlearn forget receipt")
    return data
