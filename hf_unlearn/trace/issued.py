"""Evidence handed from one call to the next in this process: a probe's outcome, believed only where it was issued.

A deletion probes before its compute (:func:`hf_unlearn.trace.proof.before_deletion`) and hands the outcome to the
replay it then runs (``proven_start=``, ``environment_probe=``): the replay skips the work the probe did. A dict is
easy to write by hand, edit, keep from another run or load from another process's JSON, and any of those would make
a replay skip a check nobody ran here. So each outcome carries a tag: an HMAC, under a key this process draws at
random and never writes anywhere, over what it says, the run it is about and what kind of outcome it is. A dict
without this process's tag for that run proves nothing and is refused in one line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path

from ..errors import UnlearnError

TAG = "issued"  # the field the tag travels in
_KEY = secrets.token_bytes(32)  # this process's; gone when it ends, so nothing issued here is believed elsewhere


def _about(run) -> str:
    """The run an outcome is about: its id and its folder (a copy of a run elsewhere is another run's checkpoints)."""
    return f"{run.header.get('run_id')}\0{Path(run.path).resolve()}"


def _tag(kind: str, run, body: dict) -> str:
    text = json.dumps(body, sort_keys=True, default=repr).encode()
    return hmac.new(_KEY, b"hf_unlearn.issued\0" + kind.encode() + b"\0" + _about(run).encode() + b"\0" + text,
                    hashlib.sha256).hexdigest()


def issue(kind: str, run, outcome: dict | None) -> dict | None:
    """``outcome`` with this process's tag for ``run`` (None stays None: nothing was proven)."""
    body = untagged(outcome)
    return None if body is None else {**body, TAG: _tag(kind, run, body)}


def believed(kind: str, run, given: dict | None, argument: str, source: str) -> dict | None:
    """``given`` without its tag when this process issued it for ``run`` as a ``kind``; None stays None. Else raise
    in one line naming ``argument`` and the call (``source``) that issues it: a hand-written, edited, foreign or
    other-run outcome would make the replay skip a check nobody ran in this process."""
    if given is None:
        return None
    body = untagged(given) if isinstance(given, dict) else None
    tag = given.get(TAG) if isinstance(given, dict) else None
    if body is None or not isinstance(tag, str) or not hmac.compare_digest(tag, _tag(kind, run, body)):
        why = ("it is not a dict" if body is None else "it carries no tag: written by hand, or saved and loaded"
               if tag is None else "it was edited, issued for another run or folder, or in another process")
        raise UnlearnError(f"{argument}= was not issued for {run.path} in this process ({why}): it would make the "
                           f"replay skip a check nobody ran here; pass what {source} returns in this process, or "
                           f"leave {argument}= out")
    return body


def untagged(outcome: dict | None) -> dict | None:
    """``outcome`` as written into a receipt or log: without the tag (it means nothing outside this process)."""
    return None if outcome is None else {k: v for k, v in outcome.items() if k != TAG}
