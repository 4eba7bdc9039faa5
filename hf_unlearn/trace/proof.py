"""The replay engine proven on the recorded run: positive evidence, not a list of what may change.

Lists of things that may change a run (learning rates, module attributes, hooks, environment variables) are never
complete. A **proof** is evidence instead: the replay engine re-runs the whole recorded run with no deletion, in one
replay from step 0 as the oracle runs, and its state after **every** optimizer step must equal the recording's per-step
fingerprint (the exact digest :mod:`hf_unlearn.trace.guards` computes right after ``optimizer.step()``), and its
state at every kept checkpoint the recorded checkpoint. Whatever the program did (a callback that lowers
``args.max_grad_norm``, an attention implementation switched mid-run, a thread count), if the engine does not do
the same, the state differs at that step and the proof names it.

* :func:`prove` (``hf-unlearn trace prove RUN``; ``trace_self_check="all"`` at the end of recording) costs about
  one training run's compute, once. It is resumable: each proven interval between kept checkpoints is written to
  ``RUN/proof_progress.json`` (atomically, under the run key), so a killed proof continues where it stopped. The
  outcome is sealed into ``header.json`` (``fidelity.proof``, under the run key's seal): the engine and numeric
  stack it ran with, the numeric environment variables, the processes, and the steps it covered or the first step
  where the engine diverged and what differed.
* A suffix replay's **fresh start** at a later kept checkpoint (checkpoint load, model rebuild, RNG and data position;
  a checkpoint does not hold a module attribute a callback set earlier) is proven where it is used: by the deletion's
  replay itself, before any deleted row trains (its first step, or, that step affected, a probe step from the
  checkpoint with no deletion: :func:`before_deletion`), or ahead by ``prove(..., fresh_starts=True)``
  (``--fresh-starts``).
* :func:`unproven_steps`: the steps of a range neither the proof nor the recording's self-check covers. A deletion
  is VERIFIED only when every step its replay and its oracle run is proven (:mod:`hf_unlearn.trace.verification`);
  ``forget`` and ``trace replay`` refuse an unproven range unless the user accepts it.
* :func:`probe_environment`: before any compute of a deletion, the deleting process(es) re-run the first recorded
  step, the kept-checkpoint step with the longest microbatch and, alone, the run's longest microbatch
  (:mod:`~hf_unlearn.trace.longest_microbatch`) with no deletion and compare them with the recording; a difference
  refuses in one line, naming the numeric environment variables that differ from the recording's. The probe, not the list, is the guarantee.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

from ..errors import UnlearnError
from ..utils import atomic_write_text
from . import longest_microbatch
from .environment_reads import ARGV, differences, recorded_reads
from .fidelity import FidelityError
from .file_reads import differences as file_differences
from .guards import compare_fingerprint, guard_coverage, program_changes
from .issued import issue
from .processes import agreed_value, gathered, rank, world_size
from .program_code import code_checked
from .proven import (  # noqa: F401 - re-exported: what is proven was read here
    PROVE_COMMAND,
    ProofError,
    check_proven,
    diverged,
    engine,
    fresh_start_failure,
    fresh_start_refusal,
    launch_command,
    neutral_controls,
    proof_starts,
    proof_statement,
    proven_starts,
    proven_steps,
    ranges,
    unproven_statement,
    unproven_steps,
)
from .replay import ReplayTrainer
from .replay.checks import BatchMismatchError
from .run import TraceRun, open_run, read_header
from .sharding import process_causes, process_numerics  # noqa: F401 - re-exported: they lived here
from .stack import NUMERIC_ENV, environment_difference, numeric_environment, numeric_stack  # noqa: F401 - they lived here
from .writer import TraceWriter

PROGRESS = "proof_progress.json"
NO_FINGERPRINT = "records no per-step state fingerprint"  # a run recorded without per-step guards: nothing to prove
# trace_self_check=True (the default) proves the whole run at the end of a recording that trained this long at most
# (the proof costs about as much again); a longer one gets its first step checked and `trace prove` when convenient
AUTO_PROVE_SECONDS = 120.0


# ---- the interval replay -------------------------------------------------------------------------------------
def _interval_replay(run, start: int, stop: int, data_collator=None, bar=None, on_checkpoint=None):
    """A replay with no deletion from the kept checkpoint at ``start`` up to ``stop`` (exclusive), comparing the
    state with the recording's fingerprint after every step and with the recorded checkpoint at ``stop``."""
    class ProofReplayTrainer(ReplayTrainer):
        mode = "proof"
        store_policy = "original"
        _keep_final = False

        def __init__(self, run):
            self._proof_start, self._proof_bar = start, bar
            super().__init__(run, forget_ids=(), out_dir=None, start="suffix", stop_step=stop,
                             data_collator=data_collator, _self_check=True)

        def _start_step(self) -> int:
            return self._proof_start

        def _check_fidelity(self, step: int, saved) -> None:  # (every process agrees: processes.agreed)
            super()._check_fidelity(step, saved)
            if on_checkpoint is not None and step != self.start_step and step in self._recorded_checkpoints:
                on_checkpoint(step, list(self._proof_neutral))  # matched: steps up to it are proven

        def _run_segment(self, model, seg):
            taken = super()._run_segment(model, seg)
            if self._proof_bar is not None:
                self._proof_bar.update(1)
            return taken

        def _check_step_fingerprint(self, step: int) -> None:
            """The state after the step is the evidence; program controls that differ while the state is the
            recording's (gradient checkpointing switched on mid-run) are numerically neutral: noted, not refused.
            Every process compares its own and all agree on the verdict (:func:`~hf_unlearn.trace.processes.agreed`,
            in the replay's loop)."""
            recorded, actual = self._recorded_fps.get(step), self._step_fps.get(step)
            if recorded is None or actual is None or "c" not in actual or "c" not in recorded:
                return
            neutral = recorded.get("c") != actual.get("c") or recorded.get("lr") != actual.get("lr")
            compare_fingerprint(step, {**recorded, "c": actual["c"], "lr": actual.get("lr")}, actual, True,
                                who="the proof")
            if neutral:
                self._proof_neutral.append(step)
            self._fps_matched["controls"].append(step)
            self._fps_matched["state"].append(step)

    trainer = ProofReplayTrainer(run)
    trainer._proof_neutral = []
    return trainer


