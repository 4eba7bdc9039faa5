"""What a run's header says is proven: the steps the engine was shown to reproduce, and the refusal of the rest.

:mod:`hf_unlearn.trace.proof` proves a run (it replays it); this module only reads the sealed outcome (the proof
and the recording's self-check in ``header.json``'s ``fidelity``), so the guards, the verdicts and every deletion
check a range of steps without reaching up to the replay engine. :mod:`hf_unlearn.trace.proof` re-exports it.
"""

from __future__ import annotations

from ..errors import UnlearnError
from ..version import __version__

PROVE_COMMAND = "hf-unlearn trace prove {run}"
# how a replay's fresh start at a kept checkpoint was proven: by the proof (a continuous replay from step 0, or
# `--fresh-starts`), by the deletion's replay itself (its first step, before the first affected one, matched the
# recording), or by a probe step from that checkpoint with no deletion (the first step is affected)
START_PROVEN_BY = ("proof", "replay", "probe")


class ProofError(UnlearnError):
    """The deleting environment, or the engine, does not reproduce the recorded run."""



def engine() -> dict:
    """Which engine a proof ran: the library and the versions that compute the replay."""
    import torch
    import transformers

    return {"hf_unlearn": __version__, "torch": torch.__version__, "transformers": transformers.__version__}



def proven_steps(header: dict) -> tuple[set[int], list[str]]:
    """The optimizer steps the engine was shown to reproduce (the sealed proof and the recording's self-check), and
    why a proof present does not count (another run's, another engine's)."""
    fid = header.get("fidelity") or {}
    steps, why = set(), []
    rec = fid.get("recording") or {}
    if rec.get("checked") and rec.get("reproduced") and rec.get("steps"):
        steps |= set(range(rec["steps"][0], rec["steps"][1]))  # the self-check replays steps 0..N - 1
    proof = fid.get("proof")
    if proof:
        ids = {header.get("run_id"), header.get("origin_run_id")}
        if proof.get("run_id") not in ids:
            why.append(f"the proof in header.json is another run's (run id {proof.get('run_id')})")
        elif (proof.get("engine") or {}).get("hf_unlearn") != engine()["hf_unlearn"]:
            why.append(f"the proof ran engine hf_unlearn {(proof.get('engine') or {}).get('hf_unlearn')}, this is "
                       f"{engine()['hf_unlearn']}: prove the run again with this engine")
        elif proof.get("steps"):
            steps |= set(range(proof["steps"][0], proof["steps"][1] + 1))
    return steps, why



def proof_starts(header: dict) -> set[int]:
    """The kept checkpoints the proof (or the self-check) showed a replay started afresh reproduces from: step 0 (the
    continuous replay from step 0), and each checkpoint ``trace prove --fresh-starts`` proved."""
    steps, why = proven_steps(header)
    proof = (header.get("fidelity") or {}).get("proof") or {}
    return ({0} if 0 in steps else set()) | (set() if why else set(proof.get("starts") or []))


def replay_start(header: dict) -> dict | None:
    """A replay output's own start, proven where it was used (``fidelity.start``: ``{"checkpoint", "proven_by",
    "run_id"}``, written by the replay under the run key's seal): counted only for the start this output's replay
    made from its parent (``parent.start_step`` of ``parent.run_id``), never carried to another run or start."""
    start, parent = (header.get("fidelity") or {}).get("start") or {}, header.get("parent") or {}
    if (start.get("proven_by") in START_PROVEN_BY and start.get("checkpoint") == parent.get("start_step")
            and start.get("run_id") == parent.get("run_id") is not None):
        return start
    return None


def proven_starts(header: dict) -> set[int]:
    """The kept checkpoints a replay started afresh was shown to reproduce from: :func:`proof_starts`, and a replay
    output's own start (:func:`replay_start`)."""
    own = replay_start(header)
    return proof_starts(header) | ({own["checkpoint"]} if own else set())


def resumed_at(header: dict) -> list[int]:
    """The kept checkpoints where a valid proof, killed, went on from a fresh start (``fidelity.proof.resumed_at``)."""
    _, why = proven_steps(header)
    return [] if why else [int(c) for c in ((header.get("fidelity") or {}).get("proof") or {}).get("resumed_at") or []]


def _continuous(header: dict) -> set[int]:
    """The steps the recording's own self-check replayed in one go from step 0 (never resumed)."""
    rec = (header.get("fidelity") or {}).get("recording") or {}
    ok = rec.get("checked") and rec.get("reproduced") and rec.get("steps")
    return set(range(rec["steps"][0], rec["steps"][1])) if ok else set()


def through_restart(header: dict, first: int, stop: int) -> tuple[int | None, list[int]]:
    """A replay from ``first`` to ``stop`` that runs on through a checkpoint where a killed proof resumed from a fresh
    start: that checkpoint and the steps from it that nothing else proved continuous (the resumed proof started
    afresh there, so it did not see what a replay carries on through it, e.g. live state a checkpoint restores)."""
    for c in sorted(resumed_at(header)):
        if first < c < stop:
            done = _continuous(header)
            missing = [s for s in range(c, stop) if s not in done]
            if missing:
                return c, missing
    return None, []


