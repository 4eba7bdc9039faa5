"""`hf-unlearn requests ...`: the deletion service of a recorded run (:class:`hf_unlearn.deletion.DeletionLedger`).

add / list / status / plan / serve (--exact, --approximate, --due) / purge / recover / bundle / verify / public-key /
rotate-key / web (the HTTP intake: ``requests_web.py``).
"""

from __future__ import annotations

import json

from . import add_subcommands

RUN_HELP = "the recorded run (trace_dir of a TraceRecordingTrainer) whose requests these are"
LEDGER_HELP = "the ledger folder (default RUN/requests)"
NOW_HELP = "evaluate ages, deadlines and the policy as of this ISO date (default: now; for simulations and backfills)"


def register(parser) -> None:
    sub = add_subcommands(parser)
    p = sub.add_parser("add", help="append a deletion request to the run's ledger (ids checked against the run)")
    _common(p)
    p.add_argument("--ids", required=True, metavar="FILE",
                   help="the request's ids: ids.jsonl (one JSON id per line: 3600 or \"abc-1\"), a JSON list or one "
                        "id per line")
    p.add_argument("--ref", default=None, metavar="TICKET",
                   help="your ticket reference (kept raw only in the ledger's owner-only private part)")
    p.add_argument("--received", default=None, metavar="DATE", help="when the request was received (default: now)")
    p.add_argument("--deadline-days", type=float, default=None,
                   help="days from receipt to the deadline (default: the ledger's, 30)")
    p.set_defaults(func=add_cmd)

    for name, text in (("list", "every request: state (pending, approximate, exact), age, deadline"),
                       ("status", "counts per state, overdue requests, the next deadline, an interrupted batch"),
                       ("plan", "replay cost of the pending set: one batch now, each alone, waiting for the deadline")):
        p = sub.add_parser(name, help=text)
        _common(p)
        p.add_argument("--now", default=None, metavar="DATE", help=NOW_HELP)
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func={"list": list_cmd, "status": status_cmd, "plan": plan_cmd}[name])

    p = sub.add_parser("serve", help="honour pending requests: --exact (one batch), --approximate (provisional) or "
                                     "--due (apply a policy; safe from cron)")
    _common(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exact", action="store_true",
                      help="one exact batch: redact the union of every pending request, replay once, receipts")
    mode.add_argument("--approximate", action="store_true",
                      help="an approximate method on the served model for requests nothing has served yet")
    mode.add_argument("--due", action="store_true", help="serve what the policy says is due; else say so and exit 0")
    p.add_argument("--policy", default=None, metavar="FILE",
                   help="--due: JSON or TOML with max_wait_days, max_replay_steps, approximate_first, "
                        "approximate_method, oracle, purge_after_batch (default: max_wait_days 21)")
    p.add_argument("--oracle", action="store_true", help="exact: also run the oracle and check bit for bit")
    p.add_argument("--accept-unproven", action="store_true",
                   help="exact: serve even where the run's steps are not proven to be reproduced by the engine "
                        "(`hf-unlearn trace prove RUN`); never VERIFIED, the receipt names the steps")
    p.add_argument("--tokenizer", dest="tokenizer_path", default=None,
                   help="exact: tokenizer saved with the model (a recorded run holds none)")
    p.add_argument("--collator", default=None, help="exact: the run's collator (module:name) when it cannot be rebuilt")
    p.add_argument("--method", default="masc", help="approximate: a method of the registry (default masc)")
    p.add_argument("--model", default=None,
                   help="approximate: the model served now (default: the ledger's last served model)")
    p.add_argument("--data", default=None,
                   help="approximate: rows the ids name (default: the current exact run's token store)")
    p.add_argument("--method-arg", action="append", dest="method_args", metavar="KEY=VALUE",
                   help="approximate: method option (repeatable)")
    p.add_argument("--repo", default=None, help="exact: push each batch to ORG/NAME as the next deletion-NNNN tag")
    p.add_argument("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT)")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    p.add_argument("--now", default=None, metavar="DATE", help=NOW_HELP)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(func=serve_cmd)

    p = sub.add_parser("purge", help="erase the served rows from every store and run the service keeps, and the "
                                     "runs and models it no longer needs (a signed purge record lists them)")
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.set_defaults(func=purge_cmd)

    p = sub.add_parser("recover", help="re-sign the head over a tail an interrupted serve or add left (only if it is "
                                       "exactly what they write; anything else is refused)")
    _common(p)
    p.set_defaults(func=recover_cmd)

    p = sub.add_parser("bundle", help="write a receipt bundle (the receipt, the ledger records it depends on and the "
                                      "signed head) that a third party verifies with the public key alone")
    _common(p)
    p.add_argument("receipt", help="a receipt (LEDGER/receipts/*.json)")
    p.add_argument("--out", default=None, dest="bundle_out", metavar="FILE",
                   help="where (default: next to the receipt, *.bundle.json)")
    p.set_defaults(func=bundle_cmd)

    p = sub.add_parser("rotate-key", help="archive this machine's signing key and create a new one; each ledger "
                                          "hands over to it (a key record signed by the old key) at its next append")
    p.set_defaults(func=rotate_key_cmd)

    p = sub.add_parser("verify", help="check a receipt or a receipt bundle with the public key alone: signature, "
                                      "chain under the signed head, the request and its kind, and (with --model) "
                                      "that the model excludes its rows")
    p.add_argument("receipt", help="a receipt bundle (*.bundle.json: needs nothing else) or a receipt written by "
                                   "`requests serve` (LEDGER/receipts/*.json, checked against its ledger)")
    p.add_argument("--public-key", required=True, metavar="KEY", help="the issuer's Ed25519 public key (PEM file)")
    p.add_argument("--ledger", default=None, help="the ledger folder (default: the receipt's ../); with a bundle: the operator's current "
                        "ledger, checked to still hold the bundle's records under a head at least as new")
    p.add_argument("--model", default=None, help="a model folder: its weights are the receipt's, or a later exact "
                                                 "model of the same ledger that also excludes the request's rows")
    p.set_defaults(func=verify_cmd)

    p = sub.add_parser("public-key", help="print (or write) the public half of this machine's signing key")
    p.add_argument("--out", default=None, dest="key_out", metavar="FILE", help="write it to FILE instead")
    p.set_defaults(func=public_key_cmd)

    from .requests_web import register_web

    register_web(sub, _common)


