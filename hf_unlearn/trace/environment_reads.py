"""The environment variables a run's own code read while it trained, and whether a deleting process holds the same.

A recorded callback, a trainer subclass's ``compute_loss`` or a collator may act on ``os.environ`` (``if
os.environ.get("CLIP"): args.max_grad_norm = 0.05``). Replays run that code again, in the deleting process: where a
variable it reads differs there, the replay and the oracle both follow the deleting process and agree with each other,
not with the run that trained, and the environment probe sees it only at the steps it re-runs. So the recording notes
every variable that code outside the frameworks read while ``train()`` ran (``os.environ[...]``, ``.get``, ``in``,
``os.getenv``, and the same through ``os.environb`` and ``os.getenvb``; a read through ``os.environ``'s own class, so
code that holds ``os.environ`` under another name is seen too), with a keyed digest of its value (the value is not
written: it can be a secret); a deletion compares them before any compute, and the replay notes the reads its own run
of that code makes.

Reads by installed packages (transformers, accelerate, torch, a logging integration: files under site-packages)
while the steps run are noted too, marked as the frameworks' (:func:`note_frameworks`: transformers reads
``TRANSFORMERS_SDPA_FORCE_GQA`` at every attention call) and compared where a replay runs them again; what they read
while setting up, and reads by this library and the standard library, are left out: configuration (paths, logging,
launchers, API keys), whose numeric settings are the environment probe's and
:data:`~hf_unlearn.trace.digests.NUMERIC_ENV`'s business. So is code of the user's own that is pip-installed rather than run from the project, and reads from C
(``getenv`` in a native library): the probe, which re-runs recorded steps in the deleting process, is their
guarantee.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import os
import sys
import threading

# the frameworks' and the standard library's own reads are not a program's: configuration, not behaviour. Installed
# packages (their files under site-packages) are frameworks too: transformers, accelerate, torch, a logging
# integration; this library wherever it is installed from
FRAMEWORKS = ("hf_unlearn",)
INSTALLED = ("site-packages", "dist-packages")
# what a launcher sets per process or per launch (a callback acting on rank 0 only reads LOCAL_RANK): each process's
# behaviour is compared by its own state fingerprints, and the world size is checked where a deletion starts
LAUNCH = ("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE",
          "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_",
          "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")
_PASS_THROUGH = frozenset({"os", "collections.abc", "_collections_abc", __name__})

_lock = threading.Lock()
_bulk = threading.local()  # this thread's whole-environment iterations (depth, pending) and unwatched() depth
_watching: list[dict] = []  # the read logs open now (a recording, a replay): key -> {"value", "by"}
_frameworks: list[dict] = []  # those of them that note the frameworks' reads too (:func:`note_frameworks`)


class _WatchedEnviron(type(os.environ)):
    """``os.environ``'s own class with one change: a read, while a log is open, is noted with the module that made
    it. Mapping's ``get``, ``__contains__`` and ``os.getenv`` all read through ``__getitem__``."""

    def __getitem__(self, key):
        try:
            value = super().__getitem__(key)
        except KeyError:
            if _watching and not _in_bulk(key):
                _note(key, None)
            raise
        if _watching and not _in_bulk(key):
            _note(key, value)
        return value

    def __setitem__(self, key, value):
        """A write, while a log is open, of a variable the program's code read before: its values are noted
        (``"set"``). They are the program's own running state: a replay running that code writes them too, and a
        deletion in the training process finds one there; both are the recording's values, not another
        environment's."""
        super().__setitem__(key, value)
        if _watching:
            name = os.fsdecode(key) if isinstance(key, bytes) else str(key)
            with _lock:
                for log in _watching:
                    if name in log:
                        log[name].setdefault("set", []).append(os.fsdecode(value))

    def __iter__(self):
        """Reading the whole environment (``os.environ.copy()``, ``{**os.environ}``, ``.items()``) reads every
        variable, during the iteration (``.items()``) or right after it, key by key in its order
        (``dict(os.environ)``). By a framework or the standard library (a copy handed to a subprocess), not noted.
        By the program's own code, every variable is noted (:func:`_note_whole`): that code may act on any of them,
        and no probe of the first steps sees what it does later (``os.environ.copy()`` in a callback from step 3). A
        deletion in another process is then refused wherever a variable differs (``PWD`` included): read the
        variables the program needs by name instead."""
        reader = None
        if _watching and not getattr(_bulk, "depth", 0) and not getattr(_bulk, "quiet", 0):
            reader = _reader(sys._getframe(1), through_stdlib=False)
        _bulk.depth = getattr(_bulk, "depth", 0) + 1
        keys = []
        try:
            for k in super().__iter__():
                keys.append(k)
                yield k
        finally:
            _bulk.depth -= 1
        _bulk.pending = collections.deque(keys)  # a complete iteration: its keys may be read next, in order
        if reader is not None:
            _note_whole(self, keys, reader)


