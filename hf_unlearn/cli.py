"""The ``hf-unlearn`` console script.

Each subcommand group lives in ``hf_unlearn/commands/<group>.py`` and exposes ``register(subparsers)``; a
command's handler takes the parsed args and returns an exit code. Heavy imports happen inside handlers so
``hf-unlearn --help`` is instant. Every error prints one line and exits 1, never a traceback (set
``HF_UNLEARN_DEBUG=1`` for it); an output folder a failed command created and left empty is removed. Before a
command runs, :mod:`hf_unlearn.runtime` sets thread defaults that hold up on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from .version import __version__

GROUPS = {
    "forget": "honour a deletion request end to end: delete, prove, publish (one command)",
    "demo": "the whole pipeline offline in minutes: record, delete exactly, unlearn, publish, verify",
    "requests": "a deletion service: a request ledger, exact deletion in batches, signed receipts",
    "trace": "exact deletion: inspect, cost, prove, redact, replay, oracle, verify a recorded run",
    "unlearn": "approximate unlearning: MASC and the baselines",
    "edit": "closed-form weight edits (QR-Erase)",
    "analyze": "diagnostics before and after unlearning",
    "eval": "TOFU / MUSE-News evaluation",
    "hub": "publish to and verify on the Hugging Face Hub",
}


# Help for options that a command module registered without one: the same option means the same thing in every
# group, so its text lives here once ("GROUP COMMAND --flag" keys win over plain "--flag" keys). A test checks that
# every option of every command ends up with a help text.
COMMON_HELP = {
    "run": "a recorded run: the trace_dir of a TraceRecordingTrainer (or a replay's output)",
    "model": "Hub id, local folder or .gguf file",
    "repo": "ORG/NAME on the Hub",
    "output_dir": "the output folder to publish (weights, tokenizer, unlearning_info.json)",
    "--forget": "the ids to delete: ids.jsonl (one JSON id per line: 3600 or \"abc-1\"), a JSON list, or one per line",
    "--json": "print the report as JSON",
    "--out": "output folder (must not exist or be empty)",
    "--seed": "random seed (default %(default)s)",
    "--batch-size": "rows per forward pass (default %(default)s)",
    "--forget-split": "TOFU forget split (default %(default)s)",
    "--max-new-tokens": "tokens generated per answer (default %(default)s)",
    "--epochs": "training epochs (default %(default)s)",
    "--lr": "learning rate (default %(default)s)",
    "--train-batch-size": "rows per training step (default %(default)s)",
    "--grad-accum": "gradient accumulation steps (default %(default)s)",
    "--label-mode": "uniform: any choice (the true one included); flipped: always a wrong one (default %(default)s)",
    "--verbmem-max-new-tokens": "tokens generated per verbatim-memorisation prompt (default %(default)s)",
    "--knowmem-max-new-tokens": "tokens generated per knowledge-memorisation answer (default %(default)s)",
    "--bits": "4 (NF4/FP4) or 8 (LLM.int8) (default %(default)s)",
    "--benchmark": "which evaluation to run before and after quantisation (default %(default)s)",
    "--license": "license in the card metadata (default %(default)s)",
    "--port": "port to listen on (default %(default)s; 0 picks a free one)",
    "--host": "interface to listen on (default %(default)s: this machine only)",
    "eval plot-tradeoff --out": "the plot file to write (default %(default)s)",
    "trace oracle --out": "output folder of the oracle run (must not exist or be empty)",
}


def _fill_help(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _fill_help(sub, (*path, name))
            continue
        if action.help or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        keys = [*action.option_strings] or [action.dest]
        for key in keys:
            text = COMMON_HELP.get(" ".join((*path, key))) or COMMON_HELP.get(key)
            if text:
                action.help = text
                break


START_HERE = """\
where to start:
  hf-unlearn demo          the whole pipeline offline in minutes (no data, no network): run this first

with your own training script (exact deletion):
  1. record   swap one line: TraceRecordingTrainer instead of Trainer (trace_recording(SFTTrainer) for TRL);
              the run is written to trace_dir (default OUTPUT_DIR/trace)
  2. forget   hf-unlearn forget RUN --ids FILE --out OUT --oracle    (replays without the rows, proved bit for bit)
  3. publish  add --repo ORG/NAME to the forget command, or: hf-unlearn hub push OUT/model --repo ORG/NAME --deletion

