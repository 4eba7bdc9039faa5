"""Serving the requests of a ledger: exact deletion in batches, an approximate hot path, a planner and a policy.

* :func:`serve_exact` takes every pending request, deletes their union with one :func:`forget` call on the current
  exact run (the recorded run, or the last batch's replay: a run without every row deleted so far), so one
  redaction and one suffix replay from the checkpoint before the earliest affected step serve them all. It writes
  a signed receipt per request (naming the batch and its own tags) and a batch receipt. The batch's request set is
  fixed by its ``batch_start`` record: a request added meanwhile waits for the next batch, and a batch cut off
  (kill -9) is redone from scratch by the next serve, with the same requests, and recorded once.
* :func:`serve_approximate` runs a registered approximate method (MASC by default) on the model served now for
  the requests nothing has served yet, and writes provisional receipts that say they will be superseded.
* :func:`plan` prices the pending set with ``replay_cost``; :func:`serve_due` applies a :class:`Policy`.

Only one serve runs at a time per ledger (a second one says so and does nothing: safe from cron).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import UnlearnError
from ..keys import key_fingerprint
from ..utils import atomic_write_bytes
from .config import EXACT, RECEIPT_FILE, ForgetConfig
from .erasure import purge
from .forget_receipt import ForgetReceipt, _write_receipt, load_receipt
from .forgetting import forget
from .journal import RequestJournal, serving
from .journal import ServeBusy as ServeBusy  # its import path for the commands
from .pipeline import open_pipeline, pipeline_cost, stage_ids
from .publishing import _publish, _published_params_root
from .receipts import (
    BATCH_RECEIPT_FORMAT,
    REQUEST_RECEIPT_FORMAT,
    sign_receipt,
    write_bundle,
    write_missing_bundles,
    write_receipt,
)
from .records import APPROXIMATE, PENDING, iso, parse_time, unfinished_purge, utc_now
from .runs import _has_run_parent

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

RECEIPTS_DIR = "receipts"
CARD_INFO_DIR = ("private", "card_info")  # each served model's unlearning_info.json (raw forget ids), owner-only


def _union(ledger: RequestJournal, request_ids: list[str]) -> list:
    ids = ledger.private_ids(request_ids)
    return list(dict.fromkeys(i for rid in request_ids for i in ids[rid]))


def _rel(ledger: RequestJournal, path: Path) -> str:
    return os.path.relpath(Path(path).resolve(), ledger.path.resolve())


def _fresh(folder: Path) -> Path:
    """An output folder of an interrupted attempt (no ledger record points at it) is removed before the redo."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


def _request_part(ledger: RequestJournal, req) -> dict:
    return {"id": req.id, "tags": req.tags, "count": len(req.tags), "received": req.received,
            "deadline": req.deadline, "ref_tag": req.ref_tag, "key_fingerprint": key_fingerprint(ledger.tag_key)}


def _ref(record: dict) -> dict:
    return {"seq": record["seq"], "sha256": record["sha256"]}


def _published(receipt) -> dict | None:
    p = receipt.published
    if not p:
        return None
    return {k: p.get(k) for k in ("repo", "tag", "commit", "verify_ok", "verify_summary", "error") if k in p}


@dataclass
class BatchResult:
    """What one serve did: the batch (or provisional run) name, its requests, receipts and the forget receipt."""

    name: str
    kind: str
    requests: list[str]
    receipts: dict[str, Path]
    batch_receipt: Path | None
    forget_receipt: object
    resumed: bool = False
    publish_error: str | None = None


