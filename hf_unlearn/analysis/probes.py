"""Linear probes, re-exported: they live in :mod:`hf_unlearn.eval.probes` (a probe is a measurement, which the probe
attack of :mod:`hf_unlearn.eval.robustness` uses too, and eval sits below analysis)."""

from ..eval.probes import majority_baseline, make_probe, probe_accuracy, probe_by_layer, transfer_accuracy

__all__ = ["majority_baseline", "make_probe", "probe_accuracy", "probe_by_layer", "transfer_accuracy"]
