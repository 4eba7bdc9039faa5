"""The run's longest microbatch, re-run in the deleting process: the environment probe's check of the shape no kept
checkpoint starts.

The environment probe (:func:`hf_unlearn.trace.proof.probe_environment`) re-runs recorded steps from kept checkpoints
(step 0 and the kept-checkpoint step with the longest microbatch), which only the steps that start at one can be. A kernel, hook or library that computes otherwise only at some
shapes (a padded length the probed steps do not have) would pass it. So the recording also keeps, in the same
process that trained (at the end of ``train()``, beside its self-check), what the replay engine computes for the
run's **longest microbatch** (the most tokens in a row, as its padding reaches them) run alone as the first
optimizer step from the step-0 checkpoint: the exact digests of the gradients it gives and of the trainable state
after the update (:func:`reference`, sealed in the header's ``fidelity.longest_microbatch``). Every deleting process
computes the same and compares (:func:`check`): a difference refuses before any compute. It costs one microbatch's
forward and backward, one optimizer step and a model rebuild, at recording and at each deletion. It runs the
microbatch alone, once, from the step-0 weights: code that acts at that shape only after some calls, from some step
or on other weights is not shown by it (the seals cover the program there).

Not run where it proves nothing more or cannot be repeated as recorded (:func:`chosen`): the longest microbatch is
in step 0 (the probe re-runs step 0 whole), a multi-process run (the probe's steps cover its processes), a compacted
run (its plan keeps no per-microbatch batch digest). A deletion's output run keeps the digests and uses them where its
longest microbatch is the recording's, untouched (the same keyed batch digest), from the same step-0 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time

from ..errors import UnlearnError
from .checksums import exact_digest, gradient_tensors, tensor_checksums
from .plan import PlanEntry
from .preference import PAIR_ROWS, pair_rows
from .processes import world_size

KEY = "longest_microbatch"  # the header's fidelity entry


def chosen(run) -> PlanEntry | None:
    """The microbatch the check re-runs: the run's longest as collated (:func:`padded_length`, then its most tokens;
    the first such), or None where the check does not run (see the module docstring)."""
    plan = run.plan
    if not plan or run.compact or world_size() > 1 or (run.header.get("world_size") or 1) > 1:
        return None
    best = max(plan, key=lambda e: (padded_length(run, e), sum(e.lens or []), -e.mb))
    return None if best.step == 0 else best


def flattened(run) -> bool:
    """Whether the run's collator flattens a microbatch's rows into one sequence (``padding_free``, ``packing``)."""
    args = run.header.get("training_args") or {}
    return bool(args.get("padding_free") or args.get("packing"))


def padded_length(run, entry: PlanEntry) -> int:
    """The sequence length of a microbatch as collated: its longest row (a DPO pair's plan length holds both of its
    rows, :func:`~hf_unlearn.trace.preference.pair_rows`), or, flattened, all of its rows' tokens."""
    rows = [r for n in entry.lens or [] for r in pair_rows(n)] if (run.header.get("dataset") or {}).get(
        PAIR_ROWS) else list(entry.lens or [])
    return (sum(rows) if flattened(run) else max(rows, default=0)) if rows else 0


def _alone(run, entry: PlanEntry):
    """``run`` with one optimizer step: ``entry`` alone as step 0, with step 0's settings (learning rate, param
    groups, epoch) and ``entry``'s own rows, slots, seed and loss normaliser."""
    first = next(e for e in run.plan if e.step == 0)
    holder = next(e for e in run.plan if e.step == entry.step and e.j == 0)
    extra = {k: v for k, v in first.extra.items() if k not in ("rows", "fp", "changed")}
    rows = holder.extra.get("rows")
    if rows and entry.j < len(rows):
        extra["rows"] = [rows[entry.j]]
    solo = dataclasses.replace(entry, step=0, j=0, end=True, lr=first.lr, group_lrs=first.group_lrs,
                               epoch=first.epoch, extra=extra)
    return dataclasses.replace(run, plan=[solo], served_plan=run.served_plan or run.plan)