# -- exact --------------------------------------------------------------------------------------------------------
def serve_exact(ledger: RequestJournal, *, now=None, log=None, tokenizer=None, data_collator=None,
                **options) -> BatchResult | None:
    """One exact batch over every pending request (None when nothing is pending). ``options`` are
    :class:`~hf_unlearn.deletion.ForgetConfig` fields for the exact path: ``oracle``, ``tokenizer_path``,
    ``collator``, ``repo`` (and the Hub options), ``progress``."""
    log = log or (lambda m: print(m, flush=True))
    now = parse_time(now, "--now")
    with serving(ledger):
        write_missing_bundles(ledger, log)  # a serve killed after its batch_done (or an add after its record)
        with ledger.lock():
            start = ledger.unfinished_batch()
            resumed = start is not None
            if start is None:
                pending = ledger.pending()
                if not pending:
                    return None
                name = f"batch-{1 + sum(r['type'] == 'batch_start' for r in ledger.records()):04d}"
                for used in (ledger.path / "batches" / name, ledger.path / RECEIPTS_DIR / f"{name}.json"):
                    if used.exists():  # a batch folder is never reused, a receipt never overwritten
                        raise UnlearnError(f"the next batch would be {name}, but {_rel(ledger, used)} exists: the "
                                           "ledger was rolled back or replaced; restore the newest ledger; nothing "
                                           "was done")
                start = ledger.append("batch_start", batch=name, requests=[r.id for r in pending],
                                      run=_rel(ledger, ledger.current_run()), time=iso(now))
        name, request_ids = start["batch"], start["requests"]
        if resumed:
            log(f"{name} was interrupted: serving it again with the same {len(request_ids)} request(s)")
        out = ledger.path / "batches" / name
        published = _published_attempt(out) if resumed and options.get("repo") else None
        if published is None:
            _fresh(out)
        run = Path(os.path.normpath(ledger.path / start["run"]))
        ids = _still_present(run, _union(ledger, request_ids))
        log(f"{name}: exact deletion of {len(ids)} id(s) for {len(request_ids)} request(s) "
            f"({', '.join(request_ids)}) from {run}")
        publish_error = None
        try:
            if published is not None:  # killed after its push and before batch_done: record it, never push again
                log(f"{name}: the interrupted attempt finished and published {published.published.get('tag')}; "
                    "recording it")
                receipt = published
            elif resumed and options.get("repo"):  # the killed attempt may have pushed before its receipt
                receipt = forget(run, ids, out, tokenizer=tokenizer, data_collator=data_collator, log=log,
                                 method="exact", **{**options, "repo": None})
                publish_error = _publish_once(receipt, ids, out, options, log)
            else:
                receipt = forget(run, ids, out, tokenizer=tokenizer, data_collator=data_collator, log=log,
                                 method="exact", **options)
        except UnlearnError as e:
            if not (out / RECEIPT_FILE).is_file() or not options.get("repo"):
                raise UnlearnError(f"{name} failed: {e}; it stays recorded as started, and the next `requests "
                                   "serve --exact` runs it again") from None
            publish_error = str(e)  # the deletion is done and saved: record it, then report the failed push
            receipt = _reload_forget_receipt(out)
        _keep_card_info_private(ledger, out / "model", name)
        result = _record_batch(ledger, start, receipt, out, now)
    result.resumed, result.publish_error = resumed, publish_error
    if publish_error:
        raise UnlearnError(f"{name} is done and recorded (receipts in {ledger.path / RECEIPTS_DIR}); {publish_error}")
    return result


def _published_attempt(out: Path):
    """The forget receipt an interrupted attempt of this batch left, when it finished and published (and its model is
    the one the receipt hashes); else None (the batch is redone)."""
    from ..hub.publish import build_manifest

    if not (out / RECEIPT_FILE).is_file():
        return None
    try:
        receipt = _reload_forget_receipt(out)
        p = receipt.published or {}
        if not (p.get("tag") and not p.get("error")):
            return None
        return receipt if build_manifest(out / "model")["params_root"] == receipt.state_hashes["params_root"] else None
    except (UnlearnError, OSError, ValueError, KeyError, TypeError):
        return None


