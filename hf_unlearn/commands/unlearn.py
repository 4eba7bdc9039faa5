"""`hf-unlearn unlearn ...`: commands of this group register here."""

from . import add_subcommands


def register(parser) -> None:
    add_subcommands(parser)
