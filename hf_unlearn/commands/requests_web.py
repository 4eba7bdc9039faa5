"""`hf-unlearn requests web RUN ...`: the deletion-request intake over HTTP (:mod:`hf_unlearn.web.intake`)."""

from __future__ import annotations


def register_web(sub, common) -> None:
    p = sub.add_parser("web", help="serve an HTTP intake for deletion requests (a privacy tool's webhook), a status "
                                   "page per ticket and an operator page",
                       description="Serve the run's ledger over HTTP: POST /api/v1/requests (Bearer --token, "
                                   "Idempotency-Key header), /t/TICKET status pages, /operator (--operator-token).")
    common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--token", action="append", required=True, metavar="CLIENT=TOKEN",
                   help="a client allowed to submit requests, as NAME=TOKEN or TOKEN (repeatable)")
    p.add_argument("--operator-token", action="append", required=True, metavar="TOKEN",
                   help="a token that opens the operator page (repeatable)")
    p.add_argument("--subjects", default=None, metavar="FILE",
                   help="JSON mapping each data-subject key to the ids of its rows (requests may then name a subject)")
    p.add_argument("--callback-url", default=None, metavar="URL",
                   help="POST each ticket's state change here, signed with the service's Ed25519 key")
    p.add_argument("--callback-interval", type=float, default=10.0, help="seconds between state checks (default 10)")
    p.add_argument("--public-url", default=None, metavar="URL",
                   help="the address clients reach this server at (behind a TLS proxy), for the links in answers and callbacks")
    from .hub import add_server_limits

    add_server_limits(p)
    p.set_defaults(func=web_cmd)


def web_cmd(args) -> int:
    from ..deletion import DeletionLedger
    from ..web.intake import Intake, IntakeServer
    from ..web.server import Limits

    tokens = {}
    for n, item in enumerate(args.token):
        name, _, token = item.rpartition("=") if "=" in item else (f"client{n + 1}", "", item)
        tokens[token] = name
    limits = Limits(max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client,
                    header_deadline=args.header_deadline, read_timeout=args.read_timeout)
    intake = Intake(DeletionLedger(args.run, args.ledger), subjects=args.subjects)
    server = IntakeServer(intake, tokens, args.operator_token, args.host, args.port, limits=limits,
                          callback_url=args.callback_url, callback_interval=args.callback_interval,
                          public_url=args.public_url)
    print(f"hf-unlearn requests web: the intake of {intake.ledger.path} at {server.url}", flush=True)
    print(f"  POST {server.url}/api/v1/requests   operators: {server.url}/operator", flush=True)
    server.serve_forever()
    return 0
