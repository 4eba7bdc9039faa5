"""What the counterfactual of a deletion from a preference (DPO) run keeps, for the receipt's guarantee line.

A deleted pair is not removed from DPO's loss the way a row is from an SFT loss: it keeps its slot. Its two rows
become a dummy pair without completion tokens, whose per-pair loss is a constant with no gradient, and it still
counts in the mean over the microbatch's pairs (the normaliser), as the recorded accumulation steps do. So the result
is the run with that pair's loss term held constant, not the run on a dataset without the pair (which would divide by
one pair fewer). The reference model is not trained: a reference that is not an output of the pipeline being deleted
from (a model given as ``ref_model=``) is left as it is, and whatever it learnt from the deleted rows stays in the
loss every replayed step computes.
"""

from __future__ import annotations

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def preference_terms(runs) -> dict | None:
    """``{"stages": [...], "outside_references": [{"stage", "params_root"}]}`` for the DPO stages of ``runs`` (opened,
    in training order; one run for a single-run deletion), or None when no stage is a preference run."""
    from ..trace.lineage import lineage_of

    stages, outside = [], []
    for k, run in enumerate(runs, start=1):
        ref = run.header.get("reference_model")
        if not ref:
            continue
        stages.append(k)
        start = lineage_of(run).get("start_root")
        if ref.get("kind") in ("initial", "model") and ref.get("params_root") != start:
            outside.append({"stage": k, "params_root": ref.get("params_root")})
    return {"stages": stages, "outside_references": outside} if stages else None


def preference_clause(terms: dict | None, pipeline: bool) -> str:
    """The guarantee line's sentence for :func:`preference_terms` (empty without a DPO stage)."""
    if not terms:
        return ""
    where = f"DPO stage(s) {', '.join(map(str, terms['stages']))}: " if pipeline else "DPO: "
    text = (f"; {where}each deleted pair keeps its slot (a dummy pair without completion tokens, whose loss term is "
            "a constant with no gradient) and is still counted in the mean over its microbatch's pairs (the "
            "recorded normaliser), so this is the run with the pair's loss held constant, not a run on one pair "
            "fewer")
    for ref in terms["outside_references"]:
        text += (f"; the DPO reference model of {'stage ' + str(ref['stage']) if pipeline else 'the run'} (params root "
                 f"{str(ref['params_root'])[:16]}...) is not an output of "
                 f"{'this pipeline' if pipeline else 'this run or its parent'}: this deletion leaves it unchanged, "
                 "and if it was trained on the deleted rows their influence through it remains")
    return text
