"""Model cards for unlearned models, rendered from the Jinja templates in ``model_cards/``.

A card consumes the trainer contract (``unlearning_card_info()``: ``method``, ``hyperparameters``, ``forget_ids``,
``citation``, ``paper``, optional ``evaluation`` and ``extra``). The forget request is published as a count and
keyed tags (see ``keys.py``), never as raw ids, and :func:`render_model_card` refuses a card that would carry raw ids
anywhere. Exact deletion (trace replay) adds ``extra["exact_deletion"]`` = ``{"params_root", "optimizer_root",
"verified", "verification"}`` and gets the ``exact_deletion.md`` template. The YAML metadata is built with
``huggingface_hub.ModelCardData`` so the Hub reads base_model, tags, datasets, license and the model-index.
"""

from __future__ import annotations

import json
import math
import platform
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from .keys import key_fingerprint, keyed_tags

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "model_cards"
DEFAULT_TEMPLATE = "unlearned_model.md"
EXACT_TEMPLATE = "exact_deletion.md"
REQUIRED_KEYS = ("method", "hyperparameters", "forget_ids", "citation", "paper")
SHOWN_TAGS = 16
_ID_KEY = re.compile(r"(^|[_\-\s])(ids?|rows?|samples?|indices|index|examples?)$", re.I)


