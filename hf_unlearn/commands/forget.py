"""`hf-unlearn forget MODEL_OR_RUN --ids request.jsonl --out OUT [--method ...] [--repo org/name]`.

The options are generated from :class:`hf_unlearn.deletion.ForgetConfig` (one list of options for the Python call and
the command, with the same help texts). Ends with a summary table; ``OUT/receipt.json`` is the record.
"""

from __future__ import annotations

import dataclasses
import typing

from ..deletion import EXACT, ForgetConfig, forget, parse_method_args
from ..deletion.config import ALIASES  # the short spellings live with the options (refusals name them too)

EPILOG = """examples:
  hf-unlearn forget runs/ft/trace --ids request.jsonl --out deletion-1 --oracle --tokenizer ./my-model  # exact
  hf-unlearn forget runs/sft/trace runs/dpo/trace --ids request.jsonl --out deletion-2 --oracle  # a pipeline
  hf-unlearn forget ./my-model --ids request.jsonl --out forgot --method npo --data tofu
  hf-unlearn forget ./my-model --ids request.jsonl --out forgot --repo org/my-model   # + push and hub verify

methods: exact (recorded runs) and, for models, every method of `hf-unlearn unlearn` (default masc):
  {methods}
  their options (--method-arg KEY=VALUE) are listed by `hf-unlearn unlearn --method NAME --help`."""


def register(parser) -> None:
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    from ..methods.registry import method_names

    parser.epilog = EPILOG.format(methods=", ".join(method_names()))
    parser.add_argument("model_or_run", metavar="MODEL_OR_RUN", nargs="+",
                        help="a recorded run (trace folder: exact deletion) or a model: local folder, .gguf file or "
                             "Hub id; several recorded runs: a training pipeline's stages in training order (one run "
                             "that starts from another recorded run's output brings its pipeline along)")
    parser.add_argument("--ids", required=True, metavar="FILE",
                        help="the deletion request: ids.jsonl (one JSON id per line: 3600 or \"abc-1\"), a JSON list "
                             "or one id per line")
    parser.add_argument("--out", required=True, dest="output_dir", metavar="OUT",
                        help=_help(ForgetConfig, "output_dir"))
    hints = typing.get_type_hints(ForgetConfig)
    for f in dataclasses.fields(ForgetConfig):
        if f.name == "output_dir":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if f.name == "method_args":
            parser.add_argument("--method-arg", action="append", dest="method_args", metavar="KEY=VALUE",
                                help=_help(ForgetConfig, f.name) + " (repeatable)")
        elif f.name == "datasets":
            parser.add_argument("--dataset", action="append", dest="datasets", metavar="HUB_ID",
                                help=_help(ForgetConfig, f.name) + " (repeatable)")
        elif kind is bool:
            if f.default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help="turn off: " + _help(ForgetConfig, f.name))
            else:
                parser.add_argument(flag, action="store_true", help=_help(ForgetConfig, f.name))
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            parser.add_argument(flag, *ALIASES.get(f.name, ()), type=base, default=f.default, dest=f.name,
                                help=_help(ForgetConfig, f.name))
    parser.set_defaults(func=run, precheck=precheck)


def precheck(args) -> None:
    """What can be refused before torch loads (about 2 s): a method name that does not exist, a missing id file."""
    from ..errors import UnlearnError
    from ..methods.registry import method_names
    from ..validation import check_ids_file

    names = [EXACT, *method_names()]
    if args.method is not None and args.method not in names:
        raise UnlearnError(f"unknown --method {args.method!r}; choose from {', '.join(names)}")
    check_ids_file(args.ids)


def _help(cls, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name).replace("%", "%%")


def run(args) -> int:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ForgetConfig) if hasattr(args, f.name)}
    values["method_args"] = parse_method_args(args.method_args)
    sources = args.model_or_run if len(args.model_or_run) > 1 else args.model_or_run[0]
    receipt = forget(sources, args.ids, config=ForgetConfig(**values))
    if receipt is None:  # a process other than the main one of a multi-process launch: the main one reports
        return 0
    print("\n== summary")
    print(receipt.summary_table())
    print(f"receipt: {receipt.output_dir}/receipt.json")
    return 0 if receipt.ok else 1
