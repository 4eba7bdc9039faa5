"""Where a replay starts: the kept checkpoint at or before the first affected step (or step 0), or, for a
pipeline stage whose parent changed, step 0 with the new parent's weights."""

from __future__ import annotations

from ...errors import UnlearnError
from ..base_source import base_key
from ..lineage import ADAPTER, weights_root
from ..run import full_model_state
from .cost import replay_cost


class ReplayStart:
    """The replay's start state (mixed into :class:`ReplayTrainer`)."""

    def _start_step(self) -> int:
        if self.start_mode == "full":
            if 0 not in self.run.checkpoints():
                raise UnlearnError(f"{self.run.path} has no step-0 checkpoint; a full replay is impossible")
            return 0
        if self.start_mode != "suffix":
            raise UnlearnError(f"start must be 'suffix' or 'full', not {self.start_mode!r}")
        if self.forget_ids:
            return replay_cost(self.run, self.forget_ids)["start_checkpoint"]
        cps = [c for c in self.run.checkpoints() if c <= self.run.total_steps]
        return max(cps) if cps else self.run.total_steps

    def _start_from_parent(self) -> None:
        """A pipeline stage whose parent changed: its step-0 state with the base weights replaced by the new parent's
        output (``start_weights``, plain names; adapter tensors and the optimizer's step-0 state stay as recorded).
        Every tensor must be there with the recorded shape and dtype."""
        if self.start_step != 0:
            raise UnlearnError("a replay from a new parent's weights starts at step 0 (start='full')")
        given, model = self._start_weights, dict(self._start_state["model"])
        for name, t in model.items():
            if ADAPTER.search(name):
                continue
            new = given.get(base_key(name))
            if new is None or tuple(new.shape) != tuple(t.shape) or new.dtype != t.dtype:
                what = "lacks it" if new is None else f"holds {tuple(new.shape)} {new.dtype}"
                raise UnlearnError(f"{self.run.path}: the new parent's output cannot be this stage's start: its "
                                   f"{base_key(name)} {what}, the stage started from {tuple(t.shape)} {t.dtype}")
            model[name] = new.detach().to("cpu").clone()
        self._start_state = {**self._start_state, "model": model, "frozen": []}
        full = full_model_state(self._start_state)
        self._start_root = weights_root(full)
        expected = (self._start_parent or {}).get("start_root") or (self._start_parent or {}).get("output_root")
        if expected is not None and expected != self._start_root:
            raise UnlearnError(f"{self.run.path}: the start weights (root {self._start_root[:16]}...) are not the new "
                               f"parent's output (root {expected[:16]}...)")
