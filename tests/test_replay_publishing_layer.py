"""The replay engine knows nothing of the Hub; the replay trainers a user imports publish (issue #45).

The engine (``hf_unlearn.trace.replay``) sits below ``hub/``; ``hf_unlearn.hub.replay`` puts ``UnlearningHubMixin``
above its classes, and the names users import resolve to those.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_importing_the_engine_and_the_proof_loads_no_hub_module():
    """At run time, not only in the import graph: no string import, no lazy import at module level."""
    code = ("import sys, hf_unlearn.trace.replay, hf_unlearn.trace.proof, hf_unlearn.trace.recording\n"
            "print(sorted(m for m in sys.modules if m.startswith('hf_unlearn.hub')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_public_replay_trainers_are_the_engines_with_the_hub_mixin_above():
    import hf_unlearn
    import hf_unlearn.trace as trace
    from hf_unlearn.hub.mixin import UnlearningHubMixin
    from hf_unlearn.trace import replay as engine

    for name in ("ReplayTrainer", "RedactedReplayTrainer", "OracleReplayTrainer"):
        public = getattr(trace, name)
        assert public.__module__ == "hf_unlearn.hub.replay" and public.__name__ == name
        assert issubclass(public, getattr(engine, name)) and issubclass(public, UnlearningHubMixin)
        assert not issubclass(getattr(engine, name), UnlearningHubMixin)
        mro = public.__mro__
        # the mixin's push_to_hub comes before the engine's refusal; the engine's card info before the mixin's stub
        assert mro.index(UnlearningHubMixin) < mro.index(engine.ReplayTrainer)
        assert public.unlearning_card_info is engine.ReplayTrainer.unlearning_card_info
    assert hf_unlearn.RedactedReplayTrainer is trace.RedactedReplayTrainer
    assert hf_unlearn.OracleReplayTrainer is trace.OracleReplayTrainer


def test_the_engine_refuses_to_publish_rather_than_push_its_output_folder():
    """Trainer.push_to_hub would upload the output folder (the run's key and store): the engine says where to go."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.replay import RedactedReplayTrainer

    with pytest.raises(UnlearnError, match=r"does not publish: use hf_unlearn.RedactedReplayTrainer"):
        RedactedReplayTrainer.push_to_hub(object(), "org/model")