def _run_interval(run, start: int, stop: int, data_collator=None, bar=None, neutral: list | None = None,
                  on_checkpoint=None) -> dict | None:
    """Prove steps ``start..stop - 1`` in one replay from the kept checkpoint at ``start``: None when every step's
    state matched, else ``{"step", "why"}``. The steps whose controls differed with the state matched are appended to
    ``neutral``; ``on_checkpoint(step, neutral)`` is called at each kept checkpoint the replay matched on its way."""
    # every process reads the run's key before the replay's first collective (a proof, a probe): one that cannot
    # fails on every process, not alone while the others wait in the replay's set-up
    agreed_value(lambda: run.key)
    try:
        trainer = _interval_replay(run, start, stop, data_collator, bar, on_checkpoint)
        trainer.train()
    except BatchMismatchError as e:  # checked before any compute: the steps before it are proven by a shorter replay
        if e.step <= start:
            return {"step": start, "why": str(e), "batch": True}
        return _run_interval(run, start, e.step, data_collator, bar, neutral, on_checkpoint) or \
            {"step": e.step, "why": str(e), "batch": True}
    except FidelityError as e:
        step = _step_named(str(e), start, stop)
        return {"step": step, "why": str(e), **({"processes": e.processes} if hasattr(e, "processes") else {})}
    if neutral is not None:
        neutral += trainer._proof_neutral
    matched = set(trainer._fps_matched["state"])
    missing = [s for s in range(start, stop) if s not in matched]
    if missing:
        raise UnlearnError(f"{run.path} {NO_FINGERPRINT} for optimizer step {missing[0]} (recorded "
                           "with trace_guards=False, or before per-step fingerprints): a proof needs one at every step; "
                           "record the run again with the default trace_guards=True")
    return None


