"""The program a replay runs besides the plan, as the recording ran it: the recorded trainer's own arguments,
its callbacks rebuilt at the start step and their events, activation checkpointing, and the fingerprints and
checkpoints the replay must match on its way (:mod:`hf_unlearn.trace.guards`, :mod:`hf_unlearn.trace.fidelity`)."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import UnlearnError
from ..checksums import exact_digest, gradient_tensors, tensor_checksums
from ..digests import replayed_classes, replayed_globals
from ..environment_reads import globals_differences
from ..fidelity import FidelityError, check_against_checkpoint, check_against_state
from ..guards import (
    ProgramChangedError,
    compare_fingerprint,
    fingerprint_scope,
    program_refusal,
    rebuild_callback,
    recorded_fingerprints,
    run_event,
)
from ..hashing import checkpoint_hashes, uses_plain_names
from ..program_code import unsealed_code_refusal
from ..proven import fresh_start_refusal, neutral_controls, proof_starts
from ..run import capture_state
from ..stack import environment_difference
from ..trainers import PROCESSING_CLASS_DIR, is_default, load_processing_class, recorded_trainer
from ..unlisted import unlisted_hazard
from .stand_ins import ReplayedDataloader, ReplayedScheduler


def step_ranges(matched: dict) -> dict:
    """``{"state": [first, last], "controls": [first, last]}`` of the steps whose fingerprints matched (None: none)."""
    return {k: [min(v), max(v)] if v else None for k, v in matched.items()}


class RecordedProgram:
    """The recorded program around the plan (mixed into :class:`ReplayTrainer`)."""

    def _setup_program(self) -> None:
        """The program a replay runs besides the plan (hf_unlearn.trace.guards): refused up front when the run
        changed outside its record at or after the start; the recorded callbacks rebuilt with their attributes at
        the start step; the recording's per-step fingerprints to compare with."""
        full = self.run.served_plan or self.run.plan
        if not self._self_check and not self.filter_rows:  # the self-check finds it by its fingerprints instead
            why = program_refusal(self.run, self.start_step)
            if why:
                raise ProgramChangedError(f"{self.run.path}: {why}; refusing before any compute")
            why = unsealed_code_refusal(self.run, self.first_affected_step)
            if why:  # the same on every process (read from the plan): all refuse here
                raise UnlearnError(why)
            why = unlisted_hazard(self.run) if self.forget_ids else None  # (read from the run's files: all alike)
            if why:
                raise UnlearnError(why)
        self._recorded_fps = recorded_fingerprints(full, self.run.header)
        self._fp_scope = fingerprint_scope(self._recorded_fps)  # the state digests' tensors, as recorded
        self._neutral_controls = neutral_controls(self.run.header)  # proven steps whose controls differ, not the state
        # state.epoch during step s (the recording's, when its guards recorded it) and after the last step
        def epoch(text):
            return None if text is None else float.fromhex(text)

        self._epochs = {e.step: epoch(e.extra["ep"]) for e in full if e.j == 0 and "ep" in e.extra}
        final = ((self.run.header.get("fidelity") or {}).get("guards") or {}).get("final") or {}
        if "ep" in final:
            self._epochs[final["step"] + 1] = epoch(final["ep"])
        planned = (self.run.header.get("checkpoint_retention") or {}).get("planned_steps")
        self.state.max_steps = planned or self.run.total_steps  # as the recording's TrainerState held it
        self._step_fps: dict[int, dict] = {}
        self._fps_matched = {"state": [], "controls": []}
        specs = (self.run.header.get("trainer") or {}).get("callbacks") or []
        states = None
        for e in self.run.plan:
            if e.j == 0 and e.step <= self.start_step and "callbacks" in e.extra:
                states = e.extra["callbacks"]
        if specs and (states is None or len(states) != len(specs)):
            raise UnlearnError(f"{self.run.path} records {len(specs)} callback(s) a replay runs again but not their "
                               f"attributes at step {self.start_step}: the plan is not the one the recording wrote")
        self._program_callbacks = [rebuild_callback(spec, st) for spec, st in zip(specs, states or [])]
        self._out_cb_states = states
        recorded = (self.run.header.get("fidelity") or {}).get("program_globals")
        differ = globals_differences(self.run.key, recorded, replayed_globals(replayed_classes(
            self._program_callbacks, recorded_trainer(self.run.header)[0], self.data_collator))) if recorded else []
        if differ:  # a constant its module read from the environment (or a file) when imported, here otherwise
            raise UnlearnError(f"{self.run.path}: {differ[0]} holds another value in this process than while "
                               f"recording{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''} (a constant "
                               "its module read from the environment or a file when imported?): a replay here would "
                               "run that code otherwise; refusing before any compute (run the deletion with the "
                               "recording's environment and files)")

    def _setup_start_proof(self) -> None:
        """How this replay's fresh start at its kept checkpoint is proven (the output's ``fidelity.start``): by the
        proof (``"proof"``); by the deletion's probe step from it with no deletion, before any compute (``"probe"``,
        given as ``proven_start``: :func:`hf_unlearn.trace.proof.before_deletion`); else by this replay's own first
        step, before the first affected one, whose state must match the recording's fingerprint (``"replay"``: else
        it stops there, before any deleted row trains). None: not proven, and verify says so."""
        c, given = self.start_step, self._proven_start or {}
        self._start_proof, self._start_by_replay = None, False
        if self._self_check or self.filter_rows or self._start_weights is not None:
            return
        if c in proof_starts(self.run.header):
            self._start_proof = {"checkpoint": c, "proven_by": "proof"}
        elif given.get("checkpoint") == c and given.get("proven_by") == "probe":
            self._start_proof = {"checkpoint": c, "proven_by": "probe"}
        else:
            self._start_by_replay = c < self.first_affected_step and c in self._recorded_fps

    def _event(self, event: str) -> None:
        """Run a recorded callback event as the recording's Trainer did at this point of the step."""
        if self._program_callbacks:
            if getattr(self, "_stand_ins", None) is None:
                trainer = self.run.header.get("trainer", {})
                self._stand_ins = (ReplayedScheduler(self), ReplayedDataloader(
                    trainer.get("dataloader_len"), self.args.per_device_train_batch_size,
                    (trainer.get("callback_arguments") or {}).get("dataloader")))
            scheduler, loader = self._stand_ins
            if event == "on_step_end":  # the recorded scheduler's step() wrote the next rates before this event
                scheduler.write_rates()
            run_event(self._program_callbacks, event, self.args, self.state, self.control, model=self.model,
                      processing_class=self.processing_class, optimizer=self.optimizer, lr_scheduler=scheduler,
                      train_dataloader=loader, eval_dataloader=None)

    def _recorded_trainer_arguments(self) -> dict:
        """What the run's own trainer class takes beyond model/args/collator: its recorded arguments, the store as
        its (already prepared) train_dataset and the saved tokenizer. Nothing for a plain ``Trainer`` run."""
        header = self.run.header
        if is_default(header):
            return {}
        out = {**header["trainer"].get("kwargs", {}), "train_dataset": self.store}
        if (self.run.path / PROCESSING_CLASS_DIR).is_dir():
            out["processing_class"] = load_processing_class(self.run.path / PROCESSING_CLASS_DIR)
        return out

    def _enable_activation_checkpointing(self) -> None:
        """As ``Trainer.train`` does: the recorded run's backward recomputed its activations (SFTConfig's default)."""
        args = self.args
        if not getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)):
            return
        gc_kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
                         or {})
        every_n_layers, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs or None,
                                                       every_n_layers=every_n_layers, offload=offload)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or None)

    def _gradient_digest(self, step: int) -> str | None:
        """The exact digest of the gradients ``optimizer.step()`` is about to use, at a step whose state is compared
        with a recording that kept it (the main process's, as the recording kept it): a difference then says
        which side of ``optimizer.step()`` it comes from."""
        recorded = self._recorded_fps.get(step) or {}
        if "g" not in recorded or step >= self.first_affected_step or self.filter_rows \
                or not self.accelerator.is_main_process:
            return None
        return exact_digest(tensor_checksums(gradient_tensors(self.model)))

    def _check_step_fingerprint(self, step: int) -> None:
        """Compare this replay's fingerprint of ``step`` with the recording's: the controls at every step (a deletion
        does not change them), the state before the first affected step."""
        recorded, actual = self._recorded_fps.get(step), self._step_fps.get(step)
        if self.filter_rows or recorded is None or actual is None or "c" not in actual or "c" not in recorded:
            return
        state = step < self.first_affected_step
        if step in self._neutral_controls and recorded.get("c") != actual.get("c"):  # proven: a neutral difference
            recorded = {**recorded, "c": actual["c"], "lr": actual.get("lr")}
        fresh = self._start_by_replay and step == self.start_step and state
        try:
            compare_fingerprint(step, recorded, actual, state, who=f"the {self.mode}")
        except FidelityError as e:
            # a step the replay runs with no deletion doubles as the environment probe: name what differs in it
            env = environment_difference((self.run.header.get("numeric_stack") or {}).get("environment"))
            also = f"; this process's numeric environment differs from the recording's: {env}" if env else ""
            if fresh:  # the first step from the checkpoint, before any deleted row: the fresh start is the cause
                raise fresh_start_refusal(self.run.path, step, f"{e}{also}", "any deleted row is trained on") from e
            if also:
                raise FidelityError(f"{e}{also}") from e
            raise
        if fresh:
            self._start_proof = {"checkpoint": step, "proven_by": "replay"}
        self._fps_matched["controls"].append(step)
        if state:
            self._fps_matched["state"].append(step)

    def _check_fidelity(self, step: int, saved: Path | None) -> None:
        """At a recorded checkpoint before the first affected step, the state must be the recorded one (else stop)."""
        recorded = self._recorded_checkpoints.get(step)
        reference = self._fidelity_reference.get(step)  # the recorder's in-memory state hashes (its self-check)
        if (recorded is None and reference is None) or step == self.start_step or step > self.first_affected_step:
            return
        if saved is not None:
            actual = json.loads((saved / "hashes.json").read_text())
        elif step in self._gathered_hashes:  # a sharded run's, gathered by _save_state
            actual = self._gathered_hashes.pop(step)
        else:
            # hashed under the rule of the state it is compared with (a run recorded before the plain rule: its own)
            plain = uses_plain_names(json.loads((Path(recorded) / "hashes.json").read_text())) \
                if recorded is not None else uses_plain_names(reference)
            actual = checkpoint_hashes(capture_state(self.model, self.optimizer, step), plain=plain)
        if reference is not None:
            check_against_state(self.run.path, step, reference, actual, who=f"the {self.mode}",
                                where=f"step {step} (the recording's own state, hashed in memory as it trained)")
        if recorded is not None:
            check_against_checkpoint(self.run.path, step, recorded, actual, who=f"the {self.mode}")
            self.checkpoints_matched.append(step)
