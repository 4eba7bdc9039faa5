"""Checks every command runs on its inputs before anything heavy loads: model sources, ids, options, output folders.

Why a module of its own: a wrong path used to cost 20-60 s of Hub retries and then name the wrong problem, a
failed command left empty output folders, and each command checked a little differently. Every check here raises
:class:`~hf_unlearn.errors.UnlearnError` with one line that says what is wrong and what to set, and costs
milliseconds (the Hub check is one TCP connect with a short timeout, done once per process and endpoint).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union
from urllib.parse import urlsplit

from .errors import UnlearnError

MODEL_FILES = ("config.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
_HUB_NAME = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"
HUB_ID = re.compile(rf"^(?:{_HUB_NAME}/)?{_HUB_NAME}$")
_reachability: dict[str, str | None] = {}


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` as the Hub spells repo ids (so ``./x``, ``/x``, ``a/b/c``, ``x.gguf`` are paths)."""
    return bool(HUB_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith(".gguf")


def is_trace_run(path: str | os.PathLike) -> bool:
    """A folder written by ``TraceRecordingTrainer`` (or a replay): header, plan and WAL (or, compacted, the one
    ``provenance.bin`` that holds them)."""
    p = Path(path)
    if not (p.is_dir() and (p / "header.json").is_file()):
        return False
    if any((p / f).is_file() for f in ("provenance.bin", "wal.bin", "plan.bin", "plan.jsonl", "manifest.bin")):
        return True  # a run, maybe broken: opening it names what is missing or damaged
    try:  # a run whose trace files are all gone still says what it is
        return b"hf_unlearn.trace." in (p / "header.json").read_bytes()[:1 << 20]
    except OSError:
        return False


def recorded_run_inside(path: str | os.PathLike) -> str | None:
    """The recorded run a training output folder holds (``runs/ft/trace`` for ``runs/ft``), or None. A deletion
    output holds two (``replay`` and ``oracle``): the one a next deletion starts from comes first, a run holding its
    token store (``private/store``; the oracle keeps none) and, among those, one named ``replay``."""
    p = Path(path)
    if not p.is_dir() or is_trace_run(p):
        return None
    runs = [d for d in p.iterdir() if d.is_dir() and is_trace_run(d)]
    runs.sort(key=lambda d: (not (d / "private" / "store").is_dir(), d.name != "replay", d.name))
    return os.path.join(os.fspath(path), runs[0].name) if runs else None


@dataclass(frozen=True)
class ModelSource:
    """Where a model (or tokenizer) comes from: ``local`` folder, ``gguf`` file, or the ``hub`` (maybe its cache)."""

    name: str
    kind: str
    local_files_only: bool = False

    def load_kwargs(self) -> dict:
        """Extra ``from_pretrained`` arguments: cache-only when the Hub is unreachable but the files are cached."""
        return {"local_files_only": True} if self.local_files_only else {}


def check_model_source(name_or_path: str | os.PathLike, what: str = "model") -> ModelSource:
    """Where ``name_or_path`` points, or a one-line error: missing folder, empty folder, a run, an unreachable Hub."""
    name = os.fspath(name_or_path)
    if not name.strip():
        raise UnlearnError(f"the {what} is empty; pass a local folder, a .gguf file or a Hub id 'org/name'")
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnlearnError(f"{what} {name!r} is a file but not a .gguf file; pass the model's folder")
        return ModelSource(name, "gguf")
    if path.is_dir():
        if is_trace_run(path):
            raise UnlearnError(f"{name!r} is a recorded run (a trace folder), not a {what}; `hf-unlearn forget {name} "
                               "--ids FILE --out OUT` deletes from it, `hf-unlearn trace inspect` describes it")
        wanted = MODEL_FILES + (TOKENIZER_FILES if what == "tokenizer" else ())
        if not any((path / f).is_file() for f in wanted) and not any(path.glob("*.gguf")):
            run = recorded_run_inside(name)
            if run:  # runs/ft given for runs/ft/trace: say where the run is
                raise UnlearnError(f"{what} folder {name!r} holds no {what}, but {run!r} is a recorded run (a "
                                   f"trace folder): pass `{run}` for exact deletion (`hf-unlearn forget "
                                   f"{run} --ids FILE --out OUT`)")
            raise UnlearnError(f"{what} folder {name!r} holds no {what} (no {' / '.join(wanted)} and no .gguf file); "
                               "save one with save_pretrained() or pass another folder")
        if what == "model" and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            _check_adapter_base(path)
        return ModelSource(name, "local")
    if not looks_like_hub_id(name):
        raise UnlearnError(f"{what} {name!r} does not exist: no such local folder or file (and it is not a Hub id "
                           "like 'org/name')")
    return check_hub_repo(name, what)


def adapter_base(path: str | os.PathLike) -> str:
    """The base model a PEFT adapter folder names (``base_model_name_or_path``), or a one-line error."""
    config = Path(path) / "adapter_config.json"
    try:
        base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise UnlearnError(f"cannot read {config}: {e}") from None
    if not base:
        raise UnlearnError(f"the adapter in {os.fspath(path)!r} names no base model (base_model_name_or_path in "
                           "adapter_config.json); set it, or merge the adapter and pass the merged model")
    return base


def _check_adapter_base(path: Path) -> None:
    """A PEFT adapter folder loads its base model first: check that one too (a missing base meant Hub retries)."""
    base = adapter_base(path)
    try:
        check_model_source(base, "model")
    except UnlearnError as e:
        raise UnlearnError(f"the base model of the adapter in {os.fspath(path)!r}: {e}") from None


def check_hub_repo(repo_id: str, what: str = "model") -> ModelSource:
    """A Hub repo id the process can load: reachable Hub, or cached files (then loads stay in the cache)."""
    from huggingface_hub import constants

    cached = _in_hf_cache(repo_id)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return ModelSource(repo_id, "hub", local_files_only=True)
        raise UnlearnError(f"{what} {repo_id!r} is not a local folder and not in the Hugging Face cache, and "
                           "HF_HUB_OFFLINE=1 keeps the Hub off; pass a local folder or unset HF_HUB_OFFLINE")
    problem = hub_unreachable(constants.ENDPOINT)
    if problem is None:
        return ModelSource(repo_id, "hub")
    if cached:
        return ModelSource(repo_id, "hub", local_files_only=True)
    raise UnlearnError(f"{what} {repo_id!r} is not a local folder and the Hub at {constants.ENDPOINT} cannot be "
                       f"reached ({problem}); pass a local folder, set HF_ENDPOINT to a reachable Hub, or "
                       "HF_HUB_OFFLINE=1 to use what is in the Hugging Face cache")


def check_hub_dataset(repo_id: str, how_to_avoid: str) -> None:
    """Before ``datasets.load_dataset(repo_id)``: fail at once, in one line, when the Hub is off or unreachable."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise UnlearnError(f"the dataset {repo_id} would come from the Hub, which is off (HF_HUB_OFFLINE / "
                           f"HF_DATASETS_OFFLINE); {how_to_avoid}")
    problem = hub_unreachable(constants.ENDPOINT)
    if problem is not None:
        raise UnlearnError(f"the dataset {repo_id} would come from the Hub at {constants.ENDPOINT}, which cannot be "
                           f"reached ({problem}); {how_to_avoid}")


def hub_unreachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """None when a TCP connection to ``endpoint`` opens, else why not (cached per endpoint for the process)."""
    if endpoint in _reachability:
        return _reachability[endpoint]
    parts = urlsplit(endpoint)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    problem: str | None = None
    if not host:
        problem = f"{endpoint!r} is not a URL"
    else:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            problem = e.strerror or str(e) or type(e).__name__
    _reachability[endpoint] = problem
    return problem


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for filename in MODEL_FILES + TOKENIZER_FILES:
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
        except Exception:  # a malformed cache is the same as no cache here
            return False
    return False


# -- ids and options -------------------------------------------------------------------------------------------
# The id file format: the one reader every command uses (`trace`, `forget`, `eval`, `hub`). Ids are ints or
# strings, and a digit-only string is not the int it spells. The typed form keeps the difference: JSON Lines
# (``.jsonl``), one JSON value per line (``3600`` or ``"3600"`` or ``{"id": ...}``), or a JSON list (``.json``). Any
# other file is the legacy text form, one id per line, where all-digit lines become ints.
SampleId = Union[int, str]


def _typed(value, where: str) -> SampleId:
    if isinstance(value, dict):
        if "id" not in value:
            raise UnlearnError(f"{where}: an object needs an \"id\" field, got keys {sorted(value)}")
        value = value["id"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnlearnError(f"{where}: an id must be an integer or a string, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and not value.strip():
        raise UnlearnError(f"{where}: empty string id")
    return value


def read_ids(path: str | Path) -> list[SampleId]:
    """The ids of a deletion request file, in file order, duplicates removed; an empty or unreadable file is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UnlearnError(f"cannot read the id file {path}: {e.strerror or e}") from None
    ids: list[SampleId] = []
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise UnlearnError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); expected a list of ids") from None
        if not isinstance(values, list):
            raise UnlearnError(f"{path} must hold a JSON list of ids, got {type(values).__name__}")
        ids = [_typed(v, f"{path} item {i}") for i, v in enumerate(values)]
    elif suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                raise UnlearnError(f"{path} line {n} is not JSON: {line.strip()[:40]!r} (quote string ids: "
                                   f"\"abc-1\")") from None
            ids.append(_typed(value, f"{path} line {n}"))
    else:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                ids.append(int(line) if line.lstrip("-").isdigit() else line)
    if not ids:
        raise UnlearnError(f"the id file {path} holds no ids")
    return list(dict.fromkeys(ids))


