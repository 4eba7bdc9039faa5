"""The deletion service on the web: an authenticated intake a privacy tool calls, a status per ticket, an operator page.

``hf-unlearn requests web RUN --token T --operator-token O`` serves one ledger (:class:`DeletionLedger`) over HTTP
(:class:`hf_unlearn.webserver.WebServer`: Starlette on uvicorn, the server's limits). A request arrives as JSON
(``ids``, or a data-subject ``subject`` the operator's mapping file turns into ids, a ``ref`` and an
``Idempotency-Key``); it is appended to the signed ledger exactly once per key and answered with a ticket whose
unguessable link (``/t/TICKET``) shows its state over time, what was done and proven, and the receipts and bundles to
verify with the public key. An optional callback POSTs each state change, signed with the service's Ed25519 key.

Why a journal beside the ledger (``LEDGER/intake/tickets.jsonl``, owner-only): the ledger knows requests, not
idempotency keys. A ticket's id is a keyed hash of the key, so a retry finds its ticket; the journal records the
intent before the append and the request after it, and the ledger's ref (raw only in its private part) names the
ticket, so a retry after a crash between the two finds the request the ledger already holds instead of adding it
twice. No raw id, row text or reference ever appears in a page, URL, log line or error: pages show keyed counts,
request numbers and receipts (keyed tags only).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from ..webserver import BodyError, BodyTooLarge, Limits, WebServer, body_left_unread, read_body

logger = logging.getLogger(__name__)

INTAKE_DIR = "intake"
JOURNAL = "tickets.jsonl"
MAX_INTAKE_BYTES = 256 * 1024  # one request: a few thousand ids at most; larger lists go through the CLI
MAX_IDS = 10_000
MAX_REF_CHARS = 200
MAX_KEY_CHARS = 200
STATES = ("acknowledged", "provisional", "exact", "published", "purged")  # in the order a request moves
COOKIE = "hfu_operator"
TEMPLATES = Path(__file__).with_name("templates")


class IntakeError(Exception):
    """A request refused with an HTTP status and one line (never naming an id or a reference)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Ticket:
    ticket: str
    request: str | None
    created: str
    body: str  # keyed digest of what was asked (a retry with the same key must ask the same)
    notified: list[str] = field(default_factory=list)
    fresh: object = field(default=None, repr=False, compare=False)  # the Request just added (answered without a read)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Intake:
    """The intake's state over one ledger: tickets (the journal), the subject mapping, the service key."""

    def __init__(self, ledger, subjects: str | os.PathLike | None = None):
        from ..keys import load_or_create_key

        self.ledger = ledger
        self.folder = Path(ledger.path) / INTAKE_DIR
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.folder, 0o700)
        self.secret = load_or_create_key(self.folder / "intake.key")
        self.journal = self.folder / JOURNAL
        self.subjects = _load_subjects(subjects) if subjects else None
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}
        self._read_journal()
        if ledger.records_path.exists():  # a server killed mid-append left a tail: re-sign it if it is ours
            head = ledger.recover(log=lambda m: logger.warning("%s", m))
            if head is not None:
                logger.warning("the ledger head now covers record %s (an interrupted append)", head["seq"])

    # -- the journal ------------------------------------------------------------------------------------------
    def _read_journal(self) -> None:
        if not self.journal.exists():
            return
        for n, line in enumerate(self.journal.read_bytes().split(b"\n")):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:  # a torn last line (a crash mid-append): the intent it held is redone
                logger.warning("intake journal line %d is torn; ignored", n + 1)
                continue
            t = self._tickets.get(e["ticket"])
            if e["op"] == "intent":
                self._tickets[e["ticket"]] = Ticket(e["ticket"], None, e["time"], e["body"])
            elif e["op"] == "request" and t is not None:
                t.request = e["request"]
            elif e["op"] == "notified" and t is not None:
                t.notified.append(e["state"])

    def _append(self, entry: dict) -> None:
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            with open(fd, "ab", closefd=False) as f:
                if f.tell() and not _ends_with_newline(self.journal):
                    f.write(b"\n")  # after a torn line: start clean
                f.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
                f.flush()
                os.fsync(fd)
        finally:
            os.close(fd)

    def _file_lock(self):
        from filelock import FileLock

        return FileLock(str(self.folder / ".lock"))

    # -- keys and digests ---------------------------------------------------------------------------------------
    def _mac(self, *parts: str) -> bytes:
        return hmac.new(self.secret, "\0".join(parts).encode(), hashlib.sha256).digest()

    def ticket_id(self, client: str, key: str) -> str:
        """Unguessable (keyed) and stable: the same client and idempotency key always name the same ticket."""
        return base64.b32encode(self._mac("ticket", client, key)[:20]).decode().lower()

    def operator_session(self) -> str:
        return self._mac("operator-session").hex()

    # -- intake -------------------------------------------------------------------------------------------------
    def submit(self, client: str, payload, key: str | None) -> tuple[Ticket, bool]:
        """Append the request in ``payload`` once per ``(client, key)``; returns (ticket, created)."""
        key = _check_key(key)
        ids, ref = self._parse(payload)
        body = self._mac("body", json.dumps({"ids": ids, "ref": ref}, sort_keys=True, default=str)).hex()
        tid = self.ticket_id(client, key)
        with self._lock, self._file_lock():
            self._tickets.clear()
            self._read_journal()  # another process may have appended
            t = self._tickets.get(tid)
            if t is not None and t.body != body:
                raise IntakeError(409, "this Idempotency-Key was used for a different request; use a new key")
            if t is not None and t.request is not None:
                return t, False
            ledger_ref = f"{ref} (intake {tid})" if ref else f"(intake {tid})"
            if t is None:
                t = Ticket(tid, None, _now(), body)
                self._append({"op": "intent", "ticket": tid, "time": t.created, "body": body})
                self._tickets[tid] = t
            else:  # an intent without its request: a crash mid-append; the ledger may hold it already
                t.request = self._request_with_ref(ledger_ref)
            if t.request is None:
                try:
                    t.fresh = self.ledger.add(ids, ref=ledger_ref)
                    t.request = t.fresh.id
                except UnlearnError as e:
                    raise IntakeError(422, _redact(str(e), ids)) from None
            self._append({"op": "request", "ticket": tid, "request": t.request, "time": _now()})
            return t, True

    def _request_with_ref(self, ledger_ref: str) -> str | None:
        from ..trace.tags import tag

        wanted = tag(self.ledger.tag_key, ledger_ref)
        with self.ledger.lock():
            requests = self.ledger.requests()
        return next((r.id for r in requests if r.ref_tag == wanted), None)

    def _parse(self, payload) -> tuple[list, str | None]:
        if not isinstance(payload, dict):
            raise IntakeError(400, "the body must be a JSON object with \"ids\" or \"subject\", and \"ref\"")
        unknown = set(payload) - {"ids", "subject", "ref", "idempotency_key"}
        if unknown:
            raise IntakeError(400, f"unknown field(s) {sorted(unknown)[:5]}: give \"ids\" or \"subject\", and \"ref\"")
        ref = payload.get("ref")
        if ref is not None and (not isinstance(ref, str) or not 0 < len(ref) <= MAX_REF_CHARS
                                or not ref.isprintable()):
            raise IntakeError(400, f"\"ref\" must be printable text of 1..{MAX_REF_CHARS} characters")
        if ("ids" in payload) == ("subject" in payload):
            raise IntakeError(400, "give exactly one of \"ids\" (a list) or \"subject\" (a key of the mapping)")
        if "subject" in payload:
            subject = payload["subject"]
            if self.subjects is None:
                raise IntakeError(400, "this intake has no subject mapping (--subjects FILE): send \"ids\"")
            if not isinstance(subject, str) or subject not in self.subjects:
                raise IntakeError(404, "unknown data subject: the mapping has no such key; nothing was recorded")
            ids = self.subjects[subject]
        else:
            ids = payload["ids"]
        if not isinstance(ids, list) or not ids or len(ids) > MAX_IDS or \
                not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
            raise IntakeError(400, f"\"ids\" must be a non-empty list of at most {MAX_IDS} integers or strings")
        return ids, ref

    # -- status -------------------------------------------------------------------------------------------------
    def ticket(self, tid: str) -> Ticket | None:
        with self._lock:
            t = self._tickets.get(tid)
            if t is None or t.request is None:
                self._tickets.clear()
                self._read_journal()
                t = self._tickets.get(tid)
        return t if t is not None and t.request is not None else None

    def status(self, t: Ticket, base_url: str = "", records: list[dict] | None = None) -> dict:
        """A ticket's JSON status: its state, the timeline of states, the receipts and bundles to download."""
        if records is None and t.fresh is not None:  # just added: its own record is the whole story so far
            r = t.fresh
            records = [{"type": "request", "request": r.id, "received": r.received, "deadline": r.deadline,
                        "count": len(r.tags), "seq": r.seq}]
            t.fresh = None
        records = self.records() if records is None else records
        rid, timeline, facts = t.request, [], {}
        for r in records:
            kind = r.get("type")
            if kind == "request" and r.get("request") == rid:
                timeline.append({"state": "acknowledged", "time": t.created, "record": r["seq"]})
                facts.update(received=r["received"], deadline=r["deadline"], ids=r["count"])
            elif kind == "approximate" and rid in r.get("requests", []):
                timeline.append({"state": "provisional", "time": r.get("time"), "record": r["seq"],
                                 "method": r.get("method"), "name": r.get("name")})
            elif kind == "batch_done" and rid in r.get("requests", []):
                timeline.append({"state": "exact", "time": r.get("time"), "record": r["seq"], "batch": r["batch"],
                                 "verified": r.get("verified"), "steps_replayed": r.get("steps_replayed")})
                p = r.get("published") or {}
                if p.get("repo") and p.get("tag") and not p.get("error"):
                    timeline.append({"state": "published", "time": r.get("time"), "record": r["seq"],
                                     "repo": p["repo"], "tag": p["tag"], "commit": p.get("commit")})
            elif kind == "purge" and rid in r.get("requests", []):
                timeline.append({"state": "purged", "time": r.get("time"), "record": r["seq"],
                                 "not_erased": r.get("not_erased") or []})
        link = f"{base_url}/t/{t.ticket}"
        files = sorted(p.name for p in (Path(self.ledger.path) / "receipts").glob(f"{rid}.*.json"))
        return {"ticket": t.ticket, "request": rid, "state": timeline[-1]["state"] if timeline else "acknowledged",
                "timeline": timeline, **facts, "status_url": link, "json_url": f"{base_url}/api/v1/tickets/{t.ticket}",
                "public_key_url": f"{base_url}/public-key.pem",
                "files": [{"name": n, "url": f"{link}/files/{n}", "bundle": n.endswith(".bundle.json")}
                          for n in files]}

    def records(self) -> list[dict]:
        """The ledger's records, read under its lock: read while an append is between its record and its signed
        head, the chain would be refused as interrupted."""
        with self.ledger.lock():
            return self.ledger.records()

    def tickets(self) -> list[Ticket]:
        with self._lock:
            self._tickets.clear()
            self._read_journal()
            return [t for t in self._tickets.values() if t.request is not None]

    def public_key_pem(self) -> str:
        from ..keys import public_key_pem

        return public_key_pem(self.ledger.signing_key)

    # -- callbacks ----------------------------------------------------------------------------------------------
    def notify_changes(self, url: str, base_url: str = "", timeout: float = 10.0) -> int:
        """POST each ticket's state change to ``url`` once it is acknowledged there (2xx), signed with the
        service's Ed25519 key (``X-HF-Unlearn-Signature``: hex over the body). Returns how many were delivered."""
        import urllib.error
        import urllib.request

        from ..keys import public_key_fingerprint, sign

        records = self.records()
        sent = 0
        for t in self.tickets():
            status = self.status(t, base_url, records)
            if status["state"] in t.notified:
                continue
            body = json.dumps({"ticket": t.ticket, "request": t.request, "state": status["state"],
                               "status_url": status["status_url"], "json_url": status["json_url"],
                               "time": _now()}, sort_keys=True).encode()
            key = self.ledger.signing_key
            req = urllib.request.Request(url, data=body, method="POST", headers={
                "Content-Type": "application/json", "X-HF-Unlearn-Signature": sign(key, body),
                "X-HF-Unlearn-Key": public_key_fingerprint(key.public_key())})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    ok = 200 <= r.status < 300
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
            if not ok:
                logger.warning("callback for request %s (state %s) not delivered; retried later", t.request,
                               status["state"])
                continue
            with self._lock, self._file_lock():
                self._append({"op": "notified", "ticket": t.ticket, "state": status["state"], "time": _now()})
            t.notified.append(status["state"])
            sent += 1
        return sent


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _check_key(key) -> str:
    if not isinstance(key, str) or not key.strip():
        raise IntakeError(400, "an Idempotency-Key header is required (any unique string per request, retried "
                               "unchanged)")
    if len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise IntakeError(400, f"the Idempotency-Key must be printable text of at most {MAX_KEY_CHARS} characters")
    return key