# The command line is read like a variable: ``if "--aux" in sys.argv`` in a loss acts on the training launch's
# arguments, and a deleting process (``hf-unlearn forget ...``) has others, so a read of ``sys.argv`` by the program's
# code while it trains is noted under this name (its value: the arguments joined by NUL) and refuses a deletion, whose
# replay cannot run under the recording's command line. Seen: indexing, slicing, ``in``, ``len``, iteration,
# ``index``/``count`` on ``sys.argv`` as the block found it; not seen: a reference to the list taken before training
# (``ARGV = sys.argv`` at import: a module global, which the sealed globals compare) and C code reading the list's
# items directly (``" ".join(sys.argv)``).
ARGV = "sys.argv"


def argv_text(argv=None) -> str:
    return "\0".join(sys.argv if argv is None else argv)


class _WatchedArgv(list):
    """``sys.argv`` while a log is open: every read by the program's code is noted as :data:`ARGV`."""


def _noting(name: str):
    read = getattr(list, name)

    def method(self, *args):
        if _watching:
            _note(ARGV, argv_text(list.__iter__(self)))
        return read(self, *args)

    method.__name__ = name
    return method


for _name in ("__getitem__", "__iter__", "__contains__", "__len__", "index", "count"):
    setattr(_WatchedArgv, _name, _noting(_name))


def _in_bulk(key) -> bool:
    """Whether this read is part of reading the whole environment (see ``_WatchedEnviron.__iter__``)."""
    if getattr(_bulk, "depth", 0):
        return True
    pending = getattr(_bulk, "pending", None)
    if pending:
        if pending[0] == key:
            pending.popleft()
            return True
        pending.clear()
    return False


def is_user_code(module: str | None, filename: str | None) -> bool:
    """Whether code is the program's own: not this library's, the standard library's or an installed package's."""
    top = (module or "").split(".", 1)[0]
    return bool(top) and top not in FRAMEWORKS and top not in sys.stdlib_module_names \
        and not any(p in (filename or "") for p in INSTALLED)


def _reading_frame(frame, through_stdlib: bool):
    """The frame that made a read, from the frame that called the watched method: ``os``'s own helpers are passed
    through (``os.getenv``), and with ``through_stdlib`` every standard-library frame (``argparse`` reading
    ``sys.argv`` for the program's ``parse_known_args()``: the program acts on what it returns)."""
    while frame is not None:
        name = frame.f_globals.get("__name__") or "?"
        if name not in _PASS_THROUGH and not (through_stdlib and name.split(".", 1)[0] in sys.stdlib_module_names):
            break
        frame = frame.f_back
    return frame


def _reader(frame, through_stdlib: bool) -> str | None:
    """The module of the program's code that made a read (None: a framework's or the standard library's own)."""
    frame = _reading_frame(frame, through_stdlib)
    if frame is None:
        return None
    module = frame.f_globals.get("__name__") or "?"
    return module if is_user_code(module, frame.f_code.co_filename) else None


def _framework(frame) -> str | None:
    """The installed package (not this library) whose code is ``frame`` (None: the standard library's, this
    library's, or the program's)."""
    module = frame.f_globals.get("__name__") or "?"
    top = module.split(".", 1)[0]
    if top in FRAMEWORKS or top in sys.stdlib_module_names or not any(p in frame.f_code.co_filename for p in INSTALLED):
        return None
    return module


def _note(key, value) -> None:
    if isinstance(key, bytes):  # a read through os.environb (os.getenvb): the same variable
        key, value = os.fsdecode(key), None if value is None else os.fsdecode(value)
    if str(key).startswith(LAUNCH) or getattr(_bulk, "quiet", 0):
        return
    frame = _reading_frame(sys._getframe(2), through_stdlib=key == ARGV)  # one walk, at every read (hot: per call)
    if frame is None:
        return
    module = frame.f_globals.get("__name__") or "?"
    if is_user_code(module, frame.f_code.co_filename):
        _log(str(key), value, module)
    elif _frameworks and key != ARGV:
        framework = _framework(frame)
        if framework is not None:
            with _lock:
                for log in _frameworks:
                    log.setdefault(str(key), {"value": value, "by": framework, "framework": True})


