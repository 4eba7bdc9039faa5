"""The receipt of a :func:`~hf_unlearn.deletion.forget` call: :class:`ForgetReceipt` (what was done, its guarantee
and the closing summary table), built from the saved model's hashes, checked to hold no raw id and written atomically
as ``OUT/receipt.json``; :func:`load_receipt` reads one back.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from ..keys import load_key
from ..utils import atomic_write_text
from ..version import __version__
from .config import EXACT, RECEIPT_FILE, RECEIPT_FORMAT
from .preference_terms import preference_clause
from .remains import still_holding

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


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
            caveat = preference_clause(self.evidence.get("preference"), bool(self.evidence.get("pipeline"))) + caveat
            never = (self.evidence.get("cost") or {}).get("never_trained")
            if never:  # rows the trainer dropped, or rows of the store the plan never reached (max_steps < an epoch)
                caveat = (f"; {never} of the ids were never trained on (in the store, never in the recorded plan): "
                          "removed from the store, nothing replayed for them") + caveat
            if self.evidence.get("oracle_dummies"):  # the oracle could not train them as the rows without weight
                caveat = (f"; the oracle trained {self.evidence['oracle_dummies']} deleted row(s) or document(s) as "
                          "dummies (packed documents, or labels the collator builds from tokens), so for them it does "
                          "not show the loss ignores their tokens") + caveat
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
                from ..trace.proven import ranges, unproven_starts_clause

                caveat += (f"; steps {ranges(unproven)} are not proven to be reproduced by the engine"
                           f"{unproven_starts_clause(self.evidence.get('unproven_starts'))} (accepted with "
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
            from ..trace.proven import ranges, unproven_starts_clause

            return (f"bit-identical to the oracle; steps {ranges(self.evidence['unproven_steps'])} of the engine "
                    f"unproven{unproven_starts_clause(self.evidence.get('unproven_starts'))} (accepted; not verified)")
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
            dtype = ev["output"].get("base_dtype")
            rows.append(("output", f"the replayed adapter merged into its base (model/, published); the adapter in "
                                   f"{ev['output']['adapter']}" + (f" (its base loads in {dtype} to merge to model/)"
                                                                   if dtype else "")))
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


def _receipt(plan, config, out: Path, model_dir: Path, evidence, timings, *, optimizer_root: str = "",
             trace_params_root: str | None = None, saved_files: dict | None = None,
             published_root: str | None = None) -> ForgetReceipt:
    """``state_hashes``: ``params_root`` is the root of the saved safetensors (what the Hub manifest and ``hub verify``
    check; tied duplicates once); for an exact deletion ``trace_params_root`` and ``optimizer_root`` are the replayed
    state's roots as the trace hashes it (the full state dict), the ones in the run's deletion log."""
    from ..hub.cards import forget_request
    from ..hub.publish import build_manifest

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


def _write_receipt(receipt: ForgetReceipt, ids: list, out: Path) -> None:
    """Write ``receipt.json`` atomically, after checking it carries no raw id (it is built from tags only)."""
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
