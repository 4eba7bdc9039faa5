"""The library's error type.

Every error a user can cause by bad input is an :class:`UnlearnError` whose message names what is
wrong and what to do. The CLI prints it as one line and exits non-zero, never a traceback.
"""


class UnlearnError(ValueError):
    """Bad input or a failed integrity check, with a message written for the user."""
