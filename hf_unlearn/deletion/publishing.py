"""The Hub side of a deletion: before any compute, the checks a publish needs (the output folder's name, the Hub's
answer, every deletion already published to the repo contained in this one); after it, the push of the model with
the replay's provenance, and a fresh download verified to be this receipt's model. Also the card's own numbers that
the publisher's id scanner must not take for ids (:func:`_own_settings`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import UnlearnError
from ..keys import key_fingerprint, load_key
from ..validation import hub_unreachable
from .config import EXACT, ForgetConfig
from .forget_receipt import ForgetReceipt

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def _check_output_name(config: ForgetConfig, request: list) -> None:
    """Before any compute: an output folder named after the ids (``forget-3600-3601``) is refused when publishing.
    Nothing published carries a local path, but such a name travels with every log line, receipt and copy."""
    from ..hub.leaks import IdScanner

    hits = IdScanner(request).scan_text(Path(config.output_dir).name, "output folder name")
    if hits:
        raise UnlearnError(f"the output folder {Path(config.output_dir).name!r} is named after the ids it deletes "
                           f"({hits[0].what}); choose a name without them (e.g. deletion-0001); nothing was done")


def _check_hub_access(config: ForgetConfig) -> None:
    """Before any compute: the Hub answers and takes the token (a publish that fails after training wastes it)."""
    from huggingface_hub import HfApi, constants

    from ..hub.publish import hub_error

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


def _check_earlier_deletions(config: ForgetConfig, plan: dict) -> None:
    """Before any compute: every deletion already published to ``--repo`` (its ``deletion-NNNN`` tags) must be
    contained in this one (the request's ids plus those the source has already lost), else this push would put
    the earlier deletion's rows back into the published model."""
    import tempfile

    from huggingface_hub import HfApi, hf_hub_download

    from ..hub.cards import forget_request
    from ..hub.publish import DELETION_TAG, FORGET_REQUEST_FILE, hub_error

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


def _deleted_in_source(plan: dict, key: bytes) -> set[str]:
    """Keyed tags (library key) of the ids the source no longer holds: an exact source run's deletion log (when the
    run tags with the library key), or the ``forget_request.json`` of a model folder published by a deletion."""
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

    from ..trace.verification import VERIFICATION_FILE, require_sealed_verdict

    # the verdict is a claim: under this replay's seal, about this replay's final checkpoint (which the view lacks)
    require_sealed_verdict(run, f"refusing to publish {run / VERIFICATION_FILE}")
    dest.mkdir(parents=True)
    for name in PROVENANCE_FILES:
        for f in (run / name, run / f"{name}.sha256"):
            if f.is_file():
                shutil.copy2(f, dest / f.name)
    return dest
