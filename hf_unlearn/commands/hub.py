"""`hf-unlearn hub ...`: push an unlearned model, verify a published revision, serve a local Hub, show the key."""

from __future__ import annotations

import json

from . import add_subcommands


def add_server_limits(p) -> None:
    """The web stack's limits (hf_unlearn.web.server.Limits) as options, one list for `hub serve` and `requests web`."""
    p.add_argument("--read-timeout", type=float, default=60.0,
                   help="close a connection idle (or stalled mid-request) this many seconds (default %(default)s)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="connections open at once (asyncio: a few KB each); more get 503 (default %(default)s)")
    p.add_argument("--max-connections-per-client", type=int, default=128,
                   help="connections open at once from one IP address; more get 503 (default %(default)s)")
    p.add_argument("--header-deadline", type=float, default=15.0,
                   help="seconds a request's line and headers may take to arrive (a client sending a header line now "
                        "and then cannot hold a connection past it; default %(default)s)")

def register(parser) -> None:
    sub = add_subcommands(parser)

    p = sub.add_parser("push", help="publish an output dir: weights, tokenizer, state hashes, card, in one commit",
                       description="Publish OUT (a trainer output dir with unlearning_info.json) to the Hub in one "
                                   "commit, optionally tagged (each deletion request gets its own tag).")
    p.add_argument("output_dir", metavar="OUT")
    p.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--revision", metavar="TAG", help="tag this push, e.g. deletion-0003 (tags are append-only)")
    p.add_argument("--deletion", action="store_true", help="tag this push with the next deletion-NNNN")
    p.add_argument("--branch", default="main", help="branch to commit to (default: main)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--card-info", metavar="FILE", help="unlearning_card_info() as JSON (default: OUT/unlearning_info.json)")
    p.add_argument("--base-model", help="Hub id of the model that was unlearned")
    p.add_argument("--dataset", action="append", dest="datasets", help="dataset Hub id (repeatable)")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--trace", metavar="DIR", help="recorded run (or replay output): its plan, WAL, manifest, "
                                                  "deletion log, header and sidecars go under provenance/ (checked)")
    p.add_argument("--message", help="commit message")
    p.add_argument("--tag", action="append", dest="tags", metavar="T", help="extra Hub tag for the card (repeatable)")
    p.add_argument("--not-id", action="append", dest="not_ids", metavar="FIELD=N[,N]",
                   help="a number in FIELD equals a forget id but is not one (e.g. hyperparameters.max_steps=3600; "
                        "FIELD=any for every number there); the refusal message names the field")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every file of --trace kept local (not published) with its reason (default: a count)")
    _common(p)
    p.set_defaults(func=_push)

    v = sub.add_parser("verify", help="download a revision, recompute state hashes, compare with card and manifest",
                       description="Exit 0 iff every tensor's hash and the roots match the manifest and the card.")
    v.add_argument("repo", metavar="ORG/NAME")
    v.add_argument("--revision", help="branch, tag (e.g. deletion-0003) or commit (default: main)")
    v.add_argument("--cache-dir", help="download cache (default: the Hugging Face cache)")
    v.add_argument("--expect-root", metavar="ROOT", help="the weights must hash to ROOT (the state-dict root from "
                                                         "your deletion log / hub_pushes.jsonl, or the saved-tensor "
                                                         "root): a value the repository cannot rewrite")
    v.add_argument("--expect-commit", metavar="SHA", help="the revision must be exactly this commit")
    v.add_argument("--expect-files-root", metavar="ROOT",
                   help="config, tokenizer and every other non-weight file must hash to ROOT (files_root in "
                        "hub_pushes.jsonl); --expect-root alone does not pin them")
    v.add_argument("--expect-card-sha256", metavar="SHA256",
                   help="the model card (README.md: method, claims, text) must be the one pushed (card_sha256 in "
                        "hub_pushes.jsonl); the card is outside the files root")
    v.add_argument("--expect-from", metavar="RECORD", help="take --expect-root, --expect-files-root, "
                                                           "--expect-card-sha256 and --expect-commit from your own "
                                                           "record: OUT/hub_pushes.jsonl (all four), a run's "
                                                           "deletion_log.jsonl or a replay's sealed verification.json "
                                                           "(the root only), or the folder holding it")
    v.add_argument("--no-load", action="store_true", help="do not load the model (verify then fails: loading is "
                                                           "part of the claim; for inspecting large models)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    _common(v)
    v.set_defaults(func=_verify)

    s = sub.add_parser("serve", help="run a local Hub-compatible server (tests, internal model stores)",
                       description="Serve a Hub-compatible API from DIR; point clients at it with HF_ENDPOINT "
                                   "and HF_HUB_DISABLE_XET=1.")
    s.add_argument("--root", required=True, metavar="DIR", help="storage directory (created if missing)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--token", action="append", required=True, metavar="T", help="accepted access token (repeatable)")
    s.add_argument("--user", default="user", help="user name the tokens belong to")
    s.add_argument("--max-body-mb", type=int, default=256, help="largest commit body accepted (MiB)")
    add_server_limits(s)
    s.add_argument("--verbose", action="store_true", help="log every request")
    s.set_defaults(func=_serve)

    k = sub.add_parser("key", help="the id-tagging key: where it is, its fingerprint; --rotate",
                       description="Show the one key that tags forget ids in cards, trace plans and deletion logs "
                                   "($HF_UNLEARN_TAG_KEY or $HF_UNLEARN_KEY_FILE, default "
                                   "~/.cache/hf_unlearn/id_tag.key). Back it up; keep it private.")
    k.add_argument("--rotate", action="store_true", help="archive the current key (id_tag.<fingerprint>.key) and "
                                                         "create a new one; older runs find the archived key")
    k.set_defaults(func=_key)


def _common(p) -> None:
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login)")
    p.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")