def _step_named(text: str, start: int, stop: int) -> int:
    import re

    found = re.search(r"(?:optimizer step|checkpoint step|at step) (\d+)", text)
    if not found:
        return start
    step = int(found.group(1))
    return step - 1 if "checkpoint step" in text or "at step" in text else step  # a checkpoint: after step - 1


def starts(run) -> list[int]:
    """The kept checkpoints a replay can start from (step 0 first)."""
    total = run.total_steps
    cps = sorted(c for c in run.checkpoints() if c < total)
    if 0 not in cps:
        raise UnlearnError(f"{run.path} has no step-0 checkpoint: the run cannot be proven")
    return cps


# ---- progress, kept under the run key ------------------------------------------------------------------------
def _progress_mac(key: bytes, body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, b"hf_unlearn.proof_progress\0" + text, hashlib.sha256).hexdigest()


def _context(run) -> dict:
    return {"run_id": run.header.get("run_id"), "engine": engine(), "environment": numeric_environment()}


def _load_progress(run) -> dict:
    """What an earlier, killed proof of this run established with this engine and environment: ``upto`` (steps
    0..upto - 1 matched, upto a kept checkpoint), ``starts`` (checkpoints whose fresh start was proven), ``neutral``."""
    empty = {"upto": 0, "starts": [], "neutral": [], "resumed": []}
    try:
        data = json.loads((run.path / PROGRESS).read_text())
        body, mac = data["body"], data["mac"]
        if not hmac.compare_digest(str(mac), _progress_mac(run.key, body)) or body.get("context") != _context(run):
            return empty
        upto = int(body["upto"])
        if upto and upto not in run.checkpoints():
            return empty
        return {"upto": upto, "starts": [int(c) for c in body["starts"]], "neutral": [int(c) for c in body["neutral"]],
                "resumed": [int(c) for c in body.get("resumed", [])]}
    except (OSError, ValueError, KeyError, TypeError):
        return empty


def _save_progress(run, state: dict) -> None:
    body = {"context": _context(run), **state}
    atomic_write_text(run.path / PROGRESS, json.dumps({"body": body, "mac": _progress_mac(run.key, body)}))