def write_ids(path: str | Path, ids: Iterable[SampleId]) -> Path:
    """Write ids in the typed JSON Lines form (atomically)."""
    from .utils import atomic_write_text

    ids = [_typed(i, "write_ids") for i in ids]
    atomic_write_text(path, "".join(json.dumps(i) + "\n" for i in ids), private=True)  # raw ids: owner-only
    return Path(path)


def check_ids_file(ids: str | os.PathLike) -> Path:
    """The id file of a deletion request, which must exist (checked before anything heavy loads)."""
    path = Path(ids)
    if path.exists() and not path.is_file():  # a folder, a FIFO, a device: reading it could block or mislead
        raise UnlearnError(f"the id file {os.fspath(ids)!r} is not a regular file (a folder, FIFO or device); write "
                           "the ids to a file, one per line (ids.jsonl: 3600 or \"abc-1\" per line)")
    if not path.is_file():
        raise UnlearnError(f"the id file {os.fspath(ids)!r} does not exist; write one id per line "
                           "(ids.jsonl: 3600 or \"abc-1\" per line)")
    return path


def load_request_ids(ids) -> list:
    """The ids of a deletion request: a file (typed JSON Lines, JSON list, or one per line) or an iterable of ids."""
    if isinstance(ids, (str, os.PathLike)):
        try:
            return read_ids(check_ids_file(ids))
        except RecursionError:
            raise UnlearnError(f"the id file {os.fspath(ids)!r} is nested too deeply: write one id per line") from None
    try:
        values = list(dict.fromkeys(ids))
    except TypeError:
        raise UnlearnError(f"ids must be a file or a list of ids, got {type(ids).__name__}") from None
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, str)) or v == ""]
    if bad:
        raise UnlearnError(f"ids must be integers or non-empty strings, got {bad[0]!r}")
    if not values:
        raise UnlearnError("the deletion request holds no ids")
    return values