def _digests(run, entry: PlanEntry, data_collator=None) -> dict:
    """Re-run ``entry`` alone from the step-0 checkpoint with no deletion: ``{"g", "s"}``, the exact digests of the
    gradients ``optimizer.step()`` used and of the trainable state after it."""
    from .replay import ReplayTrainer

    class LongestMicrobatchReplay(ReplayTrainer):
        mode = "environment probe"
        store_policy = "original"
        _keep_final = False

        def _start_step(self) -> int:
            return 0

        def _check_fidelity(self, step, saved) -> None:  # no recorded state is this step's: compared by the caller
            return None

        def _check_step_fingerprint(self, step) -> None:
            return None

        def _gradient_digest(self, step):
            self._longest_grads = exact_digest(tensor_checksums(gradient_tensors(self.model)))
            return self._longest_grads

    trainer = LongestMicrobatchReplay(_alone(run, entry), forget_ids=(), out_dir=None, start="suffix", stop_step=1,
                                      data_collator=data_collator, _self_check=True)
    trainer.train()
    return {"g": trainer._longest_grads, "s": trainer._step_fps[0]["s"]}


def _start_root(run) -> str | None:
    """The params root of the run's step-0 checkpoint (what the check starts from), None without one."""
    hashes = run.checkpoints().get(0)
    hashes = hashes / "hashes.json" if hashes is not None else None
    return json.loads(hashes.read_text()).get("params_root") if hashes is not None and hashes.is_file() else None


def reference(run, data_collator=None) -> dict | None:
    """What the recording process computes for :func:`chosen` (None: not run), for the header: the digests, and what
    they were computed from (the microbatch, its keyed batch digest and length, the step-0 checkpoint's root), so a
    deletion's output run, which keeps them, uses them only where its own longest microbatch and start are those."""
    entry = chosen(run)
    if entry is None:
        return None
    wall = time.perf_counter()
    return {"step": entry.step, "microbatch": entry.mb, "tokens": padded_length(run, entry),
            "batch": list(entry.batch or []), "start_root": _start_root(run), **_digests(run, entry, data_collator),
            "seconds": round(time.perf_counter() - wall, 3)}


def check(run, data_collator=None) -> dict | None:
    """Re-run the recorded longest microbatch here and compare with the recording's digests; raise
    :class:`~hf_unlearn.trace.proven.ProofError` on a difference. Returns ``{"step", "tokens", "seconds"}`` or
    None when there is nothing to compare (no reference, or a run whose longest microbatch is not the recorded
    one: a deletion's output)."""
    from .proven import ProofError

    entry = _recorded_entry(run)
    if entry is None:
        return None
    recorded = run.header["fidelity"][KEY]
    wall = time.perf_counter()
    try:
        found = _digests(run, entry, data_collator)
    except UnlearnError as e:
        raise ProofError(f"the deleting environment cannot re-run the recorded run's longest microbatch "
                         f"({_where(run, entry)}): {e}") from None
    if found["g"] != recorded.get("g") or found["s"] != recorded.get("s"):
        what = "gradients" if found["g"] != recorded.get("g") else "updated weights (the gradients matched)"
        raise ProofError(f"the deleting environment does not reproduce the recorded run {run.path}: its longest "
                         f"microbatch ({_where(run, entry)}), re-run alone from the step-0 checkpoint with no deletion, "
                         f"gives other {what} than it gave in the recording process; something computes otherwise "
                         "here at that shape only (a kernel, hook or library the probed steps did not reach); "
                         "refusing before any compute (run the deletion where the run was recorded, with its "
                         "environment)")
    return {"step": entry.step, "tokens": padded_length(run, entry), "seconds": round(time.perf_counter() - wall, 3)}


def applies(run) -> bool:
    """Whether the recording kept the digests of this run's longest microbatch (:func:`check` compares them)."""
    return _recorded_entry(run) is not None


def _recorded_entry(run) -> PlanEntry | None:
    """This run's longest microbatch, where the recorded digests are its: the same microbatch, keyed batch digest and
    length, from the same step-0 checkpoint (None: no digests, or another microbatch or start)."""
    recorded = (run.header.get("fidelity") or {}).get(KEY)
    entry = chosen(run) if recorded else None
    if entry is None or entry.mb != recorded.get("microbatch") or list(entry.batch or []) != recorded.get("batch") \
            or padded_length(run, entry) != recorded.get("tokens") or recorded.get("start_root") is None:
        return None
    return entry if recorded["start_root"] == _start_root(run) else None


def _where(run, entry: PlanEntry) -> str:
    return (f"optimizer step {entry.step}, microbatch {entry.j}, {padded_length(run, entry)} tokens "
            + ("flattened" if flattened(run) else "to a row as padded"))