without a recorded run: hf-unlearn forget MODEL --ids FILE --data DATA --out OUT --method masc (approximate)
"""

# what a group's --help adds below its commands: the order they are used in
GROUP_EPILOG = {
    "requests": "order: `requests add RUN --ids FILE` first (records a request in the run's ledger), then `requests "
                "serve RUN --exact` (or --approximate, --due) honours the pending ones; list/status/plan show them, "
                "verify checks a receipt",
    "trace": "order: inspect, cost (what a deletion re-executes), redact, replay, oracle, verify; `hf-unlearn forget "
             "RUN --ids FILE --out OUT` runs redact+replay(+oracle with --oracle) in one command; compact is "
             "housekeeping for a sealed run",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-unlearn",
        description="Machine unlearning for language models, the Hugging Face way.",
        epilog=START_HERE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hf_unlearn {__version__}")
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    for group, help_text in GROUPS.items():
        module = importlib.import_module(f"hf_unlearn.commands.{group}")
        group_parser = sub.add_parser(group, help=help_text, description=help_text, epilog=GROUP_EPILOG.get(group))
        group_parser.set_defaults(func=None, _parser=group_parser)
        module.register(group_parser)
    _fill_help(parser)
    return parser


OUTPUT_OPTIONS = ("out", "output_dir")
NO_TORCH = {("hub", "serve")}  # commands that never touch torch: no thread set-up (keeps them fast to start)


def _chosen_actions(parser: argparse.ArgumentParser, args) -> list[argparse.Action]:
    """The options of the command that was parsed (the group's and the subcommand's)."""
    actions = []
    while parser is not None:
        actions += parser._actions
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        parser = sub.choices.get(getattr(args, sub.dest, None)) if sub is not None else None
    return actions


def check_numeric_options(parser: argparse.ArgumentParser, args) -> None:
    """Every numeric option the user gave (a value other than its default) in the range
    :data:`hf_unlearn.validation.OPTION_RANGES` gives it, else one :class:`UnlearnError` line."""
    from .validation import range_error

    for action in _chosen_actions(parser, args):
        if action.type not in (int, float) or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        for item in value if isinstance(value, list) else [value]:
            error = range_error(action.option_strings[0], action.dest, item)
            if error is not None:
                raise error


def main(argv: list[str] | None = None) -> int:
    from .runtime import prepare_environment, quiet_optional_backends

    prepare_environment()
    quiet_optional_backends()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.group is None:
        parser.print_help()
        return 2
    if getattr(args, "func", None) is None:
        args._parser.print_help()
        return 2
    new_outputs = [getattr(args, name) for name in OUTPUT_OPTIONS
                   if isinstance(getattr(args, name, None), str) and not os.path.exists(getattr(args, name))]
    debug = bool(os.environ.get("HF_UNLEARN_DEBUG"))
    with _terminate_as_exception():
        return _run(args, parser, new_outputs, debug)


def _run(args, parser, new_outputs: list[str], debug: bool) -> int:
    from .errors import UnlearnError

    try:
        check_numeric_options(parser, args)  # before anything heavy (torch) loads, for every command
        if getattr(args, "precheck", None) is not None:  # a command's own cheap checks (names, files), likewise
            args.precheck(args)
        if (args.group, getattr(args, "command", None)) not in NO_TORCH:
            from .runtime import configure_threads

            configure_threads(getattr(args, "threads", None))
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _cleanup(new_outputs)
        print("hf-unlearn: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        _cleanup(new_outputs)
        print("hf-unlearn: terminated (SIGTERM): what it was writing is removed, an output it was replacing is put "
              "back", file=sys.stderr)
        return 128 + 15
    except (UnlearnError, OSError) as e:
        _cleanup(new_outputs)
        if debug:
            raise
        if isinstance(e, UnlearnError):
            msg = str(e)
        elif getattr(e, "filename", None):
            msg = f"{e.strerror or e}: {e.filename}"
        else:
            msg = _first_line(e)
        print(f"hf-unlearn: error: {msg}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an undeclared or uninstalled dependency: what to install, in one line
        _cleanup(new_outputs)
        if debug:
            raise
        from .requirements import missing_dependency_message

        msg = missing_dependency_message(e.name) if e.name else _first_line(e)
        print(f"hf-unlearn: error: {msg}", file=sys.stderr)
        return 1
    except Exception as e:  # anything else is still one line (a bug to report, or a library's own error)
        _cleanup(new_outputs)
        if debug:
            raise
        print(f"hf-unlearn: error: {type(e).__name__}: {_first_line(e)} (HF_UNLEARN_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


class Terminated(BaseException):
    """SIGTERM, raised where the command is: a scheduler's preemption, ``timeout``, or a launcher (torchrun,
    ``accelerate launch``) stopping the other processes when one failed. Its default action ends the process at once,
    leaving the output folder half-written and an output that ``--overwrite`` was replacing moved aside; as an
    exception it unwinds like Ctrl-C, and every output folder cleans up after itself."""


@contextlib.contextmanager
def _terminate_as_exception():
    """SIGTERM raises :class:`Terminated` while a command runs (then is ignored, so that the clean-up finishes), where
    its handler is the default one and this is the main thread; the default is restored afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _cleanup(new_outputs: list[str]) -> None:
    from .validation import remove_if_empty

    remove_if_empty(new_outputs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
