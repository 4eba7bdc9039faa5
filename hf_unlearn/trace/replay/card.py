"""What a replay says about itself in a model card (the trainer contract ``unlearning_card_info()``): its own
numbers, the state-hash roots and the oracle verdict. The engine publishes nothing: the Hub-enabled classes are
:mod:`hf_unlearn.hub.replay`'s."""

from __future__ import annotations

import json

from ...errors import UnlearnError
from ...not_ids import own_numbers
from ..run import checkpoint_dir
from ..verification import REVERIFY, VERIFICATION_FILE, sealed_verdict


class ReplayCard:
    """The replay's card info (mixed into :class:`ReplayTrainer`)."""

    def push_to_hub(self, *args, **kwargs):
        """The engine does not publish: ``Trainer.push_to_hub`` would upload the output folder (the run's key, its
        store). The Hub-enabled classes are :mod:`hf_unlearn.hub.replay`'s (``hf_unlearn.RedactedReplayTrainer``)."""
        raise UnlearnError(f"{type(self).__name__} of hf_unlearn.trace.replay is the replay engine, which does not "
                           "publish: use hf_unlearn.RedactedReplayTrainer / OracleReplayTrainer (they push_to_hub), or "
                           "hf_unlearn.hub.push_unlearned with this trainer's unlearning_card_info()")

    def unlearning_card_info(self) -> dict:
        """What a model card needs (the Hub code turns ``forget_ids`` into keyed tags before publishing)."""
        stats = getattr(self, "replay_stats", {})
        hyperparameters = {"start": self.start_mode, "start_step": self.start_step,
                           "checkpoint_steps": self.run.header.get("checkpoint_steps"),
                           "dummy_token_id": self.dummy_token_id, "filter_rows": self.filter_rows}
        counts = {"exact": not self.filter_rows, **stats}  # steps and counts of this replay: its own numbers
        return {
            "method": "trace-preserving replay" + (" (oracle)" if self.mode == "oracle" else ""),
            "hyperparameters": hyperparameters,
            "forget_ids": list(self.forget_ids),
            "citation": "",
            "paper": "",
            # the parent by its run id: a local folder name is the user's file system, never published
            "extra": {**counts, "parent_run_id": self.run.header.get("run_id"), **self._exact_deletion_evidence()},
            # a run of 500 steps is not sample id 500: declared to the Hub's forget-id scanner by exact value
            "not_ids": {**own_numbers(hyperparameters, "hyperparameters"), **own_numbers(counts, "extra")},
        }

    def _exact_deletion_evidence(self) -> dict:
        """State-hash roots of the replayed state and, once ``trace verify`` ran, its verdict (for the model card)."""
        if self.mode == "oracle" or self.filter_rows or self.out_dir is None or not hasattr(self, "replay_stats"):
            return {}
        final = checkpoint_dir(self.out_dir, self.run.total_steps) / "hashes.json"
        if not final.is_file():
            return {}
        hashes = json.loads(final.read_text())
        verdict, why = sealed_verdict(self.out_dir)  # believed only under this replay's seal
        verified = bool(verdict and verdict.get("verified") and verdict["roots"]["a"]["params"] == hashes["params_root"])
        return {"exact_deletion": {
            "params_root": hashes["params_root"], "optimizer_root": hashes["optimizer_root"],
            "verified": verified,
            # published in the card: no local path or folder name (they are the user's, and may hold anything)
            "verification": ("bit-identical to the trace oracle" if verified
                             else f"not verified: {VERIFICATION_FILE} {why}: {REVERIFY}" if why
                             else "differs from the oracle" if verdict and not verdict.get("identical")
                             else f"not verified: {verdict.get('verdict')}" if verdict and not verdict.get("verified")
                             else "not verified: run `hf-unlearn trace verify REPLAY_DIR ORACLE_DIR` on this "
                                  "replay's output folder and a trace oracle's"),
        }}