def _publish_once(receipt, ids: list, out: Path, options: dict, log) -> str | None:
    """Publish a redone batch unless an interrupted attempt already did: a ``deletion-NNNN`` tag of the repo whose
    weights root is this model's (the replay is bit-identical) is adopted and verified again, not pushed twice.
    Returns the publish error (the deletion stays done), or None."""
    import tempfile

    from huggingface_hub import HfApi

    from ..hub.publish import DELETION_TAG
    from ..hub.verify import verify_on_hub

    config = ForgetConfig(output_dir=os.fspath(out), method="exact",
                          **{k: v for k, v in options.items() if k in {f.name for f in fields(ForgetConfig)}})
    root = receipt.state_hashes["params_root"]
    try:
        refs = HfApi(endpoint=config.endpoint, token=config.token).list_repo_refs(config.repo)
        tags = sorted((t.name for t in refs.tags if DELETION_TAG.match(t.name)), key=lambda n: int(n.split("-")[1]))
    except Exception:  # no repository yet: nothing was pushed
        tags = []
    error = None
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_adopt_") as cache:
        adopted = next((t for t in reversed(tags) if _published_params_root(config, t, cache) == root), None)
        try:
            if adopted is not None:
                report = verify_on_hub(config.repo, adopted, token=config.token, endpoint=config.endpoint,
                                       cache_dir=cache, expect_root=root)
                ok = report.ok and report.params_root == root
                log(f"{config.repo}@{adopted} already holds this batch's model (an interrupted attempt pushed it): "
                    "not pushed again")
                receipt.published = {"repo": config.repo, "tag": adopted, "commit": report.commit, "verify_ok": ok,
                                     "verify_summary": report.summary().splitlines()[0], "adopted": True}
            else:
                receipt.published = _publish(receipt, {"mode": EXACT, "last_replay": None}, config, out, log)
        except Exception as e:
            error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            receipt.published = {"repo": config.repo, "error": error, "verify_ok": False}
    _write_receipt(receipt, ids, out)
    return None if error is None else (f"publishing to {config.repo} failed: {error}; retry with `hf-unlearn hub "
                                       f"push {out / 'model'} --repo {config.repo} --deletion`")


def _keep_card_info_private(ledger: RequestJournal, model: Path, name: str) -> None:
    """Move the model folder's ``unlearning_info.json`` (the card's facts, with the raw forget ids the publisher
    scans for) into the ledger's owner-only ``private/card_info/NAME.json``: no raw id outside ``private/``. Publish
    later with ``hf-unlearn hub push MODEL --card-info LEDGER/private/card_info/NAME.json``."""
    from ..hub.publish import CARD_INFO_FILE

    source = model / CARD_INFO_FILE
    if not source.is_file():
        return
    folder = ledger.path.joinpath(*CARD_INFO_DIR)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder.parent, 0o700)
    os.chmod(folder, 0o700)
    atomic_write_bytes(folder / f"{name}.json", source.read_bytes(), private=True)
    source.unlink()


def _still_present(run: Path, ids: list) -> list:
    """The ids an earlier batch has not deleted yet (a request may repeat an id that is gone already); all of them
    when every one is gone (forget then records a deletion that replays nothing)."""
    from ..trace.replay import already_deleted
    from ..trace.run import open_run

    if _has_run_parent(os.fspath(run)):  # a pipeline's last run: an id is gone when every stage holding it deleted it
        present = set()
        for stage in open_pipeline([run]):
            held = stage_ids(stage, ids)
            gone = set(already_deleted(stage, held))
            present |= {i for i in held if i not in gone}
        return [i for i in ids if i in present] or ids
    gone = set(already_deleted(open_run(run, check_checkpoints=False), ids))
    return [i for i in ids if i not in gone] or ids


def _reload_forget_receipt(out: Path):
    data = load_receipt(out)
    names = {f.name for f in fields(ForgetReceipt)}
    return ForgetReceipt(**{k: v for k, v in data.items() if k in names})


