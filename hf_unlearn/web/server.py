"""The web stack (Starlette on uvicorn with the server's limits): :mod:`hf_unlearn.webserver`, named here too."""

from __future__ import annotations

from ..webserver import (  # noqa: F401 - re-exported: the web stack lived here
    BodyError,
    BodyTooLarge,
    Limits,
    WebServer,
    _protocol_class,
    abort,
    body_chunks,
    body_left_unread,
    read_body,
)
