"""A model given to a replay must be the recorded one (class, config, dtype, attention, adapter, frozen
parameters); without one the replay rebuilds it (:func:`hf_unlearn.trace.run_model.model_from_run`)."""

from __future__ import annotations

from ...errors import UnlearnError
from ..guards import VOLATILE_CONFIG
from ..recorder import frozen_parameters, peft_and_base

# config keys that say where a model came from, not what it computes
_VOLATILE_CONFIG = VOLATILE_CONFIG


def _check_model(model, header: dict) -> None:
    """A model passed to a replay must be the recorded architecture (class, config, dtype, attention, adapter)."""
    info = header["model"]
    peft, base = peft_and_base(model)
    problems = []
    if type(base).__name__ != info["class"]:
        problems.append(f"class {type(base).__name__} (recorded {info['class']})")
    if bool(peft) != bool(info.get("peft")):
        problems.append("a PEFT adapter" + (" it does not have" if info.get("peft") else " the run did not have"))
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    if info.get("dtype") and dtype != info["dtype"]:
        problems.append(f"dtype {dtype} (recorded {info['dtype']})")
    attn = getattr(base.config, "_attn_implementation", None)
    if info.get("attn_implementation") and attn != info["attn_implementation"]:
        problems.append(f"attention {attn} (recorded {info['attn_implementation']})")
    given, recorded = base.config.to_dict(), info.get("config") or {}
    keys = [k for k in sorted(set(given) | set(recorded)) if k not in _VOLATILE_CONFIG and given.get(k) != recorded.get(k)]
    if keys:
        problems.append("config " + ", ".join(f"{k}={given.get(k)!r} (recorded {recorded.get(k)!r})" for k in keys[:4]))
    if info.get("frozen_parameters") is not None and frozen_parameters(model) != info["frozen_parameters"]:
        problems.append("other frozen parameters (requires_grad) than the recorded run's")
    if problems:
        raise UnlearnError("the model passed to the replay is not the recorded one: " + "; ".join(problems)
                           + " (omit model= to rebuild it from the trace)")