def _refuse_a_run_folder(folder: str) -> None:
    """`hub push` on a recorded run (or a forget output) asked for a card-info file: say what to push instead."""
    from pathlib import Path

    from ..errors import UnlearnError
    from ..validation import is_trace_run

    if is_trace_run(folder):
        raise UnlearnError(f"{folder} is a recorded run (a trace), not a model folder: `hf-unlearn forget {folder} "
                           "--ids FILE --out OUT --repo ORG/NAME` deletes, proves and publishes in one command; or "
                           "push the model folder of a finished deletion (OUT/model)")
    if (Path(folder) / "receipt.json").is_file() and (Path(folder) / "model").is_dir():
        raise UnlearnError(f"{folder} is the output of `hf-unlearn forget`: push its model folder, "
                           f"{Path(folder) / 'model'}")


def _push(args) -> int:
    from ..errors import UnlearnError
    from ..hub.leaks import parse_not_ids
    from ..hub.publish import ROOT_NAMES, load_card_info, push_unlearned

    if args.revision and args.deletion:
        raise UnlearnError("pass either --revision TAG or --deletion, not both")
    _refuse_a_run_folder(args.output_dir)
    if args.card_info:
        try:
            with open(args.card_info, encoding="utf-8") as f:
                card_info = json.load(f)
        except json.JSONDecodeError as e:
            raise UnlearnError(f"{args.card_info} is not valid JSON: {e}") from None
    else:
        card_info = load_card_info(args.output_dir)
    result = push_unlearned(
        args.output_dir, args.repo, card_info=card_info, tag=args.revision, deletion=args.deletion,
        revision=args.branch, private=args.private or None, token=args.token, endpoint=args.endpoint,
        base_model=args.base_model, datasets=args.datasets, license=args.license, trace_dir=args.trace,
        commit_message=args.message, extra_tags=args.tags, not_ids=parse_not_ids(args.not_ids),
    )
    if result.already_published:
        print(f"already published: {result.repo_id} {result.tag} (commit {result.commit}) holds these weights and "
              "files; nothing was pushed, no new tag")
    else:
        print(f"published {result.repo_id} commit {result.commit}" + (f" tag {result.tag}" if result.tag else ""))
    print(f"  {len(result.files)} files, {ROOT_NAMES['params_root']} {result.params_root}, "
          f"{ROOT_NAMES['state_dict_root']} {result.state_dict_root}")
    _print_kept_local(result.skipped_provenance, args.trace, args.verbose)
    print(f"  verify: {result.verify_command}")
    return 0


def _print_kept_local(skipped: dict[str, str], trace, verbose: bool) -> None:
    """The files of --trace that stay local: one line with a count per reason (a run has dozens: checkpoints, the
    token store), or each file with its reason under --verbose."""
    if verbose:
        for rel, why in sorted(skipped.items()):
            print(f"  kept local (not published): {rel}: {why}")
        return
    if skipped:
        counts: dict[str, int] = {}
        for why in skipped.values():
            head = why.split(" (")[0]
            counts[head] = counts.get(head, 0) + 1
        parts = ", ".join(f"{head}: {n}" for head, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        print(f"  kept local (not published): {len(skipped)} file(s) of {trace} ({parts}); --verbose lists them")


def _verify(args) -> int:
    import sys

    from ..errors import UnlearnError
    from ..hub.verify import expected_from, verify_on_hub

    expect = {"expect_root": args.expect_root, "expect_commit": args.expect_commit,
              "expect_files_root": args.expect_files_root, "expect_card_sha256": args.expect_card_sha256}
    if args.expect_from:
        found = expected_from(args.expect_from, args.repo, args.revision)
        hashes = found.pop("expect_file_hashes", None)  # names the differing files; no option of its own
        for name, value in found.items():
            if expect[name] and expect[name] != value:
                raise UnlearnError(f"--{name.replace('_', '-')} {expect[name]} disagrees with {args.expect_from} "
                                   f"({value}); pass one of them")
            expect[name] = value
        expect["expect_file_hashes"] = hashes
    report = verify_on_hub(args.repo, args.revision, token=args.token, endpoint=args.endpoint,
                           cache_dir=args.cache_dir, load=not args.no_load, **expect)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.summary(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _serve(args) -> int:
    import logging

    from ..hub.server import HubServer

    if args.verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(message)s")
    server = HubServer(args.root, {t: args.user for t in args.token}, host=args.host, port=args.port,
                       max_body_bytes=args.max_body_mb * 1024 * 1024, read_timeout=args.read_timeout,
                       max_connections=args.max_connections, header_deadline=args.header_deadline,
                       max_connections_per_client=args.max_connections_per_client)
    print(f"hf-unlearn hub serving {args.root} at {server.url}", flush=True)
    print(f"  export HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1", flush=True)
    server.serve_forever()  # Ctrl-C (or SIGTERM) stops it: requests in flight are given a few seconds to finish
    return 0


def _key(args) -> int:
    import os

    from ..hub.keys import KEY_ENV, default_key_path, key_fingerprint, load_key, rotate_key

    if args.rotate:
        old, new, archive = rotate_key()
        print(f"rotated: old key {old} archived as {archive}; new key {new} at {default_key_path()}")
        print("  back up both files; runs recorded with the old key find it in the archive")
        return 0
    key = load_key()
    where = f"${KEY_ENV}" if os.environ.get(KEY_ENV) else str(default_key_path())
    print(f"key {key_fingerprint(key)} from {where}")
    print("  tags model cards, trace plans/WALs and deletion logs; back it up (cp -p) and keep it mode 0600")
    return 0