def unproven_steps(header: dict, first: int, stop: int, fresh_start: bool = True) -> list[int]:
    """The steps of ``first..stop - 1`` (a replay from the kept checkpoint at ``first``) that neither the proof nor
    the self-check covers; all of them when a replay started afresh at ``first`` is not proven (a checkpoint does
    not hold everything the recording carried there: a module attribute a callback set earlier).
    ``fresh_start=False``: the start is left to the deletion that uses it (proven there, before any deleted row
    trains: :func:`hf_unlearn.trace.proof.before_deletion`), only the steps are asked about."""
    steps, _ = proven_steps(header)
    if fresh_start and first < stop and first not in proven_starts(header):
        return list(range(first, stop))
    _, through = through_restart(header, first, stop)
    return sorted({s for s in range(first, stop) if s not in steps} | set(through))


def neutral_controls(header: dict) -> set[int]:
    """Proven steps where the proof's replay (from step 0, as the oracle runs) had other program controls than the
    recording while its state was the recording's: numerically neutral differences a replay does not make (gradient
    checkpointing switched on mid-run by a callback replays do not run). A replay does not stop on them; on every other
    step a controls difference still stops it (an engine fault after the first affected step is caught there)."""
    steps, _ = proven_steps(header)
    proof = (header.get("fidelity") or {}).get("proof") or {}
    return {s for s in proof.get("neutral_controls", []) if s in steps}



def diverged(header: dict) -> dict | None:
    """The first step where a proof found the engine does not reproduce the run (``{"step", "why"}``), or None."""
    return ((header.get("fidelity") or {}).get("proof") or {}).get("diverged")



def ranges(steps: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    out, run = [], []
    for s in sorted(steps):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)



def launch_command(world: int, command: str, run_path) -> str:
    """The command line that runs ``hf-unlearn COMMAND RUN`` with ``world`` processes."""
    if world == 1:
        return f"hf-unlearn {command} {run_path}"
    return f"torchrun --nproc_per_node {world} -m hf_unlearn.cli {command} {run_path}"


def failed_starts(header: dict) -> dict[str, str]:
    """The kept checkpoints whose fresh start a valid proof (``--fresh-starts``) found does not reproduce the
    recording, with what differed."""
    _, why = proven_steps(header)
    return {} if why else dict(((header.get("fidelity") or {}).get("proof") or {}).get("start_failures") or {})


def fresh_start_failure(checkpoint: int, detail: str) -> str:
    """Why a replay started afresh at ``checkpoint`` is refused, in words (the proof's, the replay's, the probe's)."""
    return (f"a replay started afresh at checkpoint {checkpoint} does not reproduce the recording (the checkpoint does "
            f"not hold something the recording carried there, e.g. a callback's earlier change: a module attribute, "
            f"a learning rate or dropout state set before it): {detail}")


def fresh_start_refusal(run_path, checkpoint: int, detail: str, before: str = "any compute") -> ProofError:
    """The one-line refusal of a deletion whose replay, started afresh at ``checkpoint``, does not reproduce the
    recording (the proof's, the probe's or the replay's own first step found it)."""
    return ProofError(f"{run_path}: {fresh_start_failure(checkpoint, detail)}; refusing before {before} (a deletion of "
                      "rows trained before the checkpoint replays from an earlier one)")


def unproven_start(header: dict, first: int, stop: int) -> int | None:
    """The kept checkpoint ``first`` when a replay started afresh there (after step 0) runs steps ``first..stop - 1``
    and nothing proves that start (:func:`proven_starts`), else None: a receipt and ``trace verify`` name it, since
    every step that replay runs is then unproven however much of the run the proof covers."""
    if 0 < first < stop and first not in proven_starts(header):
        return first
    return None


def unproven_statement(header: dict, run_path, first: int, stop: int, who: str = "the replay",
                       fresh_start: bool = True) -> str | None:
    """Why the steps ``first..stop - 1`` are not proven, in one sentence (None when all are); ``fresh_start`` as in
    :func:`unproven_steps`. Each cause is named: an unproven fresh start at ``first`` and the proof's own gaps."""
    failed = failed_starts(header)
    missing = unproven_steps(header, first, stop, fresh_start)
    if not fresh_start and str(first) in failed and first < stop:
        missing = list(range(first, stop))  # the proof found this start fails: no deletion is left to prove it
    if not missing:
        return None
    _, why = proven_steps(header)
    div = diverged(header)
    prove = launch_command(int(header.get("world_size", 1) or 1), "trace prove", run_path)
    causes = []
    if str(first) in failed and first < stop:
        causes.append(fresh_start_failure(first, failed[str(first)]))
    elif fresh_start and unproven_start(header, first, stop) is not None:
        causes.append(f"a replay started afresh at checkpoint {first} is not proven (a deletion proves its own start "
                      f"where it starts: forget, trace replay; or prove every start ahead: `{prove} --fresh-starts`)")
    restart, through = through_restart(header, first, stop)
    if through:
        causes.append(f"the proof was resumed after a kill from a fresh start at kept checkpoint {restart}, so a replay "
                      f"that runs on through it from an earlier start is not proven there (run `{prove}` again, "
                      "uninterrupted: it replays from step 0)")
    if div:
        causes.insert(0, f"a proof found the engine does not reproduce the run from optimizer step {div['step']}: "
                         f"{div['why']}")
    elif why:
        causes.insert(0, why[0])
    elif [s for s in unproven_steps(header, first, stop, fresh_start=False) if s not in through] or not causes:
        rec = (header.get("fidelity") or {}).get("recording") or {}
        if rec.get("proof_failed"):  # the proof at the end of recording stopped: its own words (a stand-in, ...)
            causes.append(f"the proof at the end of recording stopped: {rec['proof_failed']}")
        if rec.get("checked") and rec.get("reproduced") is False and rec.get("why"):  # say what the check found
            causes.append(f"the recording's own self-check found the engine does not reproduce it ({rec['why']})")
        causes.append(f"prove the run once (`{prove}`, about one training run's compute)")
    return f"steps {ranges(missing)} that {who} runs are not proven to be reproduced by the engine; " + "; ".join(causes)