def _record_batch(ledger: RequestJournal, start: dict, receipt, out: Path, now) -> BatchResult:
    name, request_ids = start["batch"], start["requests"]
    opening = ledger.records()[0]
    by_id = {r.id: r for r in ledger.requests()}
    folder = ledger.path / RECEIPTS_DIR
    common = {"ledger": {"id": opening["ledger"], "run_id": opening["run_id"]}, "kind": "exact",
              "state_hashes": receipt.state_hashes, "verified": receipt.evidence.get("verified"),
              "model": _rel(ledger, out / "model"), "published": _published(receipt), "created": iso(now)}
    forget_file = out / RECEIPT_FILE
    import hashlib

    batch_body = {**common, "format": BATCH_RECEIPT_FORMAT, "ledger_records": {"batch_start": _ref(start)},
                  "batch": {"name": name, "requests": request_ids,
                            "tags": sorted({t for rid in request_ids for t in by_id[rid].tags})},
                  "forget_receipt": {"path": _rel(ledger, forget_file),
                                     "sha256": hashlib.sha256(forget_file.read_bytes()).hexdigest()},
                  "cost": receipt.evidence.get("cost") or receipt.evidence.get("pipeline_cost"),
                  "guarantee": f"{receipt.guarantee}. One replay served {len(request_ids)} request(s)."}
    batch_path = folder / f"{name}.json"
    batch_sha = write_receipt(batch_path, sign_receipt(batch_body, ledger.signing_key))
    receipts, paths = {}, {}
    for rid in request_ids:
        req = by_id[rid]
        body = {**common, "format": REQUEST_RECEIPT_FORMAT, "request": _request_part(ledger, req),
                "ledger_records": {"request": {"seq": req.seq, "sha256": req.sha256}, "batch_start": _ref(start)},
                "batch": {"name": name, "requests": request_ids, "receipt": _rel(ledger, batch_path),
                          "receipt_sha256": batch_sha},
                "supersedes": list(req.provisional),
                "guarantee": (f"{receipt.guarantee}. Served in {name} with {len(request_ids) - 1} other request(s); "
                              "this exact model comes from the recorded run, not from an approximately unlearned "
                              "one" + (", and supersedes the provisional model(s) of " + ", ".join(req.provisional)
                                       if req.provisional else "") + ".")}
        path = folder / f"{rid}.exact.json"
        receipts[rid] = {"path": _rel(ledger, path), "sha256": write_receipt(path, sign_receipt(body,
                                                                                              ledger.signing_key))}
        paths[rid] = path
    stages = receipt.evidence.get("pipeline")  # a pipeline: the next batch deletes from the replayed last stage
    replay = Path(stages[-1]["replay"]["output"]) if stages else out / "replay"
    steps = sum(s.get("steps_replayed") or 0 for s in stages) if stages else \
        (receipt.evidence.get("replay") or {}).get("segments_replayed")
    ledger.append("batch_done", batch=name, requests=request_ids, run=_rel(ledger, replay),
                  model=_rel(ledger, out / "model"), receipts=receipts, batch_receipt=batch_sha,
                  params_root=receipt.state_hashes["params_root"], verified=receipt.evidence.get("verified"),
                  steps_replayed=steps,
                  published=_published(receipt), time=iso(now))
    for path in [*paths.values(), batch_path]:
        write_bundle(ledger, path)
    return BatchResult(name=name, kind="exact", requests=request_ids, receipts=paths, batch_receipt=batch_path,
                       forget_receipt=receipt)