def _redact(message: str, ids: list) -> str:
    """The ledger's refusal without the ids it names (they must not reach an HTTP answer or a log line)."""
    if any(str(i) in message for i in ids):
        return (f"{len(ids)} id(s) refused by the recorded run (unknown or of the wrong type); nothing was recorded. "
                "The operator can check them with `hf-unlearn requests add` on the server")
    return message.splitlines()[0] if message else "refused"


def _load_subjects(path) -> dict[str, list]:
    """The operator's mapping from a data-subject key to the ids of that person's rows (JSON object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UnlearnError(f"--subjects {path}: cannot read a JSON object ({type(e).__name__}); write "
                           "{\"subject-key\": [id, ...], ...}") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) and v for v in data.values()):
        raise UnlearnError(f"--subjects {path}: must be a JSON object mapping each subject key to a non-empty list "
                           "of ids")
    return data


# -- the web app ------------------------------------------------------------------------------------------------
def build_app(intake: Intake, tokens: dict[str, str], operator_tokens: list[str], *, read_timeout: float = 60.0,
              public_url: str | None = None):
    """The Starlette app: ``POST /api/v1/requests`` (Bearer token), ``GET /api/v1/tickets/T`` and ``/t/T`` (the
    ticket is the capability), ``/t/T/files/NAME``, ``/public-key.pem``, ``/operator`` (operator token)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route
    from starlette.templating import Jinja2Templates

    templates = Jinja2Templates(directory=str(TEMPLATES))
    templates.env.autoescape = True

    def base(request: Request) -> str:  # links in answers: the address clients reach us at (behind a proxy: given)
        return public_url.rstrip("/") if public_url else str(request.base_url).rstrip("/")

    def error(status: int, message: str, request: Request | None = None):
        response = JSONResponse({"error": message}, status_code=status)
        if request is not None and body_left_unread(request):
            response.headers["Connection"] = "close"
        return response

    def bearer(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def is_operator(request: Request) -> bool:
        token = bearer(request)
        if token is not None:
            return any(hmac.compare_digest(token, o) for o in operator_tokens)
        return hmac.compare_digest(request.cookies.get(COOKIE, ""), intake.operator_session())

    def same_origin(request: Request) -> bool:  # a browser form posts with Origin: refuse other sites' forms
        origin = request.headers.get("origin")
        return origin is None or origin.rstrip("/") == base(request)

    async def submit(request: Request):
        token = bearer(request)  # decided from the headers, before a byte of the body is read
        client = None if token is None else next((u for t, u in tokens.items() if hmac.compare_digest(token, t)), None)
        if client is None:
            return error(401, "a valid Bearer token is required (Authorization header)", request)
        if "json" not in request.headers.get("content-type", ""):
            return error(415, "send the request as application/json", request)
        try:
            raw = await read_body(request, MAX_INTAKE_BYTES, read_timeout)
            payload = json.loads(raw)
        except BodyTooLarge:
            return error(413, f"the request body is larger than {MAX_INTAKE_BYTES} bytes", request)
        except BodyError as e:
            return error(400, str(e), request)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return error(400, "the body is not JSON")
        key = request.headers.get("idempotency-key") or (payload.get("idempotency_key")
                                                          if isinstance(payload, dict) else None)
        try:
            t, created = await run_in_threadpool(intake.submit, client, payload, key)
            status = await run_in_threadpool(intake.status, t, base(request))
        except IntakeError as e:
            return error(e.status, str(e))
        except UnlearnError as e:  # the ledger itself refuses (damaged, locked): the operator must look
            logger.error("intake refused by the ledger: %s", _first_line(e))
            return error(503, "the ledger cannot take requests now; the operator has been told in the server log")
        return JSONResponse({**status, "created": created}, status_code=201 if created else 200)

    async def ticket_json(request: Request):
        t = await run_in_threadpool(intake.ticket, request.path_params["ticket"])
        if t is None:
            return error(404, "no such ticket")
        return JSONResponse(await run_in_threadpool(intake.status, t, base(request)))

    async def ticket_page(request: Request):
        t = await run_in_threadpool(intake.ticket, request.path_params["ticket"])
        if t is None:
            return templates.TemplateResponse(request, "missing.html", {"title": "No such ticket"}, status_code=404)
        status = await run_in_threadpool(intake.status, t, base(request))
        return templates.TemplateResponse(request, "ticket.html", {"title": f"Deletion request {status['request']}",
                                                                   "s": status, "explain": EXPLAIN})

    async def ticket_file(request: Request):
        t = await run_in_threadpool(intake.ticket, request.path_params["ticket"])
        name = request.path_params["name"]
        if t is None or not name.startswith(f"{t.request}.") or "/" in name or not name.endswith(".json"):
            return error(404, "no such file for this ticket")
        path = Path(intake.ledger.path) / "receipts" / name
        if not path.is_file():
            return error(404, "no such file for this ticket")
        return Response(path.read_bytes(), media_type="application/json",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def public_key(request: Request):
        return PlainTextResponse(await run_in_threadpool(intake.public_key_pem),
                                 headers={"Content-Disposition": 'attachment; filename="issuer.pub"'})

    async def operator(request: Request):
        if not is_operator(request):
            if bearer(request) is not None:
                return error(401, "invalid operator token")
            return templates.TemplateResponse(request, "login.html", {"title": "Operator sign-in"}, status_code=401)
        data = await run_in_threadpool(_operator_view, intake, base(request))
        return templates.TemplateResponse(request, "operator.html", {"title": "Deletion requests", **data})

    async def login(request: Request):
        if not same_origin(request):
            return error(403, "cross-site form refused", request)
        try:
            form = (await read_body(request, 4096, read_timeout)).decode("utf-8", "replace")
        except (BodyTooLarge, BodyError):
            return error(400, "the sign-in form is too large or incomplete", request)
        from urllib.parse import parse_qs

        token = (parse_qs(form).get("token") or [""])[0]
        if not any(hmac.compare_digest(token, o) for o in operator_tokens):
            return templates.TemplateResponse(request, "login.html", {"title": "Operator sign-in",
                                                                      "failed": True}, status_code=401)
        response = RedirectResponse("/operator", status_code=303)
        response.set_cookie(COOKIE, intake.operator_session(), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    async def operator_submit(request: Request):
        """The operator's own form (a request received by mail or phone): the same intake, then the ticket page."""
        if not is_operator(request) or not same_origin(request):
            return error(401, "the operator must sign in (/operator)", request)
        from urllib.parse import parse_qs

        try:
            form = parse_qs((await read_body(request, MAX_INTAKE_BYTES, read_timeout)).decode("utf-8", "replace"))
        except (BodyTooLarge, BodyError):
            return error(413, "the form is too large or incomplete", request)
        field_ = lambda k: (form.get(k) or [""])[0].strip()  # noqa: E731
        payload = {"ref": field_("ref") or None}
        if field_("subject"):
            payload["subject"] = field_("subject")
        else:
            payload["ids"] = [int(x) if x.lstrip("-").isdigit() else x for x in field_("ids").split()]
        if payload["ref"] is None:
            payload.pop("ref")
        try:
            t, _ = await run_in_threadpool(intake.submit, "operator", payload, field_("key") or secrets.token_hex(8))
        except IntakeError as e:
            data = await run_in_threadpool(_operator_view, intake, base(request))
            return templates.TemplateResponse(request, "operator.html", {"title": "Deletion requests", **data,
                                                                         "form_error": str(e)}, status_code=e.status)
        return RedirectResponse(f"/t/{t.ticket}", status_code=303)

    async def index(request: Request):
        return PlainTextResponse("hf_unlearn deletion-request intake: POST /api/v1/requests; operators: /operator\n")

    routes = [
        Route("/", index),
        Route("/api/v1/requests", submit, methods=["POST"]),
        Route("/api/v1/tickets/{ticket:str}", ticket_json),
        Route("/t/{ticket:str}", ticket_page),
        Route("/t/{ticket:str}/files/{name:str}", ticket_file),
        Route("/public-key.pem", public_key),
        Route("/operator", operator),
        Route("/operator/login", login, methods=["POST"]),
        Route("/operator/requests", operator_submit, methods=["POST"]),
    ]

    async def server_error(request: Request, exc: Exception):
        logger.error("internal error (%s) on a %s request", type(exc).__name__, request.method)  # no URL: tickets
        return error(500, "internal error; the operator has been told in the server log", request)

    async def not_found(request: Request, exc: Exception):
        code = getattr(exc, "status_code", 404)
        return error(code, "no such page" if code == 404 else "method not allowed" if code == 405 else "refused",
                     request)

    inner = Starlette(routes=routes, exception_handlers={Exception: server_error, 404: not_found, 405: not_found})

    async def app(scope, receive, send):
        try:
            await inner(scope, receive, send)
        except Exception:  # answered 500 already (server_error); Starlette re-raises for the server to log, and
            pass  # uvicorn's log would print the message and traceback, which may hold what a request carried

    return app


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _operator_view(intake: Intake, base_url: str) -> dict:
    ledger = intake.ledger
    with ledger.lock():  # one consistent view (an append in flight would read as an interrupted one)
        return _operator_rows(intake, ledger)


def _operator_rows(intake: Intake, ledger) -> dict:
    from ..deletion.service import Policy, due_reasons, request_rows

    records = ledger.records()
    rows = request_rows(ledger)
    by_request = {t.request: t for t in intake.tickets()}
    for row in rows:
        t = by_request.get(row["request"])
        row["link"] = f"/t/{t.ticket}" if t else None
    batches = [{"batch": r["batch"], "time": r.get("time"), "requests": len(r["requests"]),
                "verified": r.get("verified"), "steps": r.get("steps_replayed"),
                "published": (f"{r['published']['repo']}@{r['published']['tag']}"
                              if (r.get("published") or {}).get("tag") else None)}
               for r in records if r.get("type") == "batch_done"]
    status = ledger.status()
    try:
        due = due_reasons(ledger, Policy())
    except UnlearnError as e:
        due = [f"cannot evaluate the policy: {_first_line(e)}"]
    return {"rows": rows, "batches": batches, "status": status, "due": due}


EXPLAIN = {
    "acknowledged": ("Your request is recorded in the service's signed, hash-chained ledger. The acknowledgement "
                     "receipt, signed with the service's key, states when it was received and its deadline. Nothing "
                     "has been deleted yet."),
    "provisional": ("An approximate unlearning method ran on the served model for this request. The provisional "
                    "receipt proves that the method ran, not that the rows are gone; an exact deletion supersedes "
                    "it."),
    "exact": ("The rows were removed from the training data and training was replayed from the last checkpoint "
              "before they were first used: the served model is the one training without them produces. The exact "
              "receipt names the batch and the weights' hash."),
    "published": "The model of the exact deletion was published to the Hub at the revision named below.",
    "purged": ("The service erased the rows from every store and run it keeps and deleted the models trained on "
               "them; copies outside the service (named below) are not erased by it."),
}


class IntakeServer:
    """The intake on :class:`~hf_unlearn.webserver.WebServer`, with the callback notifier in a thread."""

    def __init__(self, intake: Intake, tokens: dict[str, str], operator_tokens: list[str], host="127.0.0.1",
                 port: int = 0, *, limits=None, callback_url: str | None = None, callback_interval: float = 10.0,
                 public_url: str | None = None):
        if not tokens:
            raise UnlearnError("the intake needs at least one client token (--token)")
        if not operator_tokens:
            raise UnlearnError("the intake needs an operator token (--operator-token)")
        limits = limits or Limits()
        self.intake = intake
        self.web = WebServer(build_app(intake, tokens, operator_tokens, read_timeout=limits.read_timeout,
                                       public_url=public_url), host, port, limits)
        self.callback_url, self.callback_interval = callback_url, float(callback_interval)
        self.public_url = public_url
        self._stop = threading.Event()
        self._notifier: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.web.url

    def _notify_loop(self) -> None:
        while not self._stop.wait(self.callback_interval):
            try:
                self.intake.notify_changes(self.callback_url, self.public_url or self.url)
            except Exception as e:  # a damaged ledger or an unreachable tool must not end the server
                logger.error("callbacks failed: %s", _first_line(e))

    def _start_notifier(self) -> None:
        if self.callback_url:
            self._notifier = threading.Thread(target=self._notify_loop, name="hf-unlearn-callbacks", daemon=True)
            self._notifier.start()

    def start(self) -> IntakeServer:
        self.web.start()
        self._start_notifier()
        return self

    def serve_forever(self) -> None:
        self._start_notifier()
        try:
            self.web.serve_forever()
        finally:
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self.web.stop()

    def __enter__(self) -> IntakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