def normalize_card_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """Check a trainer's ``unlearning_card_info()`` dict and fill the optional keys."""
    if not isinstance(info, Mapping):
        raise UnlearnError(f"card info must be a dict (from unlearning_card_info()), got {type(info).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in info]
    if missing:
        raise UnlearnError(f"card info lacks {', '.join(missing)}; unlearning_card_info() must return "
                           f"{', '.join(REQUIRED_KEYS)} (and optionally evaluation, extra)")
    out = dict(info)
    if not isinstance(out["method"], str) or not out["method"]:
        raise UnlearnError("card info 'method' must be a non-empty string, e.g. 'MASC'")
    for key in ("hyperparameters", "evaluation", "extra"):
        out[key] = dict(out.get(key) or {})
    out["forget_ids"] = list(out["forget_ids"] or [])
    out["citation"], out["paper"] = str(out["citation"] or ""), str(out["paper"] or "")
    for name, value in out["evaluation"].items():
        try:
            out["evaluation"][name] = float(value)
        except (TypeError, ValueError):
            raise UnlearnError(f"evaluation metric {name!r} must be a number, got {value!r}") from None
    try:
        json.dumps(out["hyperparameters"]), json.dumps(out["extra"])
    except TypeError as e:
        raise UnlearnError(f"card info hyperparameters and extra must be JSON-able: {e}") from None
    return out


# -- raw id detection ----------------------------------------------------------------------------------------
def find_raw_ids(value: Any, raw_ids: Iterable, where: str = "card") -> list[str]:
    """Places in ``value`` (nested dicts/lists/strings) that carry raw sample ids; empty if none.

    Flagged: any raw id under an id-like key (``ids``, ``deleted_rows``, ``sample_id`` ...); a list holding two or
    more raw ids; a non-numeric raw id (``"piqa-17"``) anywhere in text; two or more numeric raw ids in one
    comma-separated run of numbers in text. A lone number elsewhere (``epochs: 3``) is not taken for an id.
    """
    raw = {str(i) for i in raw_ids}
    if not raw:
        return []
    words = sorted((r for r in raw if not r.isdigit()), key=len, reverse=True)
    word_re = re.compile("|".join(rf"(?<![\w-]){re.escape(w)}(?![\w-])" for w in words)) if words else None
    found: list[str] = []

    def walk(v, path, id_key):
        if isinstance(v, Mapping):
            for k, sub in v.items():
                if str(k) in raw:
                    found.append(f"{path} (key {k!r})")
                walk(sub, f"{path}.{k}", id_key or bool(_ID_KEY.search(str(k))))
        elif isinstance(v, (list, tuple, set, frozenset)):
            hits = [x for x in v if not isinstance(x, (Mapping, list, tuple, set)) and str(x) in raw]
            if hits and (id_key or len(hits) >= 2):
                found.append(f"{path} ({len(hits)} raw ids)")
            for i, sub in enumerate(v):
                if isinstance(sub, (Mapping, list, tuple, set, frozenset, str)):
                    walk(sub, f"{path}[{i}]", id_key)
        elif isinstance(v, str):
            if id_key and v in raw:
                found.append(f"{path} (raw id)")
            elif word_re is not None and word_re.search(v):
                found.append(f"{path} (raw id {word_re.search(v).group(0)!r})")
            else:
                for run in re.finditer(r"(?<![\w.])\d+(?:\s*[,;]\s*\d+)+", v):
                    if len({n for n in re.split(r"\s*[,;]\s*", run.group(0)) if n in raw}) >= 2:
                        found.append(f"{path} (a run of raw ids)")
                        break
        elif id_key and v is not None and str(v) in raw:
            found.append(f"{path} (raw id)")

    walk(value, where, False)
    return found


def refuse_raw_ids(value: Any, raw_ids: Iterable, where: str = "card") -> None:
    hits = find_raw_ids(value, raw_ids, where)
    if hits:
        raise UnlearnError(f"refusing to publish: the {where} would contain raw sample ids at {'; '.join(hits[:5])}. "
                           "Publish keyed tags only (hf_unlearn.hub.keys.keyed_tags); remove the ids from the "
                           "hyperparameters/extra/evaluation of unlearning_card_info()")


def checked_card_info(card_info: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`normalize_card_info`, refusing info whose published fields carry raw forget ids."""
    info = normalize_card_info(card_info)
    shown = {k: info[k] for k in ("method", "hyperparameters", "evaluation", "extra", "citation", "paper")}
    refuse_raw_ids(shown, info["forget_ids"], "card info")
    return info


# -- rendering ----------------------------------------------------------------------------------------------
def forget_request(forget_ids: list, key: bytes) -> dict[str, Any]:
    """The publishable form of a forget request: a count, the key fingerprint and the sorted keyed tags."""
    return {"format": "hf_unlearn.forget_request.v1", "count": len(forget_ids),
            "key_fingerprint": key_fingerprint(key), "tags": keyed_tags(forget_ids, key)}


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    out = {"hf_unlearn": __version__, "python": platform.python_version()}
    for pkg in ("transformers", "torch", "huggingface_hub", "safetensors", "accelerate", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def render_model_card(
    card_info: Mapping[str, Any],
    *,
    key: bytes,
    repo_id: str | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    manifest: Mapping[str, Any] | None = None,
    provenance_files: Iterable[str] = (),
    tag: str | None = None,
    template: str | Path | None = None,
    extra_tags: list[str] | str | None = None,
) -> str:
    """Render the card (YAML metadata + body) for an unlearned model; raises if it would carry raw ids.

    ``manifest`` is the state-hash manifest (``publish.build_manifest``); ``tag`` the revision tag of this push
    (e.g. ``deletion-0003``); ``template`` a custom template file (else ``model_cards/`` picks one); ``extra_tags``
    more Hub tags.
    """
    import jinja2
    from huggingface_hub import EvalResult, ModelCardData

    info = checked_card_info(card_info)
    forget_ids = info["forget_ids"]

    exact = info["extra"].get("exact_deletion") or None
    request = forget_request(forget_ids, key)
    model_name = repo_id.split("/")[-1] if repo_id else f"{info['method']}-unlearned"
    datasets = list(datasets or [])
    eval_results = [
        EvalResult(task_type="text-generation", dataset_type=datasets[0] if datasets else "forget-set",
                   dataset_name=datasets[0] if datasets else "forget set", metric_type=name,
                   metric_name=name, metric_value=value)
        for name, value in info["evaluation"].items() if math.isfinite(value)
    ]
    tags = ["unlearning", "hf_unlearn", _slug(info["method"])] + (["exact-deletion"] if exact else [])
    extra_tags = [extra_tags] if isinstance(extra_tags, str) else list(extra_tags or [])
    tags += [t for t in extra_tags if t not in tags]
    summary = {"method": info["method"], "forget_count": request["count"],
               "key_fingerprint": request["key_fingerprint"]}
    if manifest:
        summary.update(manifest="state_hashes.json", params_root=manifest["params_root"], root=manifest["root"])
    if tag:
        summary["revision_tag"] = tag
    card_data = ModelCardData(
        base_model=base_model or None, library_name="transformers", license=license or None,
        datasets=datasets or None, tags=tags, model_name=model_name,
        eval_results=eval_results or None, hf_unlearn=summary,
    )

    if template is not None:
        template = Path(template)
        if not template.is_file():
            raise UnlearnError(f"model card template {template} does not exist")
        search, name = [str(template.parent), str(TEMPLATES_DIR)], template.name
    else:
        search, name = [str(TEMPLATES_DIR)], EXACT_TEMPLATE if exact else DEFAULT_TEMPLATE
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(search), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["cell"] = lambda v: (json.dumps(v) if not isinstance(v, str) else v).replace("|", "\\|")
    try:
        text = env.get_template(name).render(
            card_data=card_data.to_yaml(), model_name=model_name, repo_id=repo_id or model_name,
            base_model=base_model, datasets=datasets, method=info["method"], paper=info["paper"],
            hyperparameters=info["hyperparameters"], evaluation=info["evaluation"], citation=info["citation"],
            request=request, shown_tags=request["tags"][:SHOWN_TAGS], manifest=manifest, exact=exact,
            provenance_files=sorted(provenance_files), tag=tag, versions=library_versions(),
        )
    except jinja2.TemplateError as e:
        raise UnlearnError(f"model card template {name} failed to render: {e}") from None
    refuse_raw_ids(text, forget_ids, "rendered model card")
    check_card_metadata(text)
    return text


def check_card_metadata(text: str) -> dict:
    """Parse and check a card's YAML metadata the way the Hub does; returns it."""
    from .server import _front_matter, validate_card_metadata

    errors, _ = validate_card_metadata(text)
    meta = _front_matter(text)
    if errors or not isinstance(meta, dict):
        raise UnlearnError("the model card's YAML metadata is invalid: " + "; ".join(errors or ["missing"]))
    return meta


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "method"