# -- approximate --------------------------------------------------------------------------------------------------
def serve_approximate(ledger: RequestJournal, *, method: str = "masc", model=None, data=None, now=None, log=None,
                      **options) -> BatchResult | None:
    """The hot path: an approximate method on the model served now, for the requests nothing has served yet (None
    when there are none). ``model``: default the ledger's served model (last exact batch or provisional model);
    ``data``: the rows the ids name (default the current exact run's token store). ``options`` are
    :class:`~hf_unlearn.deletion.ForgetConfig` fields of the approximate path."""
    from ..trace.run import open_run

    log = log or (lambda m: print(m, flush=True))
    now = parse_time(now, "--now")
    with serving(ledger):
        todo = [r for r in ledger.pending() if r.state == PENDING]
        if not todo:
            return None
        source = model if model is not None else ledger.served_model()
        if source is None:
            raise UnlearnError("no model is served yet from this ledger: pass --model (the model you serve now, e.g. "
                               "the recorded run's trained model with its tokenizer)")
        if data is None:
            data = str(open_run(ledger.current_run(), check_checkpoints=False).store_path)
        request_ids = [r.id for r in todo]
        ids = _union(ledger, request_ids)
        name = f"approx-{1 + sum(r['type'] == 'approximate' for r in ledger.records()):04d}"
        out = _fresh(ledger.path / "provisional" / name)
        log(f"{name}: {method} on {source} for {len(ids)} id(s) of {len(request_ids)} request(s) (provisional)")
        receipt = forget(source, ids, out, method=method, data=data, log=log, **options)
        _keep_card_info_private(ledger, out / "model", name)
        opening = ledger.records()[0]
        folder = ledger.path / RECEIPTS_DIR
        receipts, paths = {}, {}
        for req in todo:
            body = {"format": REQUEST_RECEIPT_FORMAT, "kind": "approximate", "provisional": True,
                    "ledger": {"id": opening["ledger"], "run_id": opening["run_id"]},
                    "request": _request_part(ledger, req),
                    "ledger_records": {"request": {"seq": req.seq, "sha256": req.sha256}},
                    "batch": {"name": name, "requests": request_ids}, "method": method,
                    "model": _rel(ledger, out / "model"), "state_hashes": receipt.state_hashes,
                    "evaluation": {"before": receipt.evidence.get("before"), "after": receipt.evidence.get("after")},
                    "guarantee": (f"provisional: {receipt.guarantee}. It will be superseded by an exact deletion "
                                  f"from the recorded run (`hf-unlearn requests serve --exact`), due by "
                                  f"{req.deadline}."),
                    "created": iso(now)}
            path = folder / f"{req.id}.{name}.json"
            receipts[req.id] = {"path": _rel(ledger, path),
                                "sha256": write_receipt(path, sign_receipt(body, ledger.signing_key))}
            paths[req.id] = path
        ledger.append("approximate", name=name, requests=request_ids, method=method, model=_rel(ledger, out / "model"),
                      receipts=receipts, params_root=receipt.state_hashes["params_root"], time=iso(now))
        for path in paths.values():
            write_bundle(ledger, path)
    return BatchResult(name=name, kind="approximate", requests=request_ids, receipts=paths, batch_receipt=None,
                       forget_receipt=receipt)


# -- planning and policy ------------------------------------------------------------------------------------------
def plan(ledger: RequestJournal, now=None) -> dict:
    """The replay cost of the pending set: one batch now, each request alone, and waiting for the earliest
    deadline (``replay_cost`` on the current exact run; nothing is computed)."""
    from ..trace.replay import replay_cost
    from ..trace.run import open_run

    now = parse_time(now, "--now")
    pending = ledger.pending()
    if not pending:
        return {"pending": 0}
    ids = ledger.private_ids([r.id for r in pending])
    union = list(dict.fromkeys(i for r in pending for i in ids[r.id]))
    if _has_run_parent(os.fspath(ledger.current_run())):  # a pipeline's last run: every stage, added up
        runs = open_pipeline([ledger.current_run()])

        def cost(request_ids):
            c = pipeline_cost(runs, request_ids)
            first = next((s for s in c["stages"] if s["replayed"]), None)
            return {"total_steps": c["pipeline_steps"], "steps_to_replay": c["total_steps_replayed"],
                    "start_checkpoint": None if first is None else f"{first['start_checkpoint']} of stage "
                                                                    f"{first['stage']}"}
    else:
        run = open_run(ledger.current_run(), check_checkpoints=False)

        def cost(request_ids):
            return replay_cost(run, request_ids)
    batch = cost(union)
    alone = {r.id: cost(ids[r.id])["steps_to_replay"] for r in pending}
    first = min(pending, key=lambda r: r.deadline)
    return {"pending": len(pending), "total_steps": batch["total_steps"], "batch_now": batch["steps_to_replay"],
            "batch_start_checkpoint": batch["start_checkpoint"], "each_alone": alone,
            "each_alone_total": sum(alone.values()), "earliest_deadline": first.deadline,
            "earliest_deadline_request": first.id, "days_to_earliest_deadline": round(first.days_left(now), 2),
            "wait_until_deadline": batch["steps_to_replay"],
            "oldest_days": round(max(r.age_days(now) for r in pending), 2)}