# ---- prove -----------------------------------------------------------------------------------------------------
def prove(run_path, data_collator=None, progress: bool = True, seal: bool = True, log=None,
          fresh_starts: bool = False) -> dict:
    """Re-run the recorded run with the replay engine and no deletion; match the recorded state at every step.

    Returns the proof record (also sealed into ``header.json`` as ``fidelity.proof`` unless ``seal=False``):
    ``proven`` (every step matched), ``steps`` ([first, last] proven from step 0), ``starts`` (the kept checkpoints
    a replay started afresh was shown to reproduce from), ``diverged`` (the first step where the engine's state
    differs, and what differs). Resumes a proof that was killed (``proof_progress.json``). Under a launch of N
    processes (a run recorded by N), every process replays its share.

    ``fresh_starts``: also prove, ahead of any deletion, the first step of a replay started afresh at each kept
    checkpoint after step 0 (checkpoint load, model rebuild, RNG and data position; a few steps more); on a run whose
    sealed proof already covers every step with this engine, stack and environment, only those. By default a fresh
    start is proven where it is used, by the deletion that starts there (:func:`before_deletion`).
    """
    from tqdm.auto import tqdm

    log = log or (lambda msg: None)
    started, wall = time.process_time(), time.perf_counter()
    # each process opens the run and its key itself, before any collective: a failure on one is every process's
    run = agreed_value(_opened, run_path)
    check_world_size(run, "trace prove")
    main, total, kept = _is_main(), run.total_steps, starts(run)
    state = agreed_value(_load_progress, run)
    if state["upto"] or state["starts"]:
        log(f"resuming the proof of {run.path}: steps 0..{state['upto'] - 1} already proven")
        if 0 < state["upto"] < total:
            # the replay goes on from a fresh start at that checkpoint, not from the killed one's live state: a replay
            # that runs on through it (from an earlier start, as the oracle does) is not shown, and the record says so
            state["resumed"] = sorted(set(state["resumed"]) | {state["upto"]})
            log(f"note: resumed from a fresh start at kept checkpoint {state['upto']}: replays that run on through it "
                "from an earlier start are not proven past it (`trace prove` again, uninterrupted, proves them)")
    elif fresh_starts and (sealed := _sealed_continuous(run)) is not None:  # the continuous run is proven already
        state = sealed
        log(f"{run.path}: its sealed proof covers every step with this engine, stack and environment; proving the "
            "fresh starts only")

    def reached(step: int, neutral: list) -> None:  # a kept checkpoint matched on the way: persisted
        state.update(upto=step, neutral=sorted(set(state["neutral"]) | set(neutral)))
        if main:
            _save_progress(run, state)

    diverged, start_failures = None, {}  # noqa: F811 - the outcome, not proven.diverged (re-exported)
    todo_starts = [c for c in kept if c > 0 and c not in state["starts"]] if fresh_starts else []
    with tqdm(total=total - state["upto"] + len(todo_starts), desc="prove (replay, no deletion)", unit="step",
              disable=not (progress and main), leave=False) as bar:
        if state["upto"] < total:  # one replay on to the end, as the oracle runs (resumed: from the last checkpoint)
            neutral = []
            diverged = _run_interval(run, state["upto"], total, data_collator, bar, neutral, reached)
            state["neutral"] = sorted(set(state["neutral"]) | set(neutral))
            state["upto"] = total if diverged is None else diverged["step"]
        if diverged is None:  # a suffix replay starts afresh at a kept checkpoint: its first step from there
            for c in todo_starts:
                found = _run_interval(run, c, c + 1, data_collator, bar)
                if found is None:
                    state["starts"].append(c)
                else:
                    start_failures[str(c)] = found["why"]
                if main:
                    _save_progress(run, state)
    record = proof_record(run, state["upto"], sorted({0, *state["starts"], *(c for c in state["resumed"] if c < state[
        "upto"])}) if state["upto"] else [], diverged)
    if state["resumed"]:  # where a killed proof went on from a fresh start (hf_unlearn.trace.proven.unproven_steps)
        record["resumed_at"] = state["resumed"]
    if start_failures:
        record["start_failures"] = start_failures
    if state["neutral"]:  # program controls differed from the recording's there, the state did not: numerically neutral
        record["neutral_controls"] = state["neutral"]
    record.update(cpu_seconds=round(time.process_time() - started, 3),
                  wall_seconds=round(time.perf_counter() - wall, 3))
    # a run recorded without its longest microbatch's digests (trace_self_check=False): taken here, where the whole
    # run was just reproduced, for every later deletion's probe (longest_microbatch.reference: one process only)
    longest = longest_microbatch.reference(run, data_collator) if (
        seal and record["proven"] and longest_microbatch.KEY not in (run.header.get("fidelity") or {})) else None
    # every process returns once the main one sealed the proof (a process reading the header next), or every
    # process raises the main one's failure to seal it
    agreed_value(_finish, run, record, seal and main, main, longest)
    return record


def _opened(run_path):
    run = open_run(run_path).kept()
    _ = run.key  # read here, not at its first use inside a replay's collectives
    return run


def _finish(run, record: dict, seal: bool, main: bool, longest: dict | None = None) -> None:
    if seal:
        seal_proof(run.path, record, longest)
    if main:  # done (a kill never gets here): a later prove starts afresh
        (run.path / PROGRESS).unlink(missing_ok=True)


def _sealed_continuous(run) -> dict | None:
    """The run's sealed proof as progress (``upto`` the end, its starts and neutral steps) when it proved every step
    of this run with this engine, numeric stack, environment and number of processes; else None."""
    proof = (run.header.get("fidelity") or {}).get("proof") or {}
    same = (proof.get("proven") and proof.get("run_id") == run.header.get("run_id") and proof.get("engine") == engine()
            and proof.get("numeric_stack") == numeric_stack() and proof.get("environment") == numeric_environment()
            and proof.get("world_size", 1) == world_size() and proof.get("total_steps") == run.total_steps)
    if not same:
        return None
    return {"upto": run.total_steps, "starts": [int(c) for c in proof.get("starts") or [] if int(c) > 0],
            "neutral": [int(c) for c in proof.get("neutral_controls") or []],
            "resumed": [int(c) for c in proof.get("resumed_at") or []]}