def check_positive(**options) -> None:
    """``check_positive(lr=args.lr, epochs=args.epochs)``: each given value (not None) must be > 0."""
    for name, value in options.items():
        if value is not None and not value > 0:
            raise UnlearnError(f"--{name.replace('_', '-')} must be > 0, got {value}")


@dataclass(frozen=True)
class Range:
    """Where a numeric option's value may lie: ``low < value`` (``low <= value`` unless ``low_open``), likewise
    ``high``; ``unset`` is the value that means "not given" (``max_steps=-1``: train by epochs)."""

    low: float | None = 0
    high: float | None = None
    low_open: bool = True
    high_open: bool = False
    unset: float | None = None
    hint: str = ""

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a finite number"

    def holds(self, value) -> bool:
        import math

        if isinstance(value, float) and not math.isfinite(value):
            return False
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok


POSITIVE = Range()
NON_NEGATIVE = Range(low_open=False)
FRACTION = Range(0, 1, low_open=False)  # [0, 1]
PROBABILITY = Range(0, 1, high_open=True)  # (0, 1)
# Every numeric option of every command, by its destination name (the same name means the same thing in every
# command): an option not listed must be > 0. The one list the CLI (before anything heavy loads) and the Python
# entry points (check_options) read.
OPTION_RANGES: dict[str, Range] = {
    "max_steps": Range(unset=-1, hint="leave it out to train for the epoch count"),
    "seed": NON_NEGATIVE, "eval_rows": NON_NEGATIVE, "max_retain_rows": NON_NEGATIVE, "layer_id": NON_NEGATIVE,
    "skip_first": NON_NEGATIVE, "lambda_forget": NON_NEGATIVE, "lambda_retain": NON_NEGATIVE, "gamma": NON_NEGATIVE,
    "stop_target": Range(None), "retain_loss_eps": NON_NEGATIVE, "retain_tolerance": NON_NEGATIVE,
    "power_iters": NON_NEGATIVE, "oversample": NON_NEGATIVE, "beta1": NON_NEGATIVE, "beta2": NON_NEGATIVE,
    "steering_coeff": NON_NEGATIVE, "train_last_layers": POSITIVE,
    "dual_warmup_ratio": FRACTION, "alpha": PROBABILITY, "validation_fraction": Range(0, 1, low_open=False,
                                                                                   high_open=True),
    "fraction": PROBABILITY, "rho": PROBABILITY, "hoeffding_delta": PROBABILITY,
    "energy": Range(0, 1), "retain_energy": Range(0, 1),
    "scale": Range(None), "port": Range(0, 65535, low_open=False),
}


