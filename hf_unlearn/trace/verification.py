"""Bit-exact verification of a replay against the oracle, and distances of the naive baselines.

Parameters (each tied tensor once) and optimizer state (moments and step counts, named ``<param>.<key>``) are
compared tensor by tensor on their raw bytes; the SHA-256 state-hash roots of :mod:`hf_unlearn.trace.hashing` are
reported too. Each state is checked against its checkpoint's ``hashes.json`` as it is loaded.

``verified`` needs more than equal states: the two folders must be a replay and an oracle of the same recorded
run for the same deleted ids (checked from their headers and deletion logs), so a folder compared with itself, or
with an oracle of another request, is not VERIFIED. What it does not prove: that the recorded run itself is what
was trained (the trace is the claim), nor anything a hazard the run was recorded with (``hazards``) puts in doubt.

The verdict is kept in the replay's folder as ``verification.json``, sealed with the replay's run key; the card,
the publisher and ``hub verify --expect-from`` believe it only under that seal (:func:`sealed_verdict`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .fidelity import fidelity_statement, refusal
from .guards import describe_program_change, guard_coverage, program_changes, unproven_changes
from .hashing import NAMES_KEY, PLAIN, StateHashes, optimizer_tensors, tensor_hashes
from .proven import output_unproven, ranges, unproven_starts_clause, unproven_steps
from .run import check_run, checkpoint_dir, list_checkpoints, load_checkpoint, read_deletion_log
from .tags import run_key, verdict_mac

VERIFICATION_FILE = "verification.json"
REVERIFY = "run `hf-unlearn trace verify REPLAY_DIR ORACLE_DIR` again (it only compares the two folders)"


def _named_optimizer(state: dict) -> dict[str, torch.Tensor]:
    return optimizer_tensors(state["optimizer"], state.get("param_names"))


def state_roots(state: dict) -> StateHashes:
    """The roots as the state's ``hashes.json`` computes them (its hash rule: :data:`~.hashing.NAMES_KEY`)."""
    params = tensor_hashes(state["model"], state.get(NAMES_KEY, PLAIN) == PLAIN)
    opt = tensor_hashes(_named_optimizer(state))
    return StateHashes(params=params, optimizer=opt)


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    mismatched, elements, diff_elems, sq = [], 0, 0, 0.0
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            mismatched.append(name)
            continue
        x, y = x.detach().cpu().contiguous(), y.detach().cpu().contiguous()
        elements += x.numel()
        same_bytes = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not same_bytes:
            mismatched.append(name)
            xb, yb = x.reshape(-1).view(torch.uint8).reshape(x.numel(), -1), y.reshape(-1).view(torch.uint8).reshape(
                y.numel(), -1)
            diff_elems += int((xb != yb).any(dim=1).sum())
            if x.is_floating_point():
                sq += float(((x.double() - y.double()) ** 2).sum())
            else:
                sq += float(((x.double() - y.double()) ** 2).sum())
    return {"identical": not mismatched, "tensors": len(set(a) | set(b)), "mismatched_tensors": mismatched,
            "elements": elements, "mismatched_elements": diff_elems, "l2": sq ** 0.5}


def compare_states(a: dict, b: dict) -> dict:
    """Compare two checkpoint dicts (``model``, ``optimizer``, ``param_names``, ``tied``) bit for bit."""
    params = _compare(a["model"], b["model"])
    if a.get("tied", {}) != b.get("tied", {}):
        params["identical"] = False
        params["mismatched_tensors"].append("(the tie maps differ)")
    opt = _compare(_named_optimizer(a), _named_optimizer(b))
    ha, hb = state_roots(a), state_roots(b)
    return {
        "identical": params["identical"] and opt["identical"] and ha.root == hb.root,
        "params": params,
        "optimizer": opt,
        "roots": {"a": {"params": ha.params_root, "optimizer": ha.optimizer_root},
                  "b": {"params": hb.params_root, "optimizer": hb.optimizer_root}},
    }


