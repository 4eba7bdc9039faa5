"""The one list of approximate-unlearning methods: name -> trainer, config, help and command-line options.

`hf-unlearn unlearn`, the benchmarks, the `forget` command and the method table of docs/approximate.md all read this
list, so a method is added in one place (plus its trainer, config and loss). Classes are named by import path: reading the
registry imports neither torch nor transformers, which keeps `hf-unlearn --help` instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import UnlearnError
from ..utils import import_object


@dataclass(frozen=True)
class MethodOption:
    """A method-specific command-line flag; its destination is the config field of the same name."""

    flag: str
    type: type
    help: str

    @property
    def field(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class MethodSpec:
    """One registered method.

    ``preset`` fixes config values that define a named variant (``npo_klr`` is NPO with ``retain_loss="kl"``);
    passing another value for a preset field is an error rather than a silent override.
    """

    name: str
    help: str
    trainer: str  # "module:Class"
    config: str  # "module:Class"
    options: tuple[MethodOption, ...] = ()
    preset: Mapping[str, Any] = field(default_factory=dict)
    stops_itself: bool = False

    def classes(self) -> tuple[type, type]:
        """(trainer class, config class), imported on first use."""
        return import_object(self.trainer), import_object(self.config)

    @property
    def trainer_class(self) -> type:
        return import_object(self.trainer)

    @property
    def config_class(self) -> type:
        return import_object(self.config)

    def make_config(self, **kwargs: Any):
        """The method's config with ``kwargs`` and the variant's ``preset`` applied."""
        for key, value in self.preset.items():
            if key in kwargs and kwargs[key] is not None and kwargs[key] != value:
                raise UnlearnError(f"method {self.name!r} fixes {key}={value!r}; got {key}={kwargs[key]!r} "
                                   f"(use the base method to choose {key} yourself)")
        return self.config_class(**{**kwargs, **self.preset})


_B = "hf_unlearn.methods.baselines"
_M = "hf_unlearn.methods.masc"
_P = "hf_unlearn.methods.preference"
_S = "hf_unlearn.methods.soft_targets"
_R = "hf_unlearn.methods.reweighted"
_D = "hf_unlearn.methods.pdu"


def _spec(name, help, module, cls, options=(), **kw) -> MethodSpec:
    return MethodSpec(name, help, f"{module}:{cls}Trainer", f"{module}:{cls}Config",
                      tuple(MethodOption(*o) for o in options), **kw)


METHODS: dict[str, MethodSpec] = {s.name: s for s in (
    _spec("masc", "margin self-correction; stops by itself", _M, "MASC", [
        ("--k", int, "top-k competitor tokens (default 10)"),
        ("--rho", float, "dominance level in (0, 1) (default 0.5)"),
        ("--alpha", float, "stop when the violation rate is <= alpha (default 0.2)"),
        ("--eta", float, "hinge buffer (default 1.0)"),
        ("--beta", float, "margin temperature (default 1.0)"),
        ("--competitors", str, "'current' or 'reference' (default current)"),
        ("--active-tokens", str, "'suffix' or 'all' (default suffix)"),
        ("--probe-steps", int, "probe every N steps (default 5)"),
        ("--probe-size", int, "monitored forget rows in the probe (default: 0 with held-out rows, else 8 or half; "
                              "0 = probe on the training batches, no extra forward)"),
        ("--hoeffding-delta", float, "stop on the Hoeffding upper bound at level 1-delta"),
    ], stops_itself=True),
    _spec("grad_ascent", "gradient ascent on the forget answers", _B, "GradAscent"),
    _spec("grad_diff", "gradient ascent on forget + cross-entropy on retain", _B, "GradDiff"),
    _spec("npo", "negative preference optimisation (--retain-loss kl = NPO+KLR)", _B, "NPO",
          [("--beta", float, "NPO inverse temperature (default 0.1)")]),
    _spec("npo_klr", "NPO with a KL retain term on the retain set (NPO+KLR)", _B, "NPO",
          [("--beta", float, "NPO inverse temperature (default 0.1)")], preset={"retain_loss": "kl"}),
    _spec("npo_rt", "NPO with a cross-entropy retain term (NPO+RT): NPO as OpenUnlearning runs it", _B, "NPO",
          [("--beta", float, "NPO inverse temperature (default 0.1)")], preset={"retain_loss": "ce"}),
    _spec("simnpo", "reference-free, length-normalised NPO", _B, "SimNPO",
          [("--beta", float, "inverse temperature (default 2.5)"),
           ("--gamma", float, "reward margin on the mean answer NLL, inside the beta scaling (default 0)")]),
    _spec("simnpo_tofu", "SimNPO with its authors' tuned TOFU forget10 setting (OpenUnlearning's SimNPO default): "
          "beta 4.5, gamma 0, forget weight 0.125, CE retain", _B, "SimNPO",
          preset={"beta": 4.5, "gamma": 0.0, "lambda_forget": 0.125, "lambda_retain": 1.0, "retain_loss": "ce"}),
    _spec("rmu", "representation misdirection (steer one layer's activations)", _B, "RMU",
          [("--layer-id", int, "steered layer (default: middle)"),
           ("--steering-coeff", float, "control norm c (default 6.5)")]),
    _spec("idk_dpo", "DPO preferring a refusal over the forget answer (IdkDPO)", _P, "IdkDPO",
          [("--beta", float, "DPO inverse temperature (default 0.1)"),
           ("--refusals-file", str, "refusal answers, one per line (default: the list shipped with hf_unlearn)")]),
    _spec("idk_nll", "cross-entropy on a refusal as the answer to each forget question (IdkNLL)", _P, "IdkNLL",
          [("--refusals-file", str, "refusal answers, one per line (default: the list shipped with hf_unlearn)")]),
    _spec("undial", "self-distillation from the original model with the answer logit lowered (UNDIAL)", _S, "UNDIAL",
          [("--beta", float, "penalty on the answer token's logit (default 10)")]),
    _spec("ce_u", "cross-entropy against the model's distribution without the answer token (CE-U)", _S, "CEU",
          [("--skip-first", int, "answer tokens per row left out of the loss (default 1)")]),
    _spec("wga", "gradient ascent weighted by each token's probability p^beta (WGA)", _R, "WGA",
          [("--beta", float, "weight exponent (default 1)")]),
    _spec("satimp", "gradient ascent weighted by p^beta1 (1-p)^beta2 (SatImp)", _R, "SatImp",
          [("--beta1", float, "saturation exponent (default 5)"), ("--beta2", float, "importance exponent (default 1)")]),
    _spec("pdu", "logit flattening under a retain-loss budget, primal-dual (PDU)", _D, "PDU",
          [("--retain-loss-eps", float, "retain-loss budget (default: 2x the initial retain loss)"),
           ("--retain-tolerance", float, "relative slack of the default budget (default 1.0)"),
           ("--dual-step-size", float, "dual ascent step (default 5)"),
           ("--dual-warmup-ratio", float, "share of the steps before the multiplier moves (default 0.5)")]),
)}


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> MethodSpec:
    """The registered method called ``name``; an unknown name is a one-line error listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise UnlearnError(f"unknown unlearning method {name!r}; choose from {', '.join(METHODS)}") from None


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add a method (e.g. your own trainer) so the CLI and benchmarks see it."""
    if spec.name in METHODS and not replace:
        raise UnlearnError(f"a method named {spec.name!r} is already registered; pass replace=True to override it")
    METHODS[spec.name] = spec
    return spec