# A whole read of the environment by the program's code (see ``_WatchedEnviron.__iter__``) is noted under this name
# too, its value the sorted names of the variables it met: a variable set in a deleting process only is not among
# the per-variable reads, and the program may act on it.
ENVIRON = "os.environ"


def _names_text(names) -> str:
    return "\0".join(sorted(n for n in names if not n.startswith(LAUNCH)))


def _note_whole(env, keys, module: str) -> None:
    """Note every variable of a whole read of the environment (``env``: ``os.environ`` or ``os.environb``)."""
    decoded = []
    for k in keys:
        name = os.fsdecode(k) if isinstance(k, bytes) else str(k)
        if name.startswith(LAUNCH):
            continue
        decoded.append(name)
        try:  # read under the hood: not a read of its own
            value = env.decodevalue(env._data[env.encodekey(k)])
        except KeyError:  # removed since
            value = None
        _log(name, None if value is None else os.fsdecode(value), module)
    _log(ENVIRON, _names_text(decoded), module)


def _log(key: str, value, module: str) -> None:
    with _lock:
        for log in _watching:
            log.setdefault(key, {"value": value, "by": module})


@contextlib.contextmanager
def watching():
    """Note the environment variables that code outside the frameworks reads inside the block: yields
    ``{name: {"value": str | None (unset), "by": module}}``, the first read of each."""
    for env in (os.environ, getattr(os, "environb", None)):  # environb (os.getenvb): the same variables, as bytes
        if env is not None and type(env) is not _WatchedEnviron:
            env.__class__ = _WatchedEnviron  # the same object (every module's reference to it stays valid)
    log: dict = {}
    argv = sys.argv
    if type(argv) is list:
        sys.argv = _WatchedArgv(argv)
    with _lock:
        _watching.append(log)
    try:
        yield log
    finally:
        with _lock:
            _watching.remove(log)
            if any(f is log for f in _frameworks):
                _frameworks[:] = [f for f in _frameworks if f is not log]
        if type(sys.argv) is _WatchedArgv and type(argv) is list:
            argv[:] = list.__iter__(sys.argv)  # what the block wrote into it, in the caller's own list
            sys.argv = argv


def note_frameworks(log: dict) -> None:
    """From now on, ``log`` (open in :func:`watching`) notes the installed packages' reads too, each marked
    ``"framework"``: called when a recording's first optimizer step starts and when a replay starts. A framework reads
    variables that change what it computes while training runs (transformers' ``TRANSFORMERS_SDPA_FORCE_GQA`` at
    every attention call, accelerate's and SageMaker's switches), and a deleting process that holds them otherwise
    computes otherwise on rows the probe may never re-run (a backward that differs only past a length the first steps
    never reach). What they read while setting up (before the first step) is configuration a replay sets up again
    from the recorded arguments, and is not noted. Compared where a replay runs them again (:func:`unrecorded`: the
    environment probe, before a deletion's compute), not before it: a framework sets some of them itself from the
    arguments as it sets up (``ACCELERATE_USE_FSDP``), which a deleting process has not done yet."""
    with _lock:
        if not any(f is log for f in _frameworks):
            _frameworks.append(log)


@contextlib.contextmanager
def unwatched():
    """Reads inside the block are not noted: code a replay never runs (a callback replays do not run again, whose
    changes the guards check instead), so what it reads cannot make a replay act otherwise."""
    _bulk.quiet = getattr(_bulk, "quiet", 0) + 1
    try:
        yield
    finally:
        _bulk.quiet -= 1


def quiet() -> bool:
    """Whether this thread runs code a replay never runs (inside :func:`unwatched`): what it reads is not noted."""
    return bool(getattr(_bulk, "quiet", 0))


def value_digest(key: bytes, name: str, value: str | None) -> str | None:
    """A keyed digest of a variable's value (None: unset): equal values give equal digests under one run key,
    and the value cannot be read back from it."""
    if value is None:
        return None
    return hmac.new(key, b"hf_unlearn.environment_read.v1\0" + name.encode() + b"\0" + value.encode(),
                    hashlib.sha256).hexdigest()[:32]


def sealed(key: bytes, log: dict) -> dict:
    """What the header keeps of a recording's reads: ``{name: {"value": digest | None, "by": module}}``."""
    return {name: {"value": value_digest(key, name, read["value"]), "by": read["by"],
                   **({"set": sorted({value_digest(key, name, v) for v in read["set"]})} if read.get("set") else {}),
                   **({"framework": True} if read.get("framework") else {})}
            for name, read in sorted(log.items())}