def format_plan(p: dict) -> str:
    if not p.get("pending"):
        return "nothing pending"
    lines = [f"{p['pending']} pending request(s) on a run of {p['total_steps']} steps:",
             f"  one batch now          {p['batch_now']} replayed steps (from checkpoint step "
             f"{p['batch_start_checkpoint']})",
             f"  each request alone     {p['each_alone_total']} replayed steps ("
             + ", ".join(f"{k}: {v}" for k, v in p["each_alone"].items()) + ")",
             f"  wait until {p['earliest_deadline']} ({p['days_to_earliest_deadline']:.1f} days, "
             f"{p['earliest_deadline_request']}'s deadline): one batch of at least {p['wait_until_deadline']} steps "
             "for these, shared with every request that arrives before then (a new request only moves the start "
             "earlier if its rows are earlier)"]
    return "\n".join(lines)


@dataclass
class Policy:
    """When ``requests serve --due`` runs an exact batch (a JSON or TOML file holds these fields)."""

    max_wait_days: float = 21.0  # serve once the oldest pending request has waited this long
    max_replay_steps: int | None = None  # ... or at once when a batch now replays at most this many steps
    approximate_first: bool = False  # run the approximate hot path on new requests before they wait
    approximate_method: str = "masc"
    oracle: bool = False
    purge_after_batch: bool = False  # run `requests purge` after each exact batch (erase what it no longer needs)

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> Policy:
        if path is None:
            return cls()
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise UnlearnError(f"cannot read the policy {p}: {e.strerror or e}") from None
        try:
            if p.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except RecursionError:
            raise UnlearnError(f"the policy {p} is nested too deeply to be a policy (a JSON object of fields)") from None
        except ValueError as e:
            raise UnlearnError(f"the policy {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
        return cls.from_dict(data, where=f"the policy {p}")

    @classmethod
    def from_dict(cls, data, where: str = "the policy") -> Policy:
        """A policy from a mapping, every field type-checked (``"no"`` is not ``false``, ``true`` is not 1)."""

        if not isinstance(data, dict):
            raise UnlearnError(f"{where} must be a JSON object (TOML table) of fields, not a {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UnlearnError(f"{where} has unknown field(s) {', '.join(unknown)}; its fields are "
                               f"{', '.join(sorted(known))}")

        try:
            return cls(**data)
        except UnlearnError as e:
            raise UnlearnError(f"{where}: {e}") from None

    def __post_init__(self) -> None:
        import math

        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("approximate_first", "oracle", "purge_after_batch"):
            if not isinstance(getattr(self, name), bool):
                raise UnlearnError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (number(self.max_wait_days) and self.max_wait_days >= 0):
            raise UnlearnError(f"max_wait_days must be a number >= 0, got {self.max_wait_days!r}")
        steps = self.max_replay_steps
        if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
            raise UnlearnError(f"max_replay_steps must be an integer >= 0 (or null), got {steps!r}")
        from ..methods.registry import get_method

        if not isinstance(self.approximate_method, str):
            raise UnlearnError(f"approximate_method must be a method name, got {self.approximate_method!r}")
        get_method(self.approximate_method)


def due_reasons(ledger: RequestJournal, policy: Policy, now=None) -> list[str]:
    """Why an exact batch is due now (empty: not due)."""
    now = parse_time(now, "--now")
    unfinished = ledger.unfinished_batch()
    if unfinished is not None:
        return [f"{unfinished['batch']} was interrupted and must be completed"]
    pending = ledger.pending()
    if not pending:
        return []
    reasons = []
    oldest = max(pending, key=lambda r: r.age_days(now))
    if oldest.age_days(now) >= policy.max_wait_days:
        reasons.append(f"{oldest.id} has waited {oldest.age_days(now):.1f} days (max_wait_days "
                       f"{policy.max_wait_days:g})")
    soonest = min(pending, key=lambda r: r.days_left(now))
    if soonest.days_left(now) <= 0:
        reasons.append(f"{soonest.id} is past its deadline {soonest.deadline}")
    if policy.max_replay_steps is not None:
        steps = plan(ledger, now)["batch_now"]
        if steps <= policy.max_replay_steps:
            reasons.append(f"a batch now replays {steps} steps (max_replay_steps {policy.max_replay_steps})")
    return reasons


def serve_due(ledger: RequestJournal, policy: Policy, *, now=None, log=None, model=None,
              approximate_options: dict | None = None, **exact_options) -> dict:
    """Apply the policy once (what cron runs): maybe the approximate hot path, maybe one exact batch; returns
    ``{"approximate": BatchResult|None, "exact": BatchResult|None, "reasons": [...], "message": str}``."""
    log = log or (lambda m: print(m, flush=True))
    now = parse_time(now, "--now")
    out = {"approximate": None, "exact": None, "reasons": [], "message": ""}
    if policy.approximate_first and any(r.state == PENDING for r in ledger.pending()):
        out["approximate"] = serve_approximate(ledger, method=policy.approximate_method, model=model, now=now, log=log,
                                               **(approximate_options or {}))
    out["reasons"] = due_reasons(ledger, policy, now)
    if not out["reasons"]:
        pending = ledger.pending()
        if not pending:
            out["message"] = "nothing due: no pending request"
        else:
            oldest = max(pending, key=lambda r: r.age_days(now))
            due_on = parse_time(oldest.received) + _days(policy.max_wait_days)
            out["message"] = (f"nothing due: {len(pending)} pending request(s), the oldest ({oldest.id}) "
                              f"{oldest.age_days(now):.1f} days old; due by max_wait_days on {iso(due_on)}")
        return out
    log("due: " + "; ".join(out["reasons"]))
    out["exact"] = serve_exact(ledger, now=now, log=log, oracle=exact_options.pop("oracle", policy.oracle),
                               **exact_options)
    out["message"] = f"served {out['exact'].name} ({len(out['exact'].requests)} request(s))"
    if policy.purge_after_batch:
        out["purge"] = purge(ledger, log=log)
        out["message"] += f"; purged {out['purge'].summary_line()}"
    return out


def _days(n: float):
    import datetime as dt

    return dt.timedelta(days=n)


def request_rows(ledger: RequestJournal, now=None) -> list[dict]:
    """``requests list``: one row per request (tags only)."""
    now = parse_time(now, "--now")
    rows = []
    for r in ledger.requests():
        rows.append({"request": r.id, "state": r.state + (f" ({r.running} running or interrupted)" if r.running
                                                          else ""),
                     "ids": len(r.tags), "received": r.received, "age_days": round(r.age_days(now), 1),
                     "deadline": r.deadline, "days_left": round(r.days_left(now), 1),
                     "overdue": r.state != "exact" and r.days_left(now) < 0, "batch": r.batch,
                     "provisional": r.provisional})
    return rows


def _purge_cut_off(ledger: RequestJournal) -> int | None:
    """The ``purge_start`` record of a purge that was cut off (the next ``requests purge`` finishes it), if any."""
    start = unfinished_purge(ledger.records())
    return start["seq"] if start else None


def status(ledger: RequestJournal, now=None) -> dict:
    """``requests status``: counts per state, overdue requests, the next deadline, an interrupted batch."""
    now = parse_time(now, "--now")
    rows = request_rows(ledger, now)
    waiting = [r for r in rows if not r["state"].startswith("exact")]
    unfinished = ledger.unfinished_batch()
    return {"ledger": str(ledger.path), "requests": len(rows),
            "pending": sum(r["state"].startswith(PENDING) for r in rows),
            "approximate": sum(r["state"].startswith(APPROXIMATE) for r in rows),
            "exact": sum(r["state"] == "exact" for r in rows), "overdue": [r["request"] for r in rows if r["overdue"]],
            "next_deadline": min((r["deadline"] for r in waiting), default=None),
            "interrupted_batch": unfinished["batch"] if unfinished else None,
            "interrupted_purge": _purge_cut_off(ledger),
            "served_model": str(ledger.served_model()) if ledger.served_model() else None,
            "records": len(ledger.records()), "now": iso(now or utc_now())}