def check_world_size(run, command: str) -> None:
    """Refuse, before any compute, a proof or probe launched with another number of processes than recorded the
    run (each process replays its own slots of every step), naming the command to use."""
    recorded, here = int(run.header.get("world_size", 1) or 1), world_size()
    if recorded != here:
        raise ProofError(f"{run.path} was recorded by {recorded} process(es) and this {command} runs {here}: every "
                         f"process of the recording must be replayed, at the recorded world size and sharding; run "
                         f"`{launch_command(recorded, command, run.path)}`")


def proof_record(run, upto: int, proven_starts: list[int], diverged: dict | None) -> dict:  # noqa: F811
    """What the header keeps of a proof (see :func:`prove`): steps 0..upto - 1 reproduced in one replay from step 0,
    the kept checkpoints a fresh replay start was proven from."""
    import torch.distributed as dist

    total = run.total_steps
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # every process replayed its own slots and compared its own state at every step (:func:`agreed`)
    record = {"proven": diverged is None and upto == total, "steps": [0, upto - 1] if upto else None,
              "processes": list(range(world)),
              "starts": proven_starts, "total_steps": total, "run_id": run.header.get("run_id"), "engine": engine(),
              "numeric_stack": numeric_stack(), "environment": numeric_environment(), "world_size": world,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if diverged is not None:
        record["diverged"] = diverged
    return record


def seal_proof(run_path, record: dict, longest: dict | None = None) -> None:
    """Write ``record`` into the run's ``header.json`` (``fidelity.proof``; ``longest``: the longest microbatch's
    digests, :mod:`~hf_unlearn.trace.longest_microbatch`) under the run key's seal; the progress file is done with."""
    run = open_run(run_path, check_checkpoints=False)
    header = read_header(run.path)
    header.setdefault("fidelity", {})["proof"] = record
    if longest:
        header["fidelity"][longest_microbatch.KEY] = longest
    TraceWriter(run.path, run.key).reseal_header(header)


def _is_main() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---- what is proven -------------------------------------------------------------------------------------------


# ---- the deleting environment ---------------------------------------------------------------------------------
def probe_steps(run) -> list[int]:
    """Step 0, and among the steps that start at a kept checkpoint the one with the longest microbatch as collated
    (:func:`~hf_unlearn.trace.longest_microbatch.padded_length`; the run's longest is checked besides, alone:
    :mod:`~hf_unlearn.trace.longest_microbatch`); none at or after the first program change the recording found (the
    engine cannot reproduce those from a checkpoint: the deletion's own check,
    :func:`~hf_unlearn.trace.guards.program_refusal`, names that change, not the probe)."""
    total = run.total_steps
    if total == 0:
        return []
    changes = program_changes(run.served_plan or run.plan, run.header)
    first_change = changes[0]["step"] if changes else total
    starts = {c for c in run.checkpoints() if c < min(total, first_change)}
    longest = {}
    for e in run.plan:
        if e.step in starts:
            longest[e.step] = max(longest.get(e.step, 0), longest_microbatch.padded_length(run, e))
    other = max(sorted(longest), key=lambda s: longest[s], default=0)
    return [0] + ([other] if other != 0 else [])


def probe_environment(run_path, data_collator=None, log=None, replayed=range(0), fresh_start: int | None = None) -> dict:
    """Re-run :func:`probe_steps` with no deletion in this process (every process of a launch) and compare with the
    recorded fingerprints; raise :class:`ProofError` in one line on a difference, naming the step and the numeric
    environment variables that differ from the recording's. Returns ``{"steps", "seconds"}``.

    ``replayed``: the steps the deletion's own replay re-runs with no deletion (from its start checkpoint up to the
    first affected step), each checked against the recording's state fingerprint as it runs. A probe step among
    them is not run twice: the replay's first step is that probe, the same re-run with the same comparison (it
    stops the replay there, before any deleted row is trained on); ``by_the_replay`` lists them.

    ``fresh_start``: a kept checkpoint where the deletion's replay starts afresh, no proof covers it and its first
    step is affected: that step is re-run from it too (it doubles as a probe of that step), and a difference there
    refuses naming the fresh start (:func:`~hf_unlearn.trace.proven.fresh_start_failure`)."""
    wall = time.perf_counter()
    run = (run_path if isinstance(run_path, TraceRun) else open_run(run_path)).kept()
    code = code_checked(run)  # first: the code this process runs is the recording's (trace.program_code)
    if log:
        log(f"code: the {code['compared']} classes and modules the run's first step ran have the recorded code here"
            if code["compared"] else f"code NOT compared: {code['why']}")
    chosen = sorted(set(probe_steps(run)) | ({fresh_start} if fresh_start is not None else set()))
    steps = [s for s in chosen if s not in replayed]
    for s in steps:
        try:
            found = _run_interval(run, s, s + 1, data_collator)
        except UnlearnError as e:
            if NO_FINGERPRINT in str(e):
                return issue("environment", run, {"steps": [], "seconds": 0.0, "skipped": str(e), "code": code})
            raise
        if found is not None and found.get("batch"):  # the collator given here (or the store) is not the run's: the
            raise UnlearnError(found["why"])  # user's to fix, not the environment's
        if found is not None:
            recorded = (run.header.get("numeric_stack") or {}).get("environment")
            causes = process_causes(recorded, gathered(process_numerics()))  # every process is here (agreed)
            reads = recorded_reads(run.header.get("fidelity") or {}, rank())
            read = differences(run.key, {k: v for k, v in reads.items() if v.get("framework")}, frameworks=True) \
                if reads else []
            if read:  # a variable a framework read while the run trained: the likelier cause, named first
                causes = [f"an environment variable a framework read while the run trained differs here: "
                          f"{', '.join(read[:3])}"] + causes
            cause = (f"; {'; '.join(causes)}" if causes else
                     "; no recorded numeric setting differs (another library build, CPU or a setting the record "
                     "does not name" + (", or a program that keeps state no checkpoint holds: a counter on the "
                                       "trainer or a callback, which a re-run from a kept checkpoint starts afresh)"
                                       if s > 0 else ")"))
            where = (f" on process(es) {', '.join(map(str, found['processes']))} of {world_size()}"
                     if found.get("processes") and world_size() > 1 else "")
            if s == fresh_start:  # the steps before it (step 0 first) matched here: the start is the likely cause
                raise fresh_start_refusal(run.path, s, found["why"] + _rank_local(found) + (cause if causes else ""))
            raise ProofError(f"the deleting environment does not reproduce the recorded run {run.path}: optimizer step "
                             f"{s}, re-run from its kept checkpoint with no deletion, ends in another state than the "
                             f"recording's{where}{cause}; refusing before any compute (run the deletion where the run "
                             "was recorded, with its environment)")
    longest = longest_microbatch.check(run, data_collator)
    seconds = time.perf_counter() - wall
    by_replay = [s for s in chosen if s in replayed]
    if log and steps:
        log(f"environment probe: optimizer step(s) {', '.join(map(str, steps))} re-run here with no deletion match the "
            f"recording ({seconds:.1f} s)")
    if log and longest:
        log(f"environment probe: the run's longest microbatch (step {longest['step']}, "
            f"{longest['tokens']} tokens as collated) re-run alone from the step-0 checkpoint gives the recording's "
            "gradients")
    if log and by_replay:
        log(f"environment probe: optimizer step(s) {', '.join(map(str, by_replay))} re-run by the replay itself with no "
            "deletion (before the first affected step), its state compared with the recording's fingerprint there")
    return issue("environment", run, {"steps": steps, "seconds": round(seconds, 3), "code": code,
                                      **({"by_the_replay": by_replay} if by_replay else {}),
                                      **({"longest_microbatch": longest} if longest else {})})


def _rank_local(found: dict) -> str:
    """What a divergence some processes of a launch found and the others did not says (the processes are already
    named in ``found["why"]``, by :func:`~hf_unlearn.trace.processes.agreed`)."""
    ranks, world = found.get("processes") or [], world_size()
    if not ranks or len(ranks) == world:
        return ""
    return (f"; only process(es) {', '.join(map(str, ranks))} of {world} diverged: what they started from or ran with "
            "(their checkpoint shard as loaded, a library or environment setting) differs from the other processes'")


def probe_fresh_start(run, start: int, data_collator=None) -> dict:
    """One step from the kept checkpoint ``start`` with no deletion, its state compared with the recording's (it reads
    the run's original store): ``{"checkpoint", "proven_by": "probe"}``, or :class:`ProofError` naming the fresh
    start. For a deletion whose replay starts afresh there, no proof covers it and its first step is affected. None:
    the run records no fingerprint to compare with (the start stays unproven)."""
    try:
        found = _run_interval(run, start, start + 1, data_collator)
    except UnlearnError as e:
        if NO_FINGERPRINT in str(e):
            return None
        raise
    if found is not None and found.get("batch"):
        raise UnlearnError(found["why"])
    if found is not None:
        raise fresh_start_refusal(run.path, start, found["why"])
    return issue("start", run, {"checkpoint": start, "proven_by": "probe"})


def prove_fresh_start(run, forget_ids, data_collator=None) -> dict | None:
    """For a ``RedactedReplayTrainer`` of your own (``forget`` does this in :func:`before_deletion`): how the fresh
    start of the suffix replay deleting ``forget_ids`` is proven, its probe step run here when that step is affected
    (it reads the run's original store); pass the result as ``proven_start=``. None: nothing to replay."""
    from .replay import replay_cost

    run = (run if isinstance(run, TraceRun) else open_run(run)).kept()
    cost = replay_cost(run, forget_ids)
    how = start_proof(run, cost["start_checkpoint"], cost["first_affected_step"])
    if how and how["proven_by"] == "probe":
        return probe_fresh_start(run, how["checkpoint"], data_collator)
    return issue("start", run, how)


def start_proof(run, start: int, first_affected: int | None) -> dict | None:
    """How the fresh start of a deletion's replay at the kept checkpoint ``start`` is proven, decided before any
    compute: ``{"checkpoint", "proven_by"}`` with ``"proof"`` (the proof's continuous replay from step 0, or
    ``--fresh-starts``), ``"replay"`` (the replay's own first step is before the first affected one: it is compared
    with the recording's state fingerprint as it runs and stops the replay there on a difference) or ``"probe"`` (the
    first step is affected: one extra probe step from the checkpoint, with no deletion, before any compute)."""
    if start in proof_starts(run.header):
        return {"checkpoint": start, "proven_by": "proof"}
    if first_affected is None:
        return None
    return {"checkpoint": start, "proven_by": "replay" if start < first_affected else "probe"}


def guard_gap(run, oracle: bool) -> str | None:
    """Why a deletion of ``run`` checked against the oracle could never be VERIFIED because of the recording's
    per-step guards (steps they did not cover: a recording resumed after a crash that lost the fingerprint of the
    step before the resume, or ``trace_guards=False``), or None; known from the run, so said before any compute
    (``trace verify`` finds the same after it: :func:`hf_unlearn.trace.verification.check_provenance`)."""
    gap = guard_coverage(run.served_plan or run.plan, run.header) if oracle else None
    return f"{run.path}: {gap}, so a deletion checked against the oracle could never be VERIFIED" if gap else None


def environment_refusal(run) -> str | None:
    """Why this process cannot delete from ``run``: environment variables the recorded run's own code read while
    training (a recorded callback, a trainer subclass, a collator: :mod:`~hf_unlearn.trace.environment_reads`) that
    it holds otherwise (on any process of a launch), or files that code read (:mod:`~hf_unlearn.trace.file_reads`)
    missing or holding other content here, which a replay here would act on (None: none, or a run recorded before they
    were noted)."""
    fidelity = run.header.get("fidelity") or {}
    recorded = recorded_reads(fidelity, rank())  # this process's rank's (they may differ)
    everyone = gathered(differences(run.key, recorded) if recorded else [])  # every process of a launch: one verdict
    found = [(r, d) for r, d in enumerate(everyone) if d]
    if not found:
        files = fidelity.get("file_reads")
        other = file_differences(run.key, files) if files else []
        if other:
            more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
            return (f"the recorded run's code read the file {other[0][1]}{more}: a replay here runs that code on "
                    f"other input than the recording's; refusing before any compute (restore {other[0][0]} as it was "
                    "when the run was recorded, or record the run again)")
        return None
    where, differ = found[0]
    on = f" on process {where} of {len(everyone)}" if len(everyone) > 1 else ""
    argv = next((d for d in differ if d.startswith(ARGV)), None)
    if argv:
        return (f"the recorded run's code read {argv}{on} while it trained: a replay runs that code in the deleting "
                "process, whose command line is not the training launch's; refusing before any compute (read the "
                "command line before training, into TrainingArguments or the trainer's attributes, and record the "
                "run again)")
    return (f"the recorded run's code read the environment variable {differ[0]}{on}"
            f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}: a replay here runs that code on another "
            "environment than the recording's; refusing before any compute (set it as it was while recording, or run "
            "the deletion where the run was recorded)")


