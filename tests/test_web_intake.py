"""The deletion-request intake over HTTP (`hf-unlearn requests web`, hf_unlearn.web.intake), spoken to over real
HTTP on 127.0.0.1: tickets, idempotency, refusals that change nothing and name nothing raw, states and signed
callbacks, the operator page; concurrent intakes and a server killed mid-request (slow)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import ROOT
from .test_trace_common import get_recorded, ids_at_step

TOKEN, OPERATOR = "tool-token-123", "operator-token-456"
REF = "PRIVACY-TOOL-REF-7731"
SUBJECT = "subject-alice@example.org"


def http(url, method="GET", body=None, token=TOKEN, headers=None, raw=None, timeout=30):
    """(status, headers, body bytes) of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def submit(server, body, key, token=TOKEN):
    return http(f"{server.url}/api/v1/requests", "POST", body, token=token, headers={"Idempotency-Key": key})


@pytest.fixture
def intake(tmp_path):
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.web.intake import Intake, IntakeServer

    run = get_recorded()
    subjects = tmp_path / "subjects.json"
    subjects.write_text(json.dumps({SUBJECT: ids_at_step(run, 3)[:2]}))
    ledger = DeletionLedger(run, tmp_path / "ledger")
    server = IntakeServer(Intake(ledger, subjects=subjects), {TOKEN: "privacy-tool"}, [OPERATOR]).start()
    yield server
    server.stop()


def test_an_intake_is_appended_once_per_key_and_answered_with_a_ticket(intake):
    from hf_unlearn.deletion import verify_receipt
    from hf_unlearn.keys import load_public_key

    ids = ids_at_step(get_recorded(), 2)[:2]
    status, _, body = submit(intake, {"ids": ids, "ref": REF}, "key-1")
    first = json.loads(body)
    assert status == 201 and first["created"] and first["state"] == "acknowledged" and first["request"] == "r-0001"
    assert len(first["ticket"]) == 32 and first["status_url"].endswith("/t/" + first["ticket"])
    # a retry (the tool timed out and sent again) is the same ticket; nothing is appended twice
    status, _, body = submit(intake, {"ids": ids, "ref": REF}, "key-1")
    assert status == 200 and json.loads(body)["ticket"] == first["ticket"] and not json.loads(body)["created"]
    # the same key for another request is refused, one line, and changes nothing
    status, _, body = submit(intake, {"ids": ids[:1], "ref": REF}, "key-1")
    assert status == 409 and "\n" not in json.loads(body)["error"]
    # a subject the operator's mapping names is another request
    status, _, body = submit(intake, {"subject": SUBJECT, "ref": "REF-2"}, "key-2")
    assert status == 201 and json.loads(body)["request"] == "r-0002"
    assert [r.id for r in intake.intake.ledger.requests()] == ["r-0001", "r-0002"]
    # the status JSON and the bundle: it verifies with the public key served next to it, alone
    status, _, body = http(first["json_url"], token=None)
    assert status == 200 and json.loads(body)["timeline"][0]["state"] == "acknowledged"
    bundle = next(f for f in first["files"] if f["bundle"])
    status, _, data = http(bundle["url"], token=None)
    path = intake.intake.ledger.path.parent / "downloaded.bundle.json"
    path.write_bytes(data)
    pem = http(first["public_key_url"], token=None)[2].decode()
    report = verify_receipt(path, load_public_key(pem))
    assert status == 200 and report.ok and "acknowledgement" in report.kind, report.summary()


