"""CLI subcommand groups; each module exposes ``register(parser)`` for its group."""


def add_subcommands(parser):
    """The subparsers object of a group (commands inside a group are ``hf-unlearn GROUP CMD``)."""
    return parser.add_subparsers(dest="command", metavar="COMMAND")


def add_tofu_splits(p) -> None:
    """``--forget-split``, ``--retain-split`` and ``--tofu``: the TOFU rows of a command that trains on them."""
    p.add_argument("--forget-split", default="forget10", help="TOFU forget config (default forget10)")
    p.add_argument("--retain-split", default=None, help="TOFU retain config (default: the complement, e.g. retain90)")
    p.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)")
