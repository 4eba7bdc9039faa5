"""The replay engine proven on the recorded run: positive evidence, not a list of what may change.

Lists of things that may change a run (learning rates, module attributes, hooks, environment variables) are never
complete. A **proof** is evidence instead: the replay engine re-runs the whole recorded run with no deletion, from
each kept checkpoint to the next, and its state after **every** optimizer step must equal the recording's per-step
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
* :func:`unproven_steps`: the steps of a range neither the proof nor the recording's self-check covers. A deletion
  is VERIFIED only when every step its replay and its oracle run is proven (:mod:`hf_unlearn.trace.verification`);
  ``forget`` and ``trace replay`` refuse an unproven range unless the user accepts it.
* :func:`probe_environment`: before any compute of a deletion, the deleting process(es) re-run the first recorded
  step (and the kept-checkpoint step with the longest microbatch) with no deletion and compare them with the
  recorded fingerprints; a difference refuses in one line, naming the numeric environment variables that differ
  from the recording's. The probe, not the list, is the guarantee.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .processes import gathered, world_size

PROGRESS = "proof_progress.json"
# environment variables known to change the bits of a CPU or GPU computation (recorded, and named when a probe
# fails; the probe is the guarantee, not this list)
NUMERIC_ENV = ("MKL_", "DNNL_", "ONEDNN_", "ATEN_CPU_CAPABILITY", "CUBLAS_WORKSPACE_CONFIG", "NCCL_", "OMP_", "KMP_")
PROVE_COMMAND = "hf-unlearn trace prove {run}"
# trace_self_check=True (the default) proves the whole run at the end of a recording that trained this long at most
# (the proof costs about as much again); a longer one gets its first step checked and `trace prove` when convenient
AUTO_PROVE_SECONDS = 120.0


class ProofError(UnlearnError):
    """The deleting environment, or the engine, does not reproduce the recorded run."""


def numeric_environment() -> dict:
    """This process's environment variables that are known to change numbers (:data:`NUMERIC_ENV`)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(NUMERIC_ENV)}


def environment_difference(recorded: dict | None, here: dict | None = None) -> str | None:
    """The numeric environment variables that differ from the recording's, in words (None: none, or not recorded)."""
    if recorded is None:
        return None
    here = numeric_environment() if here is None else here
    diff = [f"{k}={here.get(k)!r} (recorded {recorded.get(k)!r})" for k in sorted(set(recorded) | set(here))
            if recorded.get(k) != here.get(k)]
    return ", ".join(diff) or None


