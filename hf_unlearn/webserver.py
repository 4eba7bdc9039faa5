"""The one web stack of hf_unlearn: Starlette apps on uvicorn, with the server's own limits.

It sits at the ground of the package (it knows nothing of hf_unlearn but its errors) so both services build on it
without one reaching into the other's room: the Hub-compatible store (``hub``, below ``web``) and the intake
(``web``); ``hf_unlearn.web.server`` re-exports it.

Both HTTP services (the Hub-compatible store, ``hf_unlearn.hub.server``, and the deletion-request intake,
``hf_unlearn.web.intake``) run through :class:`WebServer`. Why a uvicorn protocol subclass: uvicorn bounds header size
(``h11_max_incomplete_event_size``) and idle keep-alive, but has no deadline for a request's headers, no read
timeout before the first request and no cap on connections per client; those are what slow clients exploit (one
byte every few seconds holds a connection for ever). :class:`Limits` lists every limit in one place; the protocol
enforces the connection-level ones, :func:`read_body`/:func:`body_chunks` the body ones (a deadline per read and a
size cap checked against ``Content-Length`` before anything is read). Apps decide authentication from the headers
and only then read a body; a response sent with a body left unread closes the connection (``Connection: close``),
so an anonymous client announcing a large body is answered at once and holds nothing.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, fields

from .errors import UnlearnError


@dataclass(frozen=True)
class Limits:
    """The server's limits (``hf-unlearn hub serve`` and ``hf-unlearn requests web`` expose each as an option).

    With asyncio a connection costs a few KB, not a thread, so the connection caps are high; the per-client cap
    keeps one address from taking them all. An honest request is answered whatever slow clients hold below it.
    """

    max_connections: int = 1024  # open at once; more are answered 503 and closed at once
    max_connections_per_client: int = 128  # open at once from one IP address; more are answered 503 and closed
    header_deadline: float = 15.0  # a request's line and headers must arrive within this (also the keep-alive idle)
    read_timeout: float = 60.0  # a connection silent this long while we wait for it (headers, body) is closed;
    # a client that does not take a response's bytes for this long is cut too
    max_header_bytes: int = 64 * 1024  # request line and headers together (h11_max_incomplete_event_size)
    backlog: int = 2048  # the listen queue
    graceful_shutdown: float = 5.0  # on stop: requests in flight get this long to finish

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UnlearnError(f"web server limit {f.name} must be a positive number, got {value!r}")


class BodyTooLarge(Exception):
    def __init__(self, limit: int, announced: int | None = None):
        super().__init__(f"request body of {announced} bytes is larger than the limit of {limit} bytes"
                         if announced is not None else f"request body larger than {limit} bytes")
        self.limit = limit


class BodyError(Exception):
    """A body that cannot be read: a bad Content-Length, a client that stopped sending or went away."""


def _protocol_class(limits: Limits):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    per_client: dict[str, int] = {}

    class LimitedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a connection cap (total and per client address), a deadline for each
        request's headers and a read timeout while headers are awaited; the app is told how to abort."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner = self.app

            async def app(scope, receive, send):  # lets a handler drop the connection unanswered (fault injection)
                scope.setdefault("extensions", {})["hf_unlearn.abort"] = self._abort
                await inner(scope, receive, send)

            self.app = app
            self._timers: list = []
            self._counted: str | None = None
            self._seen = None

        def connection_made(self, transport):
            super().connection_made(transport)
            host = (self.client or ("?", 0))[0]
            if len(self.connections) > limits.max_connections or \
                    per_client.get(host, 0) >= limits.max_connections_per_client:
                body = b'{"error": "too many open connections, retry"}'
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
                transport.close()
                return
            per_client[host] = per_client.get(host, 0) + 1
            self._counted = host
            self._await_request()

        def connection_lost(self, exc):
            self._cancel()
            if self._counted is not None:
                left = per_client.get(self._counted, 1) - 1
                if left > 0:
                    per_client[self._counted] = left
                else:
                    per_client.pop(self._counted, None)
                self._counted = None
            super().connection_lost(exc)

        def data_received(self, data):
            if self._counted is None:
                return  # a refused connection: its 503 is on the way, read nothing
            if self._timers:  # awaiting headers: each read re-arms the read timeout (not the deadline)
                self._timers[1].cancel()
                self._timers[1] = self.loop.call_later(limits.read_timeout, self._expire)
            super().data_received(data)
            self._request_arrived()

        def on_response_complete(self):
            self._await_request()
            super().on_response_complete()  # may start a pipelined request at once
            self._request_arrived()

        def _await_request(self):
            self._cancel()
            self._seen = self.cycle
            self._timers = [self.loop.call_later(limits.header_deadline, self._expire),
                            self.loop.call_later(limits.read_timeout, self._expire)]

        def _request_arrived(self):
            if self._timers and self.cycle is not None and self.cycle is not self._seen:
                self._cancel()

        def _cancel(self):
            for timer in self._timers:
                timer.cancel()
            self._timers = []

        def _expire(self):
            self._cancel()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def _abort(self):
            if self.transport is not None:
                self.transport.abort()

    return LimitedH11Protocol


async def abort(request) -> None:
    """Drop the connection of ``request`` without an answer (a server dying mid-request; tests' fault points)."""
    request.scope.get("extensions", {}).get("hf_unlearn.abort", lambda: None)()
    for _ in range(3):  # let the transport report the loss before the app returns (no 500 on a dead socket)
        await asyncio.sleep(0)


async def body_chunks(request, limit: int, read_timeout: float):
    """The body of ``request`` as it arrives, at most ``limit`` bytes: a ``Content-Length`` above it is refused
    before anything is read, a chunked body is counted as it comes; each wait for the client is bounded by
    ``read_timeout``. Raises :class:`BodyTooLarge` or :class:`BodyError`."""
    raw = request.headers.get("content-length")
    if raw is not None:
        if not raw.strip().isdigit():
            raise BodyError("invalid Content-Length header")
        if int(raw) > limit:
            raise BodyTooLarge(limit, int(raw))
    total = 0
    request.state.body_started = True
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), read_timeout)
        except asyncio.TimeoutError:
            raise BodyError(f"no body byte for {read_timeout:g} s") from None
        if message["type"] == "http.disconnect":
            raise BodyError("the client went away mid-body")
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge(limit)
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            request.state.body_done = True
            return


