"""The ``hf-unlearn`` console script.

Each subcommand group lives in ``hf_unlearn/commands/<group>.py`` and exposes ``register(subparsers)``; a
command's handler takes the parsed args and returns an exit code. Heavy imports happen inside handlers so
``hf-unlearn --help`` is instant. Errors a user can cause print one line and exit 1 (set
``HF_UNLEARN_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__

GROUPS = {
    "demo": "run the end-to-end demo offline on a small local model",
    "trace": "exact deletion: inspect, cost, redact, replay, oracle, verify a recorded run",
    "unlearn": "approximate unlearning: MASC and the baselines",
    "edit": "closed-form weight edits (QR-Erase)",
    "analyze": "diagnostics before and after unlearning",
    "eval": "TOFU / MUSE-News evaluation",
    "hub": "publish to and verify on the Hugging Face Hub",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-unlearn",
        description="Machine unlearning for language models, the Hugging Face way.",
    )
    parser.add_argument("--version", action="version", version=f"hf_unlearn {__version__}")
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    for group, help_text in GROUPS.items():
        module = importlib.import_module(f"hf_unlearn.commands.{group}")
        group_parser = sub.add_parser(group, help=help_text, description=help_text)
        group_parser.set_defaults(func=None, _parser=group_parser)
        module.register(group_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import UnlearnError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.group is None:
        parser.print_help()
        return 2
    if getattr(args, "func", None) is None:
        args._parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hf-unlearn: interrupted", file=sys.stderr)
        return 130
    except (UnlearnError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if os.environ.get("HF_UNLEARN_DEBUG"):
            raise
        msg = str(e) if isinstance(e, UnlearnError) else f"{e.strerror or e}: {e.filename}"
        print(f"hf-unlearn: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