def _common(p) -> None:
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--ledger", default=None, help=LEDGER_HELP)


def _ledger(args, **kw):
    from ..deletion import DeletionLedger

    return DeletionLedger(args.run, args.ledger, **kw)


def add_cmd(args) -> int:
    kw = {} if args.deadline_days is None else {"deadline_days": args.deadline_days}
    req = _ledger(args, **kw).add(args.ids, ref=args.ref, received=args.received)
    print(f"{req.id}: {len(req.tags)} id(s) recorded (keyed tags), received {req.received}, deadline {req.deadline}; "
          f"signed acknowledgement receipts/{req.id}.ack.json (bundle: receipts/{req.id}.ack.bundle.json)")
    return 0


def list_cmd(args) -> int:
    from ..deletion.service import request_rows

    rows = request_rows(_ledger(args), args.now)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no requests")
        return 0
    print(f"{'request':8} {'state':12} {'ids':>4} {'received':20} {'age':>6} {'deadline':20} {'left':>6}  batch")
    for r in rows:
        print(f"{r['request']:8} {r['state']:12} {r['ids']:>4} {r['received']:20} {r['age_days']:>5.1f}d "
              f"{r['deadline']:20} {r['days_left']:>5.1f}d  {r['batch'] or ''}{'  OVERDUE' if r['overdue'] else ''}")
    return 0


def status_cmd(args) -> int:
    s = _ledger(args).status(args.now)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        for k, v in s.items():
            print(f"  {k:18} {v}")
    return 1 if s["overdue"] or s["interrupted_batch"] else 0


def purge_cmd(args) -> int:
    from ..deletion.erasure import purge

    result = purge(_ledger(args), log=lambda m: None, dry_run=args.dry_run)
    print(("dry run: " if args.dry_run else "") + result.summary())
    return 0


def recover_cmd(args) -> int:
    head = _ledger(args).recover(log=print)
    print("nothing to recover: the signed head covers every record" if head is None else
          f"the head now covers record {head['seq']}")
    return 0


def bundle_cmd(args) -> int:
    from ..deletion.receipts import write_bundle

    print(f"bundle written to {write_bundle(_ledger(args), args.receipt, args.bundle_out)}")
    return 0


def rotate_key_cmd(args) -> int:
    from ..keys import rotate_signing_key

    old, new, archive = rotate_signing_key()
    print(f"signing key {old} archived as {archive}; the new key is {new}. Each ledger hands over at its next "
          "append; publish the new public key (`hf-unlearn requests public-key`) beside the old one")
    return 0


def plan_cmd(args) -> int:
    from ..deletion.service import format_plan

    p = _ledger(args).plan(args.now)
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0


def serve_cmd(args) -> int:
    from ..deletion.config import parse_method_args
    from ..deletion.service import Policy, ServeBusy

    ledger = _ledger(args)
    exact = {"oracle": args.oracle, "tokenizer_path": args.tokenizer_path, "collator": args.collator,
             "repo": args.repo, "endpoint": args.endpoint, "token": args.token, "progress": args.progress,
             "accept_unproven": args.accept_unproven}
    approx = {"method_args": parse_method_args(args.method_args), "progress": args.progress}
    try:
        if args.due:
            policy = Policy.load(args.policy)
            if not args.oracle:
                exact.pop("oracle")
            out = ledger.serve_due(policy, now=args.now, model=args.model,
                                   approximate_options={**approx, "data": args.data}, **exact)
            if out["approximate"] is not None:
                _print_result(out["approximate"])
            if out["exact"] is not None:
                _print_result(out["exact"])
            if out.get("purge") is not None:
                print(out["purge"].summary())
            print(out["message"])
            return 0
        if args.exact:
            result = ledger.serve_exact(now=args.now, **exact)
        else:
            result = ledger.serve_approximate(method=args.method, model=args.model, data=args.data, now=args.now,
                                              **approx)
    except ServeBusy as e:
        print(str(e))
        return 0
    if result is None:
        print("nothing to serve: no pending request" + ("" if args.exact else " that nothing has served yet"))
        return 0
    _print_result(result)
    return 0 if (result.forget_receipt.ok or result.kind != "exact") else 1


def _print_result(result) -> None:
    receipt = result.forget_receipt
    print("\n== " + result.name + (" (resumed after an interruption)" if result.resumed else ""))
    print(receipt.summary_table())
    for rid, path in result.receipts.items():
        print(f"  {rid}: {path}")
    if result.batch_receipt:
        print(f"  batch receipt: {result.batch_receipt}")


def verify_cmd(args) -> int:
    from ..deletion.receipts import verify_receipt

    report = verify_receipt(args.receipt, args.public_key, ledger=args.ledger, model=args.model)
    print(report.summary())
    return 0 if report.ok else 1


def public_key_cmd(args) -> int:
    from ..keys import default_signing_key_path, load_signing_key, public_key_pem

    pem = public_key_pem(load_signing_key())
    if args.key_out:
        from ..utils import atomic_write_text

        atomic_write_text(args.key_out, pem)
        print(f"public key of {default_signing_key_path()} written to {args.key_out}")
    else:
        print(pem, end="")
    return 0