def output_unproven(header: dict, path, role: str) -> dict | None:
    """What of the steps a replay or oracle output ran (from its parent's ``start_step`` to its end) is not proven,
    read from its own sealed header as ``trace verify`` reads it: ``{"steps", "starts", "why"}`` (``starts``: its
    fresh start when nothing proved it, :func:`unproven_start`), or None when every step is."""
    first, stop = (header.get("parent") or {}).get("start_step", 0), header.get("optimizer_steps") or 0
    missing = unproven_steps(header, first, stop)
    if not missing:
        return None
    start = unproven_start(header, first, stop)
    return {"steps": missing, "starts": [] if start is None else [start],
            "why": unproven_statement(header, path, first, stop, f"the {role}")}


def unproven_starts_clause(starts) -> str:
    """``", among them the replay's fresh start at kept checkpoint 2"``: how a verdict names an unproven start."""
    return f", among them the replay's fresh start at kept checkpoint {ranges(starts)}" if starts else ""


def proof_statement(header: dict) -> str:
    """One sentence on the run's proof (for inspect, receipts and verify)."""
    proof = (header.get("fidelity") or {}).get("proof")
    if not proof:
        return "not proven (no `hf-unlearn trace prove` run yet)"
    div = proof.get("diverged")
    world = len(proof.get("processes") or [0])
    on = f", on each of {world} processes" if world > 1 else ""
    if proof.get("proven"):
        text = f"proven: the engine reproduced every optimizer step 0..{proof['steps'][1]} (state after each step{on})"
        later = sorted(c for c in proof.get("starts") or [] if c > 0)
        text += (f", and a replay started afresh at kept checkpoint(s) {ranges(later)}" if later else
                 ", in one replay from step 0 (a replay started afresh at a later kept checkpoint is proven by the "
                 "deletion that uses it)")
        if proof.get("resumed_at"):
            text += (f"; resumed after a kill from a fresh start at kept checkpoint(s) {ranges(proof['resumed_at'])} "
                     "(a replay running on through one from an earlier start is not proven past it)")
    elif div:
        text = (f"NOT PROVEN from optimizer step {div['step']}: the engine does not reproduce the run there"
                + (f" (steps 0..{proof['steps'][1]} reproduced)" if proof.get("steps") else ""))
    else:
        text = f"partly proven: steps 0..{proof['steps'][1]}" if proof.get("steps") else "not proven"
    _, why = proven_steps(header)
    return text + (f"; {why[0]}" if why else "")



def check_proven(run, first: int, stop: int, oracle: bool, accept_unproven: bool, log=None) -> list[int]:
    """Before a deletion: the unproven steps of its replay (``first..stop - 1``) and oracle (``0..stop - 1``); refuse
    them (:class:`ProofError`) unless ``accept_unproven``. Returns the unproven steps. A replay's fresh start at
    ``first`` is not asked about here: the deletion proves it where it is used (:func:`hf_unlearn.trace.proof.
    before_deletion`), unless a proof already found it fails."""
    header, who = run.header, "the oracle and the replay" if oracle else "the replay"
    why = unproven_statement(header, run.path, 0 if oracle else first, stop, who, fresh_start=False)
    if oracle and first and why is None:  # a proof that found the replay's start fails
        why = unproven_statement(header, run.path, first, stop, who, fresh_start=False)
    if why is None:
        return []
    if not accept_unproven:
        raise ProofError(f"{run.path}: {why}; refusing before any compute (or accept an unproven deletion: "
                         "--accept-unproven / accept_unproven=True; its receipt names the unproven steps and it is "
                         "never VERIFIED)")
    if log:
        log(f"UNPROVEN (accepted): {why}")
    missing = set(unproven_steps(header, 0 if oracle else first, stop, fresh_start=False))
    if str(first) in failed_starts(header):
        missing |= set(range(first, stop))
    return sorted(missing)