def process_reads(key: bytes, logs: list[dict], earlier: dict | None = None) -> dict:
    """``{rank: sealed reads}`` of the processes of a launch (``logs``: every process's :func:`watching` log, in rank
    order) whose reads differ from process 0's (a callback acting on process 1 only reads there only); ``earlier``:
    a resumed run's, kept. Process 0's are the header's ``environment_reads``."""
    earlier = earlier or {}
    first = {**sealed(key, logs[0]), **(earlier.get("0") or {})}
    out = {}
    for rank, log in enumerate(logs[1:], 1):
        mine = {**sealed(key, log), **(earlier.get(str(rank)) or {})}
        if mine != first:
            out[str(rank)] = mine
    return out


def recorded_reads(fidelity: dict, rank: int) -> dict | None:
    """The reads process ``rank`` of a deleting launch is compared with: the recording's process of that rank's where
    they differed from process 0's, else process 0's (None: a run recorded before reads were noted)."""
    reads = fidelity.get("environment_reads")
    if reads is None:
        return None
    return (fidelity.get("process_environment_reads") or {}).get(str(rank), reads)


def _recorded(key: bytes, name: str, read: dict, value: str | None) -> bool:
    """Whether ``value`` is one the recording's code met: the value it first read, or one it set itself."""
    digest = value_digest(key, name, value)
    return digest == read.get("value") or (digest is not None and digest in (read.get("set") or ()))


def differences(key: bytes, recorded: dict, here: dict | None = None, frameworks: bool = False) -> list[str]:
    """The recorded reads whose variable this process holds otherwise, in words (``here``: the environment;
    default ``os.environ``). The frameworks' reads (:func:`note_frameworks`) only with ``frameworks``: where the
    frameworks have set up as the recording's did (a resumed recording, a failed probe naming its cause)."""
    here = os.environ if here is None else here
    out = []
    for name, read in sorted(recorded.items()):
        if read.get("framework") and not frameworks:
            continue
        now = argv_text() if name == ARGV else _names_text(here) if name == ENVIRON else here.get(name)
        if not _recorded(key, name, read, now):
            if name == ARGV:
                out.append(f"{ARGV}, the command line (read by {read.get('by', '?')})")
                continue
            if name == ENVIRON:
                out.append(f"{ENVIRON}, the names of the variables (read whole by {read.get('by', '?')}: a variable "
                           "is set here that was not while recording, or the reverse; read the variables the "
                           "program needs by name instead)")
                continue
            was = "unset" if read.get("value") is None else "set"
            is_ = "unset" if now is None else ("set to another value" if read.get("value") is not None else "set")
            out.append(f"{name} (read by {read.get('by', '?')}: {was} while recording, {is_} here)")
    return out


def unrecorded(key: bytes, recorded: dict, log: dict) -> list[str]:
    """A replay's reads (``log``, from :func:`watching`) that differ from the recording's, or of a variable the
    recording's code never read (its value then is unknown), in words."""
    out = []
    for name, read in sorted(log.items()):
        if name not in recorded:
            if not read.get("framework"):  # a framework's path the recording did not take reads other settings
                out.append(f"{name} (read by {read['by']}, which the recording's code never read)")
        elif not _recorded(key, name, recorded[name], read["value"]):
            out.append(f"{name} (read by {read['by']}: its value differs from the recording's)")
    return out


# ---- module globals fixed at import ----------------------------------------------------------------------------
# The same holds for what code a replay runs again read from the environment (or a file) when its module was
# imported: ``CLIP = os.environ.get("CLIP")`` at the top of a callbacks module. A deleting process imports the module
# again, to rebuild the callback, and the constant may take another value there. The recording seals keyed digests of
# those globals (:func:`hf_unlearn.trace.digests.replayed_globals` lists them); a replay compares them when it has
# rebuilt the recorded callbacks, before any compute.
def sealed_globals(key: bytes, entries: dict) -> dict:
    """``{entry: keyed digest}`` of :func:`~hf_unlearn.trace.digests.replayed_globals`' entries."""
    return {name: value_digest(key, name, text) for name, text in sorted(entries.items())}


def globals_differences(key: bytes, recorded: dict, entries: dict) -> list[str]:
    """The recorded globals this process's modules hold otherwise (both sides name them), in words."""
    return [name.replace(" global ", "'s module global ", 1) for name, text in sorted(entries.items())
            if name in recorded and value_digest(key, name, text) != recorded[name]]