def before_deletion(run, start: int, oracle: bool, accept_unproven: bool, data_collator=None,
                    first_affected: int | None = None) -> dict:
    """What ``forget``, ``trace replay``, ``trace oracle`` and ``requests serve`` check before any compute: the steps
    the deletion runs are proven (else refused unless ``accept_unproven``), and this environment reproduces the
    recorded steps of :func:`probe_steps`. ``first_affected``: the deletion's first affected step, when its replay
    starts at ``start`` and checks every step before it against the recording's state fingerprints (a redacted
    replay): the probe steps in ``start..first_affected - 1`` are left to it (:func:`probe_environment`).

    A fresh start at ``start`` that no proof covers is proven here, where it is used (:func:`start_proof`): by the
    replay's own first step, or, that step affected, by one more probe step from ``start`` with no deletion (it reads
    the run's original store, which the redacted replay never opens). Returns ``unproven_steps``,
    ``environment_probe``, ``start_proof`` (give it to the replay: ``proven_start=``) and ``proof_lines``."""
    lines = []
    differ = environment_refusal(run)
    if differ:
        raise ProofError(differ)
    gap = guard_gap(run, oracle)  # first: proving the run (a training run's compute) would not help
    if gap and not accept_unproven:
        raise ProofError(f"{gap}; refusing before any compute (or accept a deletion that is never VERIFIED: "
                         "--accept-unproven / accept_unproven=True)")
    if gap:
        lines.append(f"NOT VERIFIABLE (accepted): {gap}")
    unproven = check_proven(run, start, run.kept().total_steps, oracle, accept_unproven, log=lines.append)
    how = start_proof(run, start, first_affected)
    if unproven and how and how["proven_by"] == "probe":  # accepted unproven: no probe is spent on its start
        lines.append(f"UNPROVEN (accepted): the replay's fresh start at kept checkpoint {start} is not probed (step "
                     f"{start} is affected and unproven steps were accepted): every step the replay runs from it is "
                     "unproven, and the receipt lists them")
    how = how if not unproven or (how and how["proven_by"] != "probe") else None
    replayed = range(start, first_affected) if first_affected is not None and not unproven else range(0)
    probe = probe_environment(run, data_collator, log=lines.append, replayed=replayed,
                              fresh_start=start if how and how["proven_by"] == "probe" else None)
    if probe.get("skipped"):
        lines.append(f"environment probe skipped: {probe['skipped']}")
        how = None if how and how["proven_by"] == "probe" else how
    if how and how["proven_by"] != "proof":
        lines.append(f"fresh start at kept checkpoint {start}: proven by " + (
            "the replay's own first step (before the first affected one), its state compared with the recording's; a "
            "difference stops it there" if how["proven_by"] == "replay" else
            f"a probe step from it with no deletion, before any compute (step {start} is affected)"))
    lines.append(f"proof: {proof_statement(run.header)}")
    return {"unproven_steps": unproven, "environment_probe": probe, "start_proof": issue("start", run.kept(), how),
            "proof_lines": lines}


__all__ = ["prove", "probe_environment", "unproven_steps", "proof_statement", "numeric_environment", "ProofError"]

