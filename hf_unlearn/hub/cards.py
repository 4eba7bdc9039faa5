"""Model cards for unlearned models, rendered from the Jinja templates in ``model_cards/``.

A card consumes the trainer contract (``unlearning_card_info()``: ``method``, ``hyperparameters``, ``forget_ids``,
``citation``, ``paper``, optional ``evaluation``, ``extra`` and ``not_ids``). The forget request is published as a
count and keyed tags (see ``keys.py``), never as raw ids: :func:`render_model_card` scans every value it puts into
the card for the forget ids (:class:`hf_unlearn.hub.leaks.IdScanner`) and refuses, naming the field. Exact
deletion (trace replay) adds ``extra["exact_deletion"]`` = ``{"params_root", "optimizer_root", "verified",
"verification"}`` and gets the ``exact_deletion.md`` template. The YAML metadata is built with
``huggingface_hub.ModelCardData`` so the Hub reads base_model, tags, datasets, license and the model-index.
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from .keys import TAG_FORMAT, key_fingerprint, keyed_tags
from .leaks import IdScanner, find_raw_ids  # noqa: F401  (find_raw_ids: the public checker, re-exported)
from .server import _front_matter, validate_card_metadata

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "model_cards"
DEFAULT_TEMPLATE = "unlearned_model.md"
EXACT_TEMPLATE = "exact_deletion.md"
REQUIRED_KEYS = ("method", "hyperparameters", "forget_ids", "citation", "paper")
CARD_FIELDS = ("method", "hyperparameters", "evaluation", "extra", "citation", "paper")  # published card info
SHOWN_TAGS = 16
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def public_value(value: Any) -> Any:
    """A value as a card shows it: enums by value (``LORA``, not ``PeftType.LORA``), sets as sorted lists."""
    if isinstance(value, enum.Enum):
        return public_value(value.value)
    if isinstance(value, Mapping):
        return {str(k): public_value(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((public_value(v) for v in value), key=lambda v: (str(type(v)), str(v)))
    if isinstance(value, (list, tuple)):
        return [public_value(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (ValueError, TypeError):
            return public_value(value.tolist())
    return value


def normalize_card_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """Check a trainer's ``unlearning_card_info()`` dict and fill the optional keys."""
    if not isinstance(info, Mapping):
        raise UnlearnError(f"card info must be a dict (from unlearning_card_info()), got {type(info).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in info]
    if missing:
        raise UnlearnError(f"card info lacks {', '.join(missing)}; unlearning_card_info() must return "
                           f"{', '.join(REQUIRED_KEYS)} (and optionally evaluation, extra, not_ids)")
    out = dict(info)
    if not isinstance(out["method"], str) or not out["method"]:
        raise UnlearnError("card info 'method' must be a non-empty string, e.g. 'MASC'")
    for key in ("hyperparameters", "evaluation", "extra"):
        out[key] = public_value(dict(out.get(key) or {}))
    out["forget_ids"] = list(out["forget_ids"] or [])
    out["citation"], out["paper"] = str(out["citation"] or ""), str(out["paper"] or "")
    out["not_ids"] = dict(out.get("not_ids") or {})
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


def card_scanner(info: Mapping[str, Any], not_ids: Mapping[str, Any] | None = None) -> IdScanner:
    """The scanner for one push: the request's forget ids, the trainer's and the caller's ``not_ids``."""
    return IdScanner(info["forget_ids"], {**(info.get("not_ids") or {}), **(not_ids or {})})


def checked_card_info(card_info: Mapping[str, Any], not_ids: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`normalize_card_info`, refusing info whose published fields carry a forget id (naming the field)."""
    info = normalize_card_info(card_info)
    scanner = card_scanner(info, not_ids)
    hits = [h for k in CARD_FIELDS for h in scanner.scan(info[k], k)]
    scanner.refuse(hits, "the card info (unlearning_card_info())")
    return info


# -- rendering ----------------------------------------------------------------------------------------------
def forget_request(forget_ids: list, key: bytes) -> dict[str, Any]:
    """The publishable form of a forget request: a count, the key fingerprint and the sorted keyed tags.

    The tags are the trace's slot tags under the same key, so they match a run's deletion log one to one.
    """
    return {"format": "hf_unlearn.forget_request.v2", "tag_format": TAG_FORMAT, "count": len(set(forget_ids)),
            "key_fingerprint": key_fingerprint(key), "tags": keyed_tags(forget_ids, key)}


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from ..version import __version__

    out = {"hf_unlearn": __version__, "python": platform.python_version()}
    for pkg in ("transformers", "torch", "huggingface_hub", "safetensors", "accelerate", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def hub_model_id(name: Any) -> str | None:
    """``name`` if it is a Hub model id (``org/name``) and not a local folder; None otherwise.

    A local path is never published as ``base_model``: it is not a Hub id and would expose the publisher's file
    system.
    """
    if not isinstance(name, str) or not HUB_ID.match(name) or os.path.exists(name):
        return None
    return name


def shown_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """What the card's table shows: ``max_steps`` when it bounded the run, else the epoch count (not both)."""
    shown = dict(hyperparameters)
    steps = shown.get("max_steps")
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps > 0:
        shown.pop("num_train_epochs", None)
    elif steps is not None and isinstance(steps, (int, float)) and steps <= 0:
        shown.pop("max_steps")
    return shown


# licence names the Hub accepts beyond SPDX (their numbers are model versions)
HUB_LICENSES = frozenset({
    "openrail", "openrail++", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "llama2", "llama3", "llama3.1", "llama3.2", "llama3.3", "llama4", "gemma", "apple-amlr",
    "apple-ascl", "deepfloyd-if-license", "intel-research", "lgpl-lr", "h-research", "fair-noncommercial-research-license",
    "other", "unknown",
})


def is_license_identifier(license: str | None) -> bool:
    """Whether ``license`` is one SPDX identifier or a Hub licence name: text a user cannot put an id into."""
    if not isinstance(license, str) or not license:
        return False
    if license.lower() in HUB_LICENSES:
        return True
    from packaging.licenses import InvalidLicenseExpression, canonicalize_license_expression

    try:
        canonical = canonicalize_license_expression(license)
    except InvalidLicenseExpression:
        return False
    return " " not in canonical and "LicenseRef-" not in canonical


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
    not_ids: Mapping[str, Any] | None = None,
    merged_adapter: Mapping[str, Any] | None = None,
) -> str:
    """Render the card (YAML metadata + body) for an unlearned model; raises if it would carry a forget id.

    ``manifest`` is the state-hash manifest (``publish.build_manifest``); ``tag`` the revision tag of this push
    (e.g. ``deletion-0003``); ``template`` a custom template file (else ``model_cards/`` picks one); ``extra_tags``
    more Hub tags; ``not_ids`` allowances for numbers that merely equal an id (see :mod:`hf_unlearn.hub.leaks`);
    ``merged_adapter`` the settings of a PEFT adapter merged into the published weights.
    """
    import jinja2
    from huggingface_hub import EvalResult, ModelCardData

    info = checked_card_info(card_info, not_ids)
    scanner = card_scanner(info, not_ids)
    extra_tags = [extra_tags] if isinstance(extra_tags, str) else list(extra_tags or [])
    datasets = list(datasets or [])
    base_model = hub_model_id(base_model) if base_model else None

    if template is not None:
        template = Path(template)
        if not template.is_file():
            raise UnlearnError(f"model card template {template} does not exist")
        search, name = [str(template.parent), str(TEMPLATES_DIR)], template.name
    else:
        search, name = [str(TEMPLATES_DIR)], EXACT_TEMPLATE if info["extra"].get("exact_deletion") else DEFAULT_TEMPLATE
    hits = scanner.scan({"repo_id": repo_id, "base_model": base_model, "datasets": datasets, "tags": extra_tags,
                         "merged_adapter": merged_adapter}, "")  # (a push scans its own tag=)
    # a known licence identifier's numbers are versions, not ids ("apache-2.0" with forget id 2); anything else is
    # scanned in full
    hits += scanner.scan({"license": license}, "", numbers=not is_license_identifier(license))
    scanner.refuse(hits, "the model card")

    exact = info["extra"].get("exact_deletion") or None
    request = forget_request(info["forget_ids"], key)
    model_name = repo_id.split("/")[-1] if repo_id else f"{info['method']}-unlearned"
    eval_results = [
        EvalResult(task_type="text-generation", dataset_type=datasets[0] if datasets else "forget-set",
                   dataset_name=datasets[0] if datasets else "forget set", metric_type=metric,
                   metric_name=metric, metric_value=value)
        for metric, value in info["evaluation"].items() if math.isfinite(value)
    ]
    tags = ["unlearning", "hf_unlearn", _slug(info["method"])] + (["exact-deletion"] if exact else [])
    tags += [t for t in extra_tags if t not in tags]
    summary = {"method": info["method"], "forget_count": request["count"],
               "key_fingerprint": request["key_fingerprint"]}
    if manifest:
        summary.update(manifest="state_hashes.json", params_root=manifest["params_root"], root=manifest["root"])
        for root_name in ("state_dict_root", "files_root"):
            if manifest.get(root_name):
                summary[root_name] = manifest[root_name]
    if exact and exact.get("params_root"):
        summary["exact_deletion_params_root"] = exact["params_root"]
    if tag:
        summary["revision_tag"] = tag
    card_data = ModelCardData(
        base_model=base_model, library_name="transformers", license=license or None,
        datasets=datasets or None, tags=tags, model_name=model_name,
        eval_results=eval_results or None, hf_unlearn=summary,
    )
    loaded: dict[str, str] = {}
    env = jinja2.Environment(loader=_recording_loader(search, loaded), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["cell"] = lambda v: (json.dumps(v) if not isinstance(v, str) else v).replace("|", "\\|")
    try:
        text = env.get_template(name).render(
            card_data=card_data.to_yaml(), model_name=model_name, repo_id=repo_id or model_name,
            base_model=base_model, datasets=datasets, method=info["method"], paper=info["paper"],
            hyperparameters=shown_hyperparameters(info["hyperparameters"]), evaluation=info["evaluation"],
            citation=info["citation"], request=request, shown_tags=request["tags"][:SHOWN_TAGS], manifest=manifest,
            exact=exact, provenance_files=sorted(provenance_files), tag=tag, versions=library_versions(),
            merged_adapter=merged_adapter,
        )
    except jinja2.TemplateError as e:
        raise UnlearnError(f"model card template {name} failed to render: {e}") from None
    # every value above was scanned; so is every template file the rendering read that is not the library's own
    # (the template, what it includes, extends or imports), numbers included; the rendered text is checked once
    # more for string ids (its numbers are the scanned values', the library's versions and hashes, and the ones
    # the templates' text holds)
    hits = [h for filename, source in loaded.items() if not _is_library_template(filename)
            for h in scanner.scan_template(source, f"template {Path(filename).name}", code_numbers=True)]
    hits += scanner.scan_text(text, "rendered model card", numbers=False)
    scanner.refuse(hits, "the model card")
    check_card_metadata(text)
    return text


def _recording_loader(search: list[str], loaded: dict[str, str]):
    """A loader over ``search`` that keeps in ``loaded`` the source of every template file it reads (what an
    ``{% include %}``, ``{% extends %}`` or ``{% import %}`` reads too)."""
    import jinja2

    files = jinja2.FileSystemLoader(search)

    def load(name):
        source, filename, uptodate = files.get_source(None, name)
        loaded[filename] = source
        return source, filename, uptodate

    return jinja2.FunctionLoader(load)


def _is_library_template(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(TEMPLATES_DIR.resolve())  # (a checkout links model_cards/)


def check_card_metadata(text: str) -> dict:
    """Parse and check a card's YAML metadata the way the Hub does; returns it."""
    errors, _ = validate_card_metadata(text)
    meta = _front_matter(text)
    if errors or not isinstance(meta, dict):
        raise UnlearnError("the model card's YAML metadata is invalid: " + "; ".join(errors or ["missing"]))
    return meta


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "method"