async def read_body(request, limit: int, read_timeout: float) -> bytes:
    return b"".join([chunk async for chunk in body_chunks(request, limit, read_timeout)])


def body_left_unread(request) -> bool:
    """True when the request announced a body that has not been read to its end: the answer must close the
    connection (the rest of the body would otherwise be parsed as the next request, or hold the connection)."""
    if getattr(request.state, "body_done", False):
        return False
    if getattr(request.state, "body_started", False):
        return True
    cl = request.headers.get("content-length")
    return (cl is not None and cl.strip() != "0") or "chunked" in request.headers.get("transfer-encoding", "").lower()


class WebServer:
    """An ASGI app served by uvicorn on ``host:port`` (``port=0``: a free one), bound at construction so that
    :attr:`url` is known at once. :meth:`start`/:meth:`stop` run it in a background thread (tests, notebooks),
    :meth:`serve_forever` in this one (the CLI: Ctrl-C stops it)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None):
        import uvicorn

        self.limits = limits or Limits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as e:
            self.socket.close()
            raise UnlearnError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port") from None
        self.socket.listen(self.limits.backlog)
        self.config = uvicorn.Config(
            app, http=_protocol_class(self.limits), loop="asyncio", lifespan="off", ws="none", interface="asgi3",
            log_config=None, log_level="warning", access_log=False,  # no access log: a URL may carry a ticket;
            # log_config=None: the library does not reconfigure the process's logging (uvicorn's loggers propagate)
            timeout_keep_alive=max(1, int(self.limits.header_deadline)),
            h11_max_incomplete_event_size=self.limits.max_header_bytes, backlog=self.limits.backlog,
            timeout_graceful_shutdown=max(1, int(self.limits.graceful_shutdown)), server_header=False,
            date_header=True)
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self):
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.socket])),
                                        name="hf-unlearn-web", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not self.server.started:
            raise UnlearnError(f"the web server at {self.url} did not start")
        return self

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.limits.graceful_shutdown + 5)
        self.socket.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
