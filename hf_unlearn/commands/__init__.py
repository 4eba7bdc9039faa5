"""CLI subcommand groups; each module exposes ``register(parser)`` for its group."""


def add_subcommands(parser):
    """The subparsers object of a group (commands inside a group are ``hf-unlearn GROUP CMD``)."""
    return parser.add_subparsers(dest="command", metavar="COMMAND")