def test_bad_input_is_a_one_line_4xx_that_names_nothing_raw_and_changes_nothing(intake, caplog):
    caplog.set_level(logging.DEBUG)
    ledger = intake.intake.ledger
    good = {"ids": ids_at_step(get_recorded(), 2)[:1], "ref": REF}
    cases = [
        (dict(body=good, key="k", token=None), 401),
        (dict(body=good, key="k", token="wrong"), 401),
        (dict(body=good, key=""), 400),
        (dict(body={"ids": [987654321], "ref": REF}, key="k-unknown"), 422),
        (dict(body={"ids": "1,2", "ref": REF}, key="k"), 400),
        (dict(body={"ids": [True]}, key="k"), 400),
        (dict(body={"subject": "subject-mallory-5550123"}, key="k"), 404),
        (dict(body={"ids": [1], "subject": SUBJECT}, key="k"), 400),
        (dict(body={"ids": [1], "extra": 1}, key="k"), 400),
        (dict(body={"ids": [1], "ref": "x" * 500}, key="k"), 400),
        (dict(body=None, key="k"), 400),
    ]
    for kw, expected in cases:
        status, _, body = submit(intake, kw["body"], kw["key"], token=kw.get("token", TOKEN))
        message = json.loads(body)["error"]
        assert status == expected and "\n" not in message, (kw, status, message)
        assert "987654321" not in message and "mallory" not in message and REF not in message
    status, _, body = http(f"{intake.url}/api/v1/requests", "POST", raw=b"{not json", headers={"Idempotency-Key": "k"})
    assert status == 400
    status, _, body = http(f"{intake.url}/api/v1/requests", "POST", raw=b"[" * 300_000,
                           headers={"Idempotency-Key": "k"})
    assert status == 413
    assert not ledger.records_path.exists() or ledger.requests() == []  # nothing was recorded
    logged = caplog.text
    assert "987654321" not in logged and "mallory" not in logged and REF not in logged
    # an anonymous client announcing a large body is answered from its headers at once and the connection closed
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(intake.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /api/v1/requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n{")
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" in reply.lower()
    # unknown tickets: 404 everywhere, nothing about what exists
    assert http(f"{intake.url}/api/v1/tickets/" + "a" * 32, token=None)[0] == 404
    assert http(f"{intake.url}/t/" + "a" * 32, token=None)[0] == 404


def test_an_internal_error_is_a_500_that_logs_nothing_it_carried(intake, caplog, monkeypatch):
    from hf_unlearn.web.intake import Intake

    caplog.set_level(logging.DEBUG)
    ticket = json.loads(submit(intake, {"subject": SUBJECT, "ref": REF}, "key-e")[2])

    def broken(self, *a, **k):
        raise RuntimeError("row 987654321: the text of a deleted row")

    monkeypatch.setattr(Intake, "status", broken)
    for url in (ticket["json_url"], ticket["status_url"]):
        status, _, body = http(url, token=None)
        assert status == 500 and "\n" not in json.loads(body)["error"] and b"987654321" not in body
    assert "987654321" not in caplog.text and "deleted row" not in caplog.text
    assert "RuntimeError" in caplog.text  # the operator still learns that something broke


def test_states_over_time_pages_and_signed_callbacks(intake, tmp_path):
    """A request moves acknowledged -> exact when a batch serves it; the ticket page says so, the callback POSTs
    each state once, signed with the service key (a receiver checks it with the public key alone)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from hf_unlearn.keys import load_public_key, signature_ok

    from .test_trace_common import get_trace_data

    got = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((body, self.headers["X-HF-Unlearn-Signature"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a):
            pass

    receiver = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    callback = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    try:
        ticket = json.loads(submit(intake, {"ids": ids_at_step(get_recorded(), 6)[:2], "ref": REF}, "key-s")[2])
        ledger = intake.intake.ledger
        assert intake.intake.notify_changes(callback, intake.url) == 1
        assert intake.intake.notify_changes(callback, intake.url) == 0  # each state once
        ledger.serve_exact(tokenizer=get_trace_data()[0], progress=False, log=lambda m: None)
        assert intake.intake.notify_changes(callback, intake.url) == 1
        public = load_public_key(http(f"{intake.url}/public-key.pem", token=None)[2].decode())
        states = []
        for body, signature in got:
            assert signature_ok(public, body, signature)
            assert not signature_ok(public, body.replace(b"\"state\": \"", b"\"state\": \"not-"), signature)
            states.append(json.loads(body)["state"])
        assert states == ["acknowledged", "exact"]
        status = json.loads(http(ticket["json_url"], token=None)[2])
        assert [e["state"] for e in status["timeline"]] == ["acknowledged", "exact"]
        assert any(f["name"] == "r-0001.exact.bundle.json" for f in status["files"])
        page = http(ticket["status_url"], token=None)[2].decode()
        assert "exact" in page and "batch-0001" in page and "hf-unlearn requests verify r-0001.exact.bundle.json" in page
        assert REF not in page and SUBJECT not in page
    finally:
        receiver.shutdown()


def test_the_server_delivers_callbacks_by_itself_and_retries_a_failed_one(tmp_path):
    """`--callback-url`: the server's own loop POSTs the change; a receiver that fails first (503) gets it again."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.web.intake import Intake, IntakeServer

    got = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["state"])
            self.send_response(503 if len(got) == 1 else 200)
            self.end_headers()

        def log_message(self, *a):
            pass

    receiver = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    ledger = DeletionLedger(get_recorded(), tmp_path / "ledger")
    server = IntakeServer(Intake(ledger), {TOKEN: "tool"}, [OPERATOR], callback_interval=0.2,
                          callback_url=f"http://127.0.0.1:{receiver.server_address[1]}/hook").start()
    try:
        submit(server, {"ids": ids_at_step(get_recorded(), 1)[:1]}, "cb-1")
        end = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.6)  # a few more checks: delivered once it was accepted, not again
        assert got == ["acknowledged", "acknowledged"], got
    finally:
        server.stop()
        receiver.shutdown()