def engine() -> dict:
    """Which engine a proof ran: the library and the versions that compute the replay."""
    import torch
    import transformers

    from ..version import __version__

    return {"hf_unlearn": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


# ---- the interval replay -------------------------------------------------------------------------------------
def _interval_replay(run, start: int, stop: int, data_collator=None, bar=None, on_checkpoint=None):
    """A replay with no deletion from the kept checkpoint at ``start`` up to ``stop`` (exclusive), comparing the
    state with the recording's fingerprint after every step and with the recorded checkpoint at ``stop``."""
    from .replay import ReplayTrainer

    class ProofReplayTrainer(ReplayTrainer):
        mode = "proof"
        store_policy = "original"

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
            from .guards import compare_fingerprint

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
    from .fidelity import FidelityError

    trainer = _interval_replay(run, start, stop, data_collator, bar, on_checkpoint)
    try:
        trainer.train()
    except FidelityError as e:
        step = _step_named(str(e), start, stop)
        return {"step": step, "why": str(e), **({"processes": e.processes} if hasattr(e, "processes") else {})}
    if neutral is not None:
        neutral += trainer._proof_neutral
    matched = set(trainer._fps_matched["state"])
    missing = [s for s in range(start, stop) if s not in matched]
    if missing:
        raise UnlearnError(f"{run.path} records no per-step state fingerprint for optimizer step {missing[0]} (recorded "
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
    empty = {"upto": 0, "starts": [], "neutral": []}
    try:
        data = json.loads((run.path / PROGRESS).read_text())
        body, mac = data["body"], data["mac"]
        if not hmac.compare_digest(str(mac), _progress_mac(run.key, body)) or body.get("context") != _context(run):
            return empty
        upto = int(body["upto"])
        if upto and upto not in run.checkpoints():
            return empty
        return {"upto": upto, "starts": [int(c) for c in body["starts"]], "neutral": [int(c) for c in body["neutral"]]}
    except (OSError, ValueError, KeyError, TypeError):
        return empty


def _save_progress(run, state: dict) -> None:
    body = {"context": _context(run), **state}
    atomic_write_text(run.path / PROGRESS, json.dumps({"body": body, "mac": _progress_mac(run.key, body)}))


# ---- prove -----------------------------------------------------------------------------------------------------
def prove(run_path, data_collator=None, progress: bool = True, seal: bool = True, log=None) -> dict:
    """Re-run the recorded run with the replay engine and no deletion; match the recorded state at every step.

    Returns the proof record (also sealed into ``header.json`` as ``fidelity.proof`` unless ``seal=False``):
    ``proven`` (every step matched), ``steps`` ([first, last] proven from step 0), ``diverged`` (the first step
    where the engine's state differs, and what differs). Resumes a proof that was killed (``proof_progress.json``).
    Under a launch of N processes (a run recorded by N), every process replays its share.
    """
    from tqdm.auto import tqdm

    from .run import open_run

    log = log or (lambda msg: None)
    started, wall = time.process_time(), time.perf_counter()
    run = open_run(run_path).kept()
    check_world_size(run, "trace prove")
    main, total, kept = _is_main(), run.total_steps, starts(run)
    state = _load_progress(run)
    if state["upto"] or state["starts"]:
        log(f"resuming the proof of {run.path}: steps 0..{state['upto'] - 1} already proven")

    def reached(step: int, neutral: list) -> None:  # a kept checkpoint matched on the way: persisted
        state.update(upto=step, neutral=sorted(set(state["neutral"]) | set(neutral)))
        if main:
            _save_progress(run, state)

    diverged, start_failures = None, {}
    todo_starts = [c for c in kept if c > 0 and c not in state["starts"]]
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
    record = proof_record(run, state["upto"], sorted({0, *state["starts"]}) if state["upto"] else [], diverged)
    if start_failures:
        record["start_failures"] = start_failures
    if state["neutral"]:  # program controls differed from the recording's there, the state did not: numerically neutral
        record["neutral_controls"] = state["neutral"]
    record.update(cpu_seconds=round(time.process_time() - started, 3),
                  wall_seconds=round(time.perf_counter() - wall, 3))
    if seal and main:
        seal_proof(run.path, record)
    if main:  # done (a kill never gets here): a later prove starts afresh
        (run.path / PROGRESS).unlink(missing_ok=True)
    gathered(None)  # every process returns once the main one sealed the proof (a process reading the header next)
    return record


def launch_command(world: int, command: str, run_path) -> str:
    """The command line that runs ``hf-unlearn COMMAND RUN`` with ``world`` processes."""
    if world == 1:
        return f"hf-unlearn {command} {run_path}"
    return f"torchrun --nproc_per_node {world} -m hf_unlearn.cli {command} {run_path}"


def check_world_size(run, command: str) -> None:
    """Refuse, before any compute, a proof or probe launched with another number of processes than recorded the
    run (each process replays its own slots of every step), naming the command to use."""
    recorded, here = int(run.header.get("world_size", 1) or 1), world_size()
    if recorded != here:
        raise ProofError(f"{run.path} was recorded by {recorded} process(es) and this {command} runs {here}: every "
                         f"process of the recording must be replayed, at the recorded world size and sharding; run "
                         f"`{launch_command(recorded, command, run.path)}`")


def proof_record(run, upto: int, proven_starts: list[int], diverged: dict | None) -> dict:
    """What the header keeps of a proof (see :func:`prove`): steps 0..upto - 1 reproduced in one replay from step 0,
    the kept checkpoints a fresh replay start was proven from."""
    import torch.distributed as dist

    from .stack import numeric_stack

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


def seal_proof(run_path, record: dict) -> None:
    """Write ``record`` into the run's ``header.json`` (``fidelity.proof``) under the run key's seal; the
    progress file is done with."""
    from .recording import TraceWriter
    from .run import open_run, read_header

    run = open_run(run_path, check_checkpoints=False)
    header = read_header(run.path)
    header.setdefault("fidelity", {})["proof"] = record
    TraceWriter(run.path, run.key).reseal_header(header)


def _is_main() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---- what is proven -------------------------------------------------------------------------------------------
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


def proven_starts(header: dict) -> set[int]:
    """The kept checkpoints a replay started afresh was shown to reproduce from (step 0: the proof's or the
    self-check's replay from step 0)."""
    steps, why = proven_steps(header)
    proof = (header.get("fidelity") or {}).get("proof") or {}
    return ({0} if 0 in steps else set()) | (set() if why else set(proof.get("starts") or []))


def unproven_steps(header: dict, first: int, stop: int) -> list[int]:
    """The steps of ``first..stop - 1`` (a replay from the kept checkpoint at ``first``) that neither the proof nor
    the self-check covers; all of them when a replay started afresh at ``first`` is not proven (a checkpoint does
    not hold everything the recording carried there: a module attribute a callback set earlier)."""
    steps, _ = proven_steps(header)
    if first < stop and first not in proven_starts(header):
        return list(range(first, stop))
    return [s for s in range(first, stop) if s not in steps]


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


def unproven_statement(header: dict, run_path, first: int, stop: int, who: str = "the replay") -> str | None:
    """Why the steps ``first..stop - 1`` are not proven, in one sentence (None when all are)."""
    missing = unproven_steps(header, first, stop)
    if not missing:
        return None
    _, why = proven_steps(header)
    div = diverged(header)
    failed = ((header.get("fidelity") or {}).get("proof") or {}).get("start_failures") or {}
    cause = (f"; a proof found the engine does not reproduce the run from optimizer step {div['step']}: {div['why']}"
             if div else f"; {why[0]}" if why else
             f"; a replay started afresh at checkpoint {first} does not reproduce the recording (the checkpoint does "
             f"not hold something the recording carried there, e.g. a callback's earlier change): {failed[str(first)]}"
             if str(first) in failed else
             f"; prove the run once (`{launch_command(int(header.get('world_size', 1) or 1), 'trace prove', run_path)}`"
             ", about one training run's compute)")
    return f"steps {ranges(missing)} that {who} runs are not proven to be reproduced by the engine" + cause


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
    elif div:
        text = (f"NOT PROVEN from optimizer step {div['step']}: the engine does not reproduce the run there"
                + (f" (steps 0..{proof['steps'][1]} reproduced)" if proof.get("steps") else ""))
    else:
        text = f"partly proven: steps 0..{proof['steps'][1]}" if proof.get("steps") else "not proven"
    _, why = proven_steps(header)
    return text + (f"; {why[0]}" if why else "")


# ---- the deleting environment ---------------------------------------------------------------------------------
def probe_steps(run) -> list[int]:
    """Step 0, and among the steps that start at a kept checkpoint the one with the longest microbatch; none at or
    after the first program change the recording found (the engine cannot reproduce those from a checkpoint: the
    deletion's own check, :func:`~hf_unlearn.trace.guards.program_refusal`, names that change, not the probe)."""
    from .guards import program_changes

    total = run.total_steps
    if total == 0:
        return []
    changes = program_changes(run.served_plan or run.plan, run.header)
    first_change = changes[0]["step"] if changes else total
    starts = {c for c in run.checkpoints() if c < min(total, first_change)}
    longest = {}
    for e in run.plan:
        if e.step in starts:
            longest[e.step] = max(longest.get(e.step, 0), max(e.lens or [0]))
    other = max(sorted(longest), key=lambda s: longest[s], default=0)
    return [0] + ([other] if other != 0 else [])


def probe_environment(run_path, data_collator=None, log=None) -> dict:
    """Re-run :func:`probe_steps` with no deletion in this process (every process of a launch) and compare with the
    recorded fingerprints; raise :class:`ProofError` in one line on a difference, naming the step and the numeric
    environment variables that differ from the recording's. Returns ``{"steps", "seconds"}``."""
    from .run import TraceRun, open_run

    wall = time.perf_counter()
    run = (run_path if isinstance(run_path, TraceRun) else open_run(run_path)).kept()
    steps = probe_steps(run)
    for s in steps:
        try:
            found = _run_interval(run, s, s + 1, data_collator)
        except UnlearnError as e:
            if "records no per-step state fingerprint" in str(e):
                return {"steps": [], "seconds": 0.0, "skipped": str(e)}
            raise
        if found is not None:
            recorded = (run.header.get("numeric_stack") or {}).get("environment")
            causes = process_causes(recorded, gathered(process_numerics()))  # every process is here (agreed)
            cause = (f"; {'; '.join(causes)}" if causes else
                     "; no recorded numeric setting differs (another library build, CPU or a setting the record "
                     "does not name)")
            where = (f" on process(es) {', '.join(map(str, found['processes']))} of {world_size()}"
                     if found.get("processes") and world_size() > 1 else "")
            raise ProofError(f"the deleting environment does not reproduce the recorded run {run.path}: optimizer step "
                             f"{s}, re-run from its kept checkpoint with no deletion, ends in another state than the "
                             f"recording's{where}{cause}; refusing before any compute (run the deletion where the run "
                             "was recorded, with its environment)")
    seconds = time.perf_counter() - wall
    if log:
        log(f"environment probe: optimizer step(s) {', '.join(map(str, steps))} re-run here with no deletion match the "
            f"recording ({seconds:.1f} s)")
    return {"steps": steps, "seconds": round(seconds, 3)}


def process_numerics() -> dict:
    """What this process's numbers depend on besides the model, the data and the plan, that a refusal can name: the
    numeric environment variables, torch's process-wide switches and the code of the functions a model's forward
    calls besides its own classes' (``torch.nn.functional``, ...: a patch on one process only)."""
    import sys

    from .digests import CODE_MODULES, PROCESS_LOCAL, code_digest, torch_state

    code = {}
    for name in CODE_MODULES:
        for attr, value in sorted(vars(sys.modules[name]).items()) if name in sys.modules else ():
            body = getattr(value, "__code__", None)
            if body is not None:
                code[f"{name}.{attr}"] = f"{getattr(value, '__qualname__', attr)}:{code_digest(body)}"
    switches = {k: repr(v) for k, v in torch_state().items() if k not in PROCESS_LOCAL and not k.startswith("environ ")}
    return {"environment": numeric_environment(), "torch": switches, "code": code}


def process_causes(recorded_env: dict | None, everyone: list[dict]) -> list[str]:
    """Per process, what of :func:`process_numerics` differs from the recording's environment or from process 0's,
    in words (what a failed probe names; it is the probe, not this, that refuses)."""
    out = []
    for rank, mine in enumerate(everyone):
        who = f"process {rank}'s" if len(everyone) > 1 else "the"
        env = environment_difference(recorded_env, mine["environment"])
        if env:
            out.append(f"{who} numeric environment differs from the recording's: {env}")
        if rank == 0:
            continue
        for part, what in (("torch", "torch settings"), ("code", "functions")):
            keys = sorted(k for k in set(mine[part]) | set(everyone[0][part])
                          if mine[part].get(k) != everyone[0][part].get(k))
            if keys:
                more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
                out.append(f"{who} {what} differ from process 0's: {', '.join(keys[:3])}{more}")
    return out


def check_proven(run, first: int, stop: int, oracle: bool, accept_unproven: bool, log=None) -> list[int]:
    """Before a deletion: the unproven steps of its replay (``first..stop - 1``) and oracle (``0..stop - 1``); refuse
    them (:class:`ProofError`) unless ``accept_unproven``. Returns the unproven steps."""
    lo = 0 if oracle else first
    why = unproven_statement(run.header, run.path, lo, stop, "the oracle and the replay" if oracle else "the replay")
    if why is None:
        return []
    if not accept_unproven:
        raise ProofError(f"{run.path}: {why}; refusing before any compute (or accept an unproven deletion: "
                         "--accept-unproven / accept_unproven=True; its receipt names the unproven steps and it is "
                         "never VERIFIED)")
    if log:
        log(f"UNPROVEN (accepted): {why}")
    return unproven_steps(run.header, lo, stop)


def before_deletion(run, start: int, oracle: bool, accept_unproven: bool, data_collator=None) -> dict:
    """What ``forget``, ``trace replay``, ``trace oracle`` and ``requests serve`` check before any compute: the steps
    the deletion runs are proven (else refused unless ``accept_unproven``), and this environment reproduces the
    recorded steps of :func:`probe_steps`. Returns ``unproven_steps``, ``environment_probe`` and ``proof_lines``
    (what to log)."""
    lines = []
    unproven = check_proven(run, start, run.kept().total_steps, oracle, accept_unproven, log=lines.append)
    probe = probe_environment(run, data_collator, log=lines.append)
    if probe.get("skipped"):
        lines.append(f"environment probe skipped: {probe['skipped']}")
    lines.append(f"proof: {proof_statement(run.header)}")
    return {"unproven_steps": unproven, "environment_probe": probe, "proof_lines": lines}


__all__ = ["prove", "probe_environment", "unproven_steps", "proof_statement", "numeric_environment", "ProofError"]