def option_range(name: str) -> Range:
    return OPTION_RANGES.get(name, POSITIVE)


def range_error(flag: str, name: str, value) -> UnlearnError | None:
    """The one-line error for ``value`` of option ``flag`` (destination ``name``) out of its range, else None."""
    rule = option_range(name)
    if value is None or isinstance(value, bool) or value == rule.unset or rule.holds(value):
        return None
    hint = f" ({rule.hint})" if rule.hint else ""
    return UnlearnError(f"{flag} must be {rule.describe()}{hint}, got {value}")


def check_options(**values) -> None:
    """``check_options(max_steps=0, learning_rate=1e-5)``: each value (None: not given) in its range from
    :data:`OPTION_RANGES`, refused in one line naming the option as the CLI spells it."""
    for name, value in values.items():
        error = range_error("--" + name.replace("_", "-"), name, value)
        if error is not None:
            raise error


def check_repo_id(repo_id: str | None) -> None:
    if repo_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise UnlearnError(f"repo id {repo_id!r} must look like 'org/name'")


def check_existing_folder(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise UnlearnError(f"{what} {os.fspath(path)!r} does not exist")
    if not p.is_dir():
        raise UnlearnError(f"{what} {os.fspath(path)!r} is not a folder")
    return p


# -- output folders --------------------------------------------------------------------------------------------
def check_new_output(path: str | os.PathLike, *, overwrite_marker: str | None = None, overwrite: bool = False,
                     marker_check: Callable[[Path], None] | None = None) -> Path:
    """An output folder that is new or empty; with ``overwrite``, one this library wrote (it holds ``overwrite_marker``).

    Never deletes a folder the library did not write: a non-empty folder without the marker is an error, and
    ``marker_check(marker_path)`` raises :class:`UnlearnError` when the file is merely named like the marker.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UnlearnError(f"output {os.fspath(path)!r} exists and is a file; choose a folder name")
    _check_nothing_stranded(p)
    if p.is_dir() and any(p.iterdir()):
        if overwrite and overwrite_marker and (p / overwrite_marker).is_file():
            if marker_check is not None:
                marker_check(p / overwrite_marker)
            return p
        if overwrite and overwrite_marker:  # replacing was asked for (or is the command's way): this is not ours
            raise UnlearnError(f"output folder {os.fspath(path)!r} exists, is not empty and is not an earlier output "
                               f"of this command (it holds no {overwrite_marker}); only such an output is replaced: "
                               "choose a new folder")
        hint = " (or --overwrite to replace an earlier output of the same command)" if overwrite_marker else ""
        raise UnlearnError(f"output folder {os.fspath(path)!r} exists and is not empty; choose a new folder{hint}")
    return p


def _check_nothing_stranded(p: Path) -> None:
    """Refuse while an earlier output sits where :func:`output_folder` moves one aside to replace it (a command killed
    by SIGKILL, or a power cut, before it put it back or removed it): it would otherwise be forgotten there. (Another
    command replacing the same output right now is refused too: two commands must not write one folder.)"""
    if not p.parent.is_dir():
        return
    for aside in sorted(p.parent.glob(f".{glob.escape(p.name)}.previous-*")):
        if not aside.is_dir():
            continue
        if not (aside / p.name).exists():  # killed right after making it: nothing in it
            with contextlib.suppress(OSError):
                aside.rmdir()
            continue
        left = f"rm -r {shlex.quote(str(p))} && " if p.exists() else ""
        raise UnlearnError(f"a command replacing {p} was killed before it finished (or is still running): the output "
                           f"it replaced is in "
                           f"{aside / p.name}{' and ' + str(p) + ' holds what the killed command wrote' if left else ''}"
                           f"; keep the earlier output ({left}mv {shlex.quote(str(aside / p.name))} "
                           f"{shlex.quote(str(p))} && rmdir {shlex.quote(str(aside))}) or discard it (rm -r "
                           f"{shlex.quote(str(aside))}), then run again")


def has_files(path: Path) -> bool:
    return any(f.is_file() or f.is_symlink() for f in path.rglob("*"))


def remove_empty_dirs(root: str | os.PathLike, *, include_root: bool = False) -> None:
    """Remove folders under ``root`` that hold no file (deepest first); ``root`` too with ``include_root``."""
    root = Path(root)
    if not root.is_dir():
        return
    for d in sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()  # only succeeds when empty
    if include_root:
        with contextlib.suppress(OSError):
            root.rmdir()


@contextlib.contextmanager
def output_folder(path: str | os.PathLike, *, marker: str | None = None, overwrite: bool = False,
                  marker_check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Create an output folder for a command and clean up after it.

    On success, empty sub-folders are removed. On failure, a folder the command created is removed with what it
    wrote (nothing half-written stays behind); a folder that existed before is left as it was found, minus empty
    sub-folders. ``marker`` names the file that makes an earlier output replaceable with ``overwrite``: that output
    is moved aside while the command runs, deleted when it succeeds and put back when it fails.
    """
    p = check_new_output(path, overwrite_marker=marker, overwrite=overwrite, marker_check=marker_check)
    previous = None
    created = False
    try:
        if p.is_dir() and any(p.iterdir()):  # an earlier output of the same command, replaced on request
            import tempfile

            previous = Path(tempfile.mkdtemp(prefix=f".{p.name}.previous-", dir=p.parent))
            p.rename(previous / p.name)
        created = not p.exists()
        p.mkdir(parents=True, exist_ok=True)
        yield p
    except BaseException:
        if created and not os.environ.get("HF_UNLEARN_DEBUG"):
            shutil.rmtree(p, ignore_errors=True)
        else:
            remove_empty_dirs(p)
        if previous is not None:  # (a signal may have come before the earlier output was moved aside)
            if p.exists() and (previous / p.name).exists():  # HF_UNLEARN_DEBUG kept the failed output beside it
                p.rename(p.with_name(f"{p.name}.failed-{previous.name.rsplit('-', 1)[-1]}"))
            if (previous / p.name).exists():
                (previous / p.name).rename(p)
            previous.rmdir()
        raise
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    remove_empty_dirs(p)


def remove_if_empty(paths: Iterable[str | os.PathLike | None]) -> None:
    """After a failed command: remove each of ``paths`` that is a folder holding no file at all."""
    for path in paths:
        if path is None:
            continue
        p = Path(path)
        if p.is_dir() and not has_files(p):
            shutil.rmtree(p, ignore_errors=True)