def test_the_operator_page_needs_the_operator_token(intake):
    submit(intake, {"subject": SUBJECT}, "key-o")
    status, _, body = http(f"{intake.url}/operator", token=None)
    assert status == 401 and b"Operator sign-in" in body
    assert http(f"{intake.url}/operator", token=TOKEN)[0] == 401  # a client token is not an operator token
    status, _, body = http(f"{intake.url}/operator", token=OPERATOR)
    page = body.decode()
    assert status == 200 and "r-0001" in page and "/t/" in page and SUBJECT not in page
    # a form posted from another site is refused even with the operator's cookie
    status, _, _ = http(f"{intake.url}/operator/login", "POST", raw=f"token={OPERATOR}".encode(), token=None,
                        headers={"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 403


def test_concurrent_intakes_are_appended_exactly_once_each(intake):
    """16 clients at once, each sending its request twice concurrently (a retry racing the original): 16 requests
    in the ledger, one per key, every ticket answered with its own request."""
    ids = ids_at_step(get_recorded(), 4)
    results, errors = {}, []

    def client(n):
        try:
            status, _, body = submit(intake, {"ids": [ids[n % len(ids)]], "ref": f"R{n}"}, f"load-{n}")
            results.setdefault(n, []).append((status, json.loads(body)))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(n % 16,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    requests = intake.intake.ledger.requests()
    assert len(requests) == 16 and intake.intake.ledger.check().ok
    tickets = {n: {b["ticket"] for _, b in r} for n, r in results.items()}
    assert all(len(t) == 1 for t in tickets.values()) and len({next(iter(t)) for t in tickets.values()}) == 16
    assert sorted(s for r in results.values() for s, _ in r) == [200] * 16 + [201] * 16


def test_a_crash_between_the_ledger_append_and_the_journal_is_not_a_second_request(intake, monkeypatch):
    """The server dies after the ledger recorded the request and before the journal says so (the window a kill -9
    can hit): a restarted intake and the tool's retry find the request the ledger holds; it is not added twice."""
    from hf_unlearn.web.intake import Intake

    original = Intake._append

    def die_after_the_ledger(self, entry):
        if entry["op"] == "request":
            raise SystemExit("killed")
        original(self, entry)

    body = {"ids": ids_at_step(get_recorded(), 7)[:1], "ref": REF}
    monkeypatch.setattr(Intake, "_append", die_after_the_ledger)
    with pytest.raises(SystemExit):
        intake.intake.submit("privacy-tool", body, "crash-1")
    monkeypatch.setattr(Intake, "_append", original)
    assert [r.id for r in intake.intake.ledger.requests()] == ["r-0001"]
    restarted = Intake(intake.intake.ledger)
    ticket, created = restarted.submit("privacy-tool", body, "crash-1")
    assert ticket.request == "r-0001" and created
    assert [r.id for r in intake.intake.ledger.requests()] == ["r-0001"]
    assert restarted.submit("privacy-tool", body, "crash-1") == (ticket, False)


@pytest.mark.slow
def test_nothing_is_lost_when_the_server_is_killed_mid_request(tmp_path):
    """`hf-unlearn requests web` killed with SIGKILL while 24 clients submit: after a restart, every client retries
    with its key; each request is in the ledger exactly once, every ticket answered before the kill still names the
    same request, and the ledger's chain is intact."""
    import signal
    import socket

    run = get_recorded()
    ids = ids_at_step(run, 5)
    ledger_dir = tmp_path / "ledger"

    def start():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "hf_unlearn", "requests", "web", str(run), "--ledger",
                                 str(ledger_dir), "--port", str(port), "--token", TOKEN, "--operator-token", OPERATOR],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert "intake" in proc.stdout.readline()
        return proc, f"http://127.0.0.1:{port}"

    class S:
        url = ""

    server = S()
    proc, server.url = start()
    before, lock = {}, threading.Lock()

    def client(n):
        try:
            status, _, body = submit(server, {"ids": [ids[n % len(ids)]]}, f"kill-{n}")
            if status in (200, 201):
                with lock:
                    before[n] = json.loads(body)
        except (OSError, urllib.error.URLError):
            pass  # cut by the kill: retried below

    threads = [threading.Thread(target=client, args=(n,)) for n in range(24)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for t in threads:
        t.join(60)
    assert len(before) < 24  # the kill came while requests were in flight
    proc, server.url = start()
    try:
        after = {}
        for n in range(24):
            status, _, body = submit(server, {"ids": [ids[n % len(ids)]]}, f"kill-{n}")
            assert status in (200, 201), body
            after[n] = json.loads(body)
        for n, answer in before.items():  # acknowledged before the kill: the same ticket, the same request
            assert after[n]["ticket"] == answer["ticket"] and after[n]["request"] == answer["request"]
    finally:
        proc.terminate()
        proc.wait(10)
    from hf_unlearn.deletion import DeletionLedger

    ledger = DeletionLedger(run, ledger_dir)
    assert ledger.check().ok and len(ledger.requests()) == 24
    assert len({a["request"] for a in after.values()}) == 24
