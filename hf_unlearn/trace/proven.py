"""What a run's header says is proven: the steps the engine was shown to reproduce, and the refusal of the rest.

:mod:`hf_unlearn.trace.proof` proves a run (it replays it); this module only reads the sealed outcome (the proof
and the recording's self-check in ``header.json``'s ``fidelity``), so the guards, the verdicts and every deletion
check a range of steps without reaching up to the replay engine. :mod:`hf_unlearn.trace.proof` re-exports it.
"""

from __future__ import annotations

from ..errors import UnlearnError
from ..version import __version__

PROVE_COMMAND = "hf-unlearn trace prove {run}"


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



def launch_command(world: int, command: str, run_path) -> str:
    """The command line that runs ``hf-unlearn COMMAND RUN`` with ``world`` processes."""
    if world == 1:
        return f"hf-unlearn {command} {run_path}"
    return f"torchrun --nproc_per_node {world} -m hf_unlearn.cli {command} {run_path}"


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