def load_state(path) -> dict:
    """A final state from a run folder (its last checkpoint), a checkpoint folder, or a ``.pt`` file."""
    path = Path(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    if (path / "state.pt").exists() or (path / "checkpoint.json").exists():
        return load_checkpoint(path)
    if not path.exists():
        raise UnlearnError(f"{path} does not exist: pass a replay/oracle output folder, a checkpoint folder or a .pt file")
    cps = list_checkpoints(path)
    if not cps:
        raise UnlearnError(f"{path} holds no checkpoint: pass a replay/oracle output folder, a checkpoint folder or "
                           "a .pt state file")
    return load_checkpoint(cps[max(cps)])


def deleted_tags(run_dir) -> set[str]:
    """Keyed tags of every id a run folder's deletion log says was deleted (all requests)."""
    return {t for entry in read_deletion_log(run_dir) for t in entry.get("forget_tags", [])}


def check_provenance(replay_out, oracle_out) -> dict:
    """Are these a replay and an oracle of the same recorded run, for the same deleted ids? (``problems`` if not;
    ``controls`` says whether each run's controls are keyed and checked, ``notes`` what that does not cover)"""
    replay_out, oracle_out = Path(replay_out), Path(oracle_out)
    problems, notes, controls = [], [], {}
    headers = {}
    for role, path in (("replay", replay_out), ("oracle", oracle_out)):
        if not (path / "header.json").is_file():
            problems.append(f"{path} is not a run folder (no header.json): where its state came from is not checked")
            continue
        rep, header, plan = check_run(path, key=run_key(path, required=False), check_checkpoints=True)
        problems += [f"{path}: {e}" for e in rep.errors]
        uncovered = guard_coverage(plan, header)
        if uncovered:
            problems.append(f"{path}: {uncovered}")
        start = (header.get("parent") or {}).get("start_step", 0)
        late = [c for c in program_changes(plan, header) if c["step"] >= start or c.get("persistent")]
        total = header.get("optimizer_steps") or 0
        if late and (unproven_steps(header, start, total)  # proven: the engine does it, on these rows
                     or unproven_changes(late, header, start, total)):  # and on a deletion's
            problems.append(f"{path}: the run changed outside its record {describe_program_change(late[0])}, in the "
                            f"range the {role} replayed (from step {start})")
        notes += [f"{path}: {n}" for n in rep.notes]
        controls[role] = rep.summary.get("controls")
        headers[role] = header
    if len(headers) == 2:
        replay, oracle = headers["replay"], headers["oracle"]
        if replay_out.resolve() == oracle_out.resolve():
            problems.append("the replay and the oracle are the same folder")
        if (replay.get("parent") or {}).get("mode") != "replay":
            problems.append(f"{replay_out} is not the output of a replay (RedactedReplayTrainer / trace replay)")
        parent = oracle.get("parent") or {}
        if parent.get("mode") != "oracle" or parent.get("start_step") != 0:
            problems.append(f"{oracle_out} is not the output of a full oracle replay (OracleReplayTrainer / trace oracle)")
        if replay.get("origin_run_id") != oracle.get("origin_run_id"):
            problems.append("the replay and the oracle come from different recorded runs")
        a, b = deleted_tags(replay_out), deleted_tags(oracle_out)
        if a != b:
            problems.append(f"the replay and the oracle deleted different ids ({len(a - b)} only in the replay, "
                            f"{len(b - a)} only in the oracle)")
        if replay.get("optimizer_steps") != oracle.get("optimizer_steps"):
            problems.append("the replay and the oracle end at different optimizer steps")
    for role, header in headers.items():
        why = refusal(header)
        if why:
            problems.append(f"the {role}'s run: {why}")
    unproven = {}
    if len(headers) == 2:  # VERIFIED needs every step the replay and the oracle ran proven (hf_unlearn.trace.proof)
        for role, path in (("replay", replay_out), ("oracle", oracle_out)):
            missing = output_unproven(headers[role], path, role)
            if missing:
                unproven[role] = missing
    hazards = sorted({h for h in (headers.get("replay") or {}).get("hazards", [])})
    fidelity = {role: fidelity_statement(header) for role, header in headers.items()}
    return {"checked": len(headers) == 2, "problems": problems, "hazards": hazards, "fidelity": fidelity,
            "unproven": unproven,
            "controls": controls, "notes": notes,
            "deleted_ids": len(deleted_tags(replay_out)) if "replay" in headers else None,
            }


def verify(replay_out, oracle_out) -> dict:
    """Compare a replay with the oracle; add the distances of any baselines stored in ``oracle_out/baselines``.

    ``identical``: parameters and optimizer state are bit-identical. ``verified``: identical, and the provenance
    check (:func:`check_provenance`) found nothing wrong.
    """
    oracle = load_state(oracle_out)
    report = compare_states(load_state(replay_out), oracle)
    report["provenance"] = check_provenance(replay_out, oracle_out)
    unproven = report["provenance"]["unproven"]
    report["unproven_steps"] = sorted({s for u in unproven.values() for s in u["steps"]})
    report["unproven_starts"] = sorted({s for u in unproven.values() for s in u["starts"]})  # fresh starts unproven
    report["verified"] = report["identical"] and not report["provenance"]["problems"] and not unproven
    report["verdict"] = verdict(report)
    fidelity = report["provenance"].get("fidelity", {})
    report["fidelity"] = fidelity.get("oracle") or fidelity.get("replay") or "no run folders: fidelity not checked"
    baselines = {}
    for f in sorted(Path(oracle_out).glob("baselines/*.pt")):
        cmp = compare_states(load_state(f), oracle)
        baselines[f.stem] = {"params_mismatched_elements": cmp["params"]["mismatched_elements"],
                             "params_elements": cmp["params"]["elements"], "params_l2": cmp["params"]["l2"],
                             "optimizer_l2": cmp["optimizer"]["l2"], "identical": cmp["identical"]}
    report["baselines"] = baselines
    _record_verification(Path(replay_out), Path(oracle_out), report)
    return report


def verdict(report: dict) -> str:
    """The verdict in a few words: VERIFIED only when bit-identical, the provenance holds and every step the replay
    and the oracle ran is proven (an unproven range gets its own verdict, never VERIFIED)."""
    if report["verified"]:
        return "VERIFIED bit-identical to the oracle"
    if not report["identical"]:
        return "NOT identical to the oracle"
    if report["provenance"]["problems"]:
        return "bit-identical to the oracle but NOT VERIFIED (provenance)"
    return (f"bit-identical to the oracle; steps {ranges(report['unproven_steps'])} of the engine unproven"
            f"{unproven_starts_clause(report.get('unproven_starts'))} (not verified: `hf-unlearn trace prove RUN` "
            "proves them)")


def _record_verification(replay_out: Path, oracle_out: Path, report: dict) -> None:
    """Keep the verdict next to the replay (``verification.json``) so its model card can state it, sealed with the
    replay's run key (:func:`hf_unlearn.trace.tags.verdict_mac`: bound to the replay's run id, the oracle's and both
    final roots; :func:`sealed_verdict` checks it). The file is published with the run's provenance: the oracle is
    named by its run id and the folders in the problems by their role, never by their local paths or names."""
    import json
    import warnings

    header = replay_out / "header.json"
    if not header.is_file():
        return
    replay = json.loads(header.read_text())
    if (replay.get("parent") or {}).get("mode") != "replay":
        return

    oracle_header = oracle_out / "header.json"
    oracle_id = json.loads(oracle_header.read_text()).get("run_id") if oracle_header.is_file() else None
    roles = {replay_out: "the replay folder", oracle_out: "the oracle folder"}
    summary = {"identical": report["identical"], "verified": report["verified"], "run_id": replay.get("run_id"),
               "oracle_run_id": oracle_id,
               "unproven_steps": report["unproven_steps"], "unproven_starts": report["unproven_starts"],
               "verdict": report["verdict"],
               "roots": report["roots"],
               "provenance_problems": [_without_folders(p, roles) for p in report["provenance"]["problems"]],
               "params_mismatched_elements": report["params"]["mismatched_elements"],
               "optimizer_mismatched_elements": report["optimizer"]["mismatched_elements"]}
    try:
        key = run_key(replay_out, replay, required=False)
    except UnlearnError:
        key = None
    if key is None:
        warnings.warn(f"{replay_out}: the replay's run key is not on this machine, so {VERIFICATION_FILE} is written "
                      "unsealed and its card will not say verified; verify where the key is", stacklevel=3)
    else:
        summary["mac"] = verdict_mac(key, str(replay.get("run_id")), summary)
    atomic_write_text(replay_out / VERIFICATION_FILE, json.dumps(summary, indent=1))


def sealed_verdict(replay_out) -> tuple[dict | None, str | None]:
    """A replay's ``verification.json`` if it carries the seal :func:`verify` put on it for this very replay.

    Returns ``(verdict, None)`` when the seal verifies under the replay's run key with the run id of its
    ``header.json``, and its roots are those of the replay's final checkpoint (where the folder holds one);
    ``(None, why)`` otherwise, ``why`` a clause about the file (an edited or copied verdict, a removed seal, a file
    from before verdicts were sealed, a key not on this machine) to follow its name; ``(None, None)`` with no file.
    The seal is a check only the key holder can make: a downloaded copy of the folder cannot check it.
    """
    import hmac
    import json

    replay_out = Path(replay_out)
    path = replay_out / VERIFICATION_FILE
    if not path.is_file():
        return None, None
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "is not valid JSON (damaged)"
    if not isinstance(verdict, dict):
        return None, "is not a verification record (not a JSON object)"
    if not verdict.get("mac"):
        return None, "carries no seal (written before verdicts were sealed, or its seal was removed)"
    try:
        header = json.loads((replay_out / "header.json").read_text())
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        return None, "has no readable header.json beside it, so its seal cannot be checked"
    try:
        key = run_key(replay_out, header, required=False)
    except UnlearnError:  # a key file others can read: refused, as everywhere
        key = None
    if key is None:
        return None, "cannot have its seal checked here (the replay's run key is not on this machine, or is refused)"
    if verdict.get("run_id") != header.get("run_id") or not hmac.compare_digest(
            str(verdict["mac"]), verdict_mac(key, str(header.get("run_id")), verdict)):
        return None, "does not carry this replay's seal (edited, or copied from another replay)"
    final = checkpoint_dir(replay_out, header.get("optimizer_steps") or 0) / "hashes.json"
    if final.is_file():  # a published copy holds no checkpoint: the seal's run id binds it there
        final = json.loads(final.read_text())
        roots = (verdict.get("roots") or {}).get("a") or {}
        if (roots.get("params"), roots.get("optimizer")) != (final.get("params_root"), final.get("optimizer_root")):
            return None, "is about another state than the replay's final checkpoint (the replay changed after verify)"
    return verdict, None


def require_sealed_verdict(replay_out, refusing: str) -> dict | None:
    """:func:`sealed_verdict`'s verdict, or one line ``"{refusing}: it <why>; run trace verify again"`` raised (the
    publishing path and ``hub verify --expect-from`` believe no verdict without this replay's seal)."""
    verdict, why = sealed_verdict(replay_out)
    if why:
        raise UnlearnError(f"{refusing}: it {why}; {REVERIFY}")
    return verdict


def _without_folders(text: str, names: dict) -> str:
    """``text`` with the folders of ``names`` (``{path: what to say instead}``) replaced: their absolute forms
    anywhere, a relative form where the text starts with it (a problem names its folder first)."""
    import os

    for path, name in names.items():
        given, absolute = str(path), str(Path(path).resolve())
        for form in sorted({absolute, given if os.path.isabs(given) else absolute}, key=len, reverse=True):
            text = text.replace(form, name)
        if text.startswith(given) and text[len(given):len(given) + 1] in (":", " ", ""):
            text = name + text[len(given):]
    return text


verify_replay = verify  # the top-level name: ``hf_unlearn.verify_replay(replay_out, oracle_out)``
