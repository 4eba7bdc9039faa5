"""Circuit-guided unlearning difficulty (CUD, Cheng et al., 2026): which forget samples will resist unlearning.

Before unlearning, each forget sample's circuit (:mod:`hf_unlearn.analysis.circuits`) is compared with the circuits
of two anchor groups found by real unlearning runs: **easy** anchors (high answer loss after unlearning under most
methods: forgotten) and **hard** anchors (low loss under most methods: kept). With ``s_E`` and ``s_H`` the similarities
to the easy and hard anchor circuits,

    CUD = (1 - s_E) / ((1 - s_E) + (1 - s_H))   in [0, 1]      (0 = looks like the easy anchors, 1 = like the hard)

Stratified forget sets (easiest, hardest, random) are written as typed id files that
:func:`hf_unlearn.data.ids.read_ids` reads, so they select forget rows for any unlearning trainer.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import UnlearnError
from .circuits import SIMILARITIES, CircuitSet, atomic_folder, circuit_similarity, extract_circuit, read_json

ANCHOR_FORMAT = "hf_unlearn.cud_anchors.v1"
CUD_FORMAT = "hf_unlearn.cud.v1"
CRITERIA = ("loss", "increase")
AGGREGATES = ("circuit", "mean")
STAT_KEYS = ("mean_edge_depth", "longest_path", "mlp_share", "late_share")


def cud_score(s_easy: float, s_hard: float) -> float:
    """``(1 - s_E) / ((1 - s_E) + (1 - s_H))``: 0 when the circuit matches the easy anchors, 1 when it matches the
    hard ones; 0.5 when it is equally close to both (including identical to both)."""
    if math.isnan(s_easy) or math.isnan(s_hard):
        return float("nan")
    d_easy, d_hard = max(0.0, 1.0 - float(s_easy)), max(0.0, 1.0 - float(s_hard))
    return 0.5 if d_easy + d_hard == 0 else d_easy / (d_easy + d_hard)


# ----------------------------------------------------------------------------------------------------------------
# anchors


@dataclass
class AnchorConfig:
    """Unlearning runs that find the anchors, and how anchors are picked from their per-sample losses."""

    methods: list[str] = field(default_factory=lambda: ["grad_diff", "npo"], metadata={
        "help": "Registered unlearning methods (hf_unlearn.methods.registry) run on the whole forget set."})
    epochs: float = field(default=5.0, metadata={"help": "Epochs over the forget set per run."})
    max_steps: int = field(default=-1, metadata={"help": "Step budget per run (overrides epochs when > 0)."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Learning rate of every run."})
    batch_size: int = field(default=4, metadata={"help": "Forget (and retain) rows per step."})
    max_length: int = field(default=256, metadata={"help": "Tokens per QA pair."})
    fraction: float = field(default=0.2, metadata={
        "help": "Share of the forget samples taken as easy anchors, and again as hard anchors."})
    criterion: str = field(default="loss", metadata={
        "help": "'loss' (post-unlearning answer loss) or 'increase' (post minus pre).", "choices": list(CRITERIA)})
    seed: int = field(default=0, metadata={"help": "Training seed of every run."})
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict, metadata={
        "help": "Per-method config fields (override the shared ones), e.g. {'npo': {'learning_rate': 5e-5}}."})
    id_column: str = field(default="id", metadata={"help": "Column holding each row's stable sample id."})

    def __post_init__(self):
        from ..methods.registry import get_method

        if not self.methods:
            raise UnlearnError("give at least one unlearning method for the anchor runs")
        for name in self.methods:
            get_method(name)  # unknown names fail here, before any training
        if not 0 < self.fraction <= 0.5:
            raise UnlearnError(f"fraction must be in (0, 0.5], got {self.fraction}")
        if self.criterion not in CRITERIA:
            raise UnlearnError(f"criterion must be one of {', '.join(CRITERIA)}, got {self.criterion!r}")


@dataclass
class AnchorSet:
    """Per-sample answer losses before and after each anchor run, the chosen anchors and the model they describe."""

    ids: list
    pre_loss: list[float]
    post_loss: dict[str, list[float]]
    easy: list
    hard: list
    criterion: str
    fraction: float
    model_fingerprint: str
    tokenizer_fingerprint: str
    runs: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        for method, losses in self.post_loss.items():
            if len(losses) != len(self.ids):
                raise UnlearnError(f"anchor run {method!r} has {len(losses)} losses for {len(self.ids)} samples")
        if len(self.pre_loss) != len(self.ids):
            raise UnlearnError(f"{len(self.pre_loss)} pre-unlearning losses for {len(self.ids)} samples")
        known = set(self.ids)
        stray = [i for i in self.easy + self.hard if i not in known]
        if stray:
            raise UnlearnError(f"anchor id {stray[0]!r} is not among the scored samples")
        if set(self.easy) & set(self.hard):
            raise UnlearnError("a sample cannot be both an easy and a hard anchor")

    @property
    def methods(self) -> list[str]:
        return list(self.post_loss)

    def mean_post_loss(self) -> dict:
        """Sample id -> post-unlearning answer loss averaged over the anchor runs."""
        return {sid: sum(self.post_loss[m][k] for m in self.post_loss) / len(self.post_loss)
                for k, sid in enumerate(self.ids)}

    def role(self, sample_id) -> str | None:
        return "easy" if sample_id in set(self.easy) else "hard" if sample_id in set(self.hard) else None

    def to_dict(self) -> dict[str, Any]:
        return {"format": ANCHOR_FORMAT, **asdict(self)}

    def save(self, out: str | Path) -> Path:
        """``OUT/anchors.json`` plus ``easy.jsonl`` / ``hard.jsonl`` (typed id files), written whole or not at all."""
        from ..data.ids import write_ids

        with atomic_folder(out, marker="anchors.json") as tmp:
            (tmp / "anchors.json").write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
            write_ids(tmp / "easy.jsonl", self.easy)
            write_ids(tmp / "hard.jsonl", self.hard)
        return Path(out)

    @classmethod
    def load(cls, path: str | Path) -> AnchorSet:
        """From an anchors folder (or its ``anchors.json``)."""
        path = Path(path)
        file = path / "anchors.json" if path.is_dir() else path
        if not file.is_file():
            raise UnlearnError(f"no anchors at {path} (expected a folder written by `hf-unlearn analyze anchors`)")
        data = read_json(file)
        if data.pop("format", None) != ANCHOR_FORMAT:
            raise UnlearnError(f"{file} is not an hf_unlearn anchor file (format {ANCHOR_FORMAT!r})")
        try:
            return cls(**data)
        except TypeError as e:
            raise UnlearnError(f"{file} is missing fields or has unknown ones ({e})") from None


def select_anchors(ids: Sequence, post_loss: Mapping[str, Sequence[float]], pre_loss: Sequence[float] | None = None,
                   fraction: float = 0.2, criterion: str = "loss") -> tuple[list, list]:
    """``(easy, hard)`` anchor ids from per-method per-sample losses after unlearning.

    Per method, a sample votes *forgotten* if its value (the post-unlearning loss, or its increase) ranks above the
    method's median and *kept* if below. Easy anchors: forgotten under most methods (a strict majority), the
    ``fraction`` of all samples with the highest mean rank; hard anchors: kept under most methods, the lowest.
    """
    import numpy as np
    from scipy.stats import rankdata

    n = len(ids)
    if n < 2:
        raise UnlearnError("anchors need at least 2 forget samples")
    if criterion not in CRITERIA:
        raise UnlearnError(f"criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    if criterion == "increase" and pre_loss is None:
        raise UnlearnError("criterion='increase' needs the pre-unlearning losses")
    ranks = []
    for method, losses in post_loss.items():
        values = np.asarray(losses, dtype=float)
        if values.shape != (n,) or not np.isfinite(values).all():
            raise UnlearnError(f"method {method!r}: expected {n} finite losses")
        if criterion == "increase":
            values = values - np.asarray(pre_loss, dtype=float)
        ranks.append((rankdata(values) - 1) / (n - 1))  # 0 = lowest value, 1 = highest
    ranks = np.stack(ranks)
    need = ranks.shape[0] // 2 + 1
    forgotten, kept, mean = (ranks > 0.5).sum(0), (ranks < 0.5).sum(0), ranks.mean(0)
    k = max(1, int(round(fraction * n)))
    order = np.lexsort((np.arange(n), -mean))  # highest mean rank first, ties by position
    easy = [ids[i] for i in order if forgotten[i] >= need][:k]
    hard = [ids[i] for i in order[::-1] if kept[i] >= need][:k]
    if not easy or not hard:
        raise UnlearnError("the anchor runs do not separate the samples (no sample is forgotten, or none kept, by "
                           "most methods); use more methods or a larger budget")
    return easy, hard


def answer_losses(model, tokenizer, rows, batch_size: int = 8) -> list[float]:
    """Each row's mean answer-token NLL (rows: ``input_ids`` and ``labels``, -100 on the prompt), in row order."""
    from ..eval.runner import pad_token_id, score_sequences

    enc = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    stats = score_sequences(model, enc, pad_id=pad_token_id(tokenizer), batch_size=batch_size, progress=False)
    return [s.mean_nll for s in stats]


def _tokenized(dataset, tokenizer, max_length: int, id_column: str):
    from ..data.tokenize import tokenize_qa

    if "input_ids" in dataset.column_names:
        return dataset
    return tokenize_qa(dataset, tokenizer, max_length=max_length, id_column=id_column)


def build_anchors(model, tokenizer, forget_dataset, retain_dataset=None, config: AnchorConfig | None = None, *,
                  progress: bool = True) -> AnchorSet:
    """Unlearn ``forget_dataset`` with each method of ``config`` (each run from a copy of ``model``, through the
    method registry, so any registered method works), record every sample's answer loss after each run, and pick the
    easy and hard anchors (:func:`select_anchors`)."""
    from ..eval.runner import tokenizer_fingerprint
    from ..methods.registry import get_method
    from .circuits import model_fingerprint

    config = config or AnchorConfig()
    if forget_dataset is None or len(forget_dataset) < 2:
        raise UnlearnError("anchors need a forget set of at least 2 samples")
    forget = _tokenized(forget_dataset, tokenizer, config.max_length, config.id_column)
    retain = None if retain_dataset is None else _tokenized(retain_dataset, tokenizer, config.max_length,
                                                             config.id_column)
    ids = list(forget[config.id_column])
    rows = list(forget)
    fingerprint = model_fingerprint(model)
    pre = answer_losses(model, tokenizer, rows)
    post: dict[str, list[float]] = {}
    runs: dict[str, dict] = {}
    for name in config.methods:
        spec = get_method(name)
        with tempfile.TemporaryDirectory(prefix=f"hfu-anchor-{name}-") as tmp:
            settings = dict(
                output_dir=tmp, num_train_epochs=config.epochs, max_steps=config.max_steps,
                learning_rate=config.learning_rate, per_device_train_batch_size=config.batch_size,
                per_device_eval_batch_size=config.batch_size, max_length=config.max_length, seed=config.seed,
                save_strategy="no", report_to=[], logging_steps=10, disable_tqdm=not progress,
                id_column=config.id_column,
            )
            args = spec.make_config(**{**settings, **config.method_options.get(name, {})})
            trainer = spec.trainer_class(model=copy.deepcopy(model), args=args, forget_dataset=forget,
                                         retain_dataset=retain, processing_class=tokenizer)
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
            post[name] = answer_losses(trainer.model, tokenizer, rows)
            info = trainer.unlearning_card_info()
            runs[name] = {"seconds": seconds, "steps": int(trainer.state.global_step),
                          "hyperparameters": info.get("hyperparameters", {}),
                          "mean_loss_before": sum(pre) / len(pre), "mean_loss_after": sum(post[name]) / len(rows)}
        del trainer
        gc.collect()
    easy, hard = select_anchors(ids, post, pre, config.fraction, config.criterion)
    return AnchorSet(ids=ids, pre_loss=pre, post_loss=post, easy=easy, hard=hard, criterion=config.criterion,
                     fraction=config.fraction, model_fingerprint=fingerprint,
                     tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), runs=runs)


# ----------------------------------------------------------------------------------------------------------------
# the score


@dataclass
class CUDResult:
    """One row per sample (``id``, ``cud``, ``s_easy``, ``s_hard``, ``anchor``, ``answer_loss``, ``stats``) + meta."""

    rows: list[dict]
    meta: dict = field(default_factory=dict)

    def by_id(self) -> dict:
        return {r["id"]: r for r in self.rows}

    def to_jsonl(self, path: str | Path) -> Path:
        """Rows as JSON Lines at ``path``; the settings and fingerprints in ``<path stem>.meta.json`` beside it."""
        from ..utils import atomic_write_text

        path = Path(path)
        atomic_write_text(meta_path(path), json.dumps({"format": CUD_FORMAT, **self.meta}, indent=1))
        atomic_write_text(path, "".join(json.dumps(_jsonable_row(r)) + "\n" for r in self.rows))
        return path

    @classmethod
    def from_jsonl(cls, path: str | Path) -> CUDResult:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise UnlearnError(f"cannot read CUD scores from {path}: {e.strerror or e}") from None
        rows, seen = [], set()
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UnlearnError(f"{path} line {n} is not JSON") from None
            if not isinstance(row, dict) or "id" not in row or "cud" not in row:
                raise UnlearnError(f"{path} line {n} is not a CUD row (needs 'id' and 'cud')")
            if row["id"] in seen:
                raise UnlearnError(f"{path} line {n}: sample id {row['id']!r} appears twice")
            cud = row["cud"]
            if cud is not None and (isinstance(cud, bool) or not isinstance(cud, (int, float)) or not 0 <= cud <= 1):
                raise UnlearnError(f"{path} line {n}: cud must be a number in [0, 1] or null, got {cud!r}")
            seen.add(row["id"])
            rows.append(row)
        if not rows:
            raise UnlearnError(f"{path} holds no CUD rows")
        meta = {}
        if meta_path(path).is_file():
            meta = read_json(meta_path(path))
            meta.pop("format", None)
        return cls(rows=rows, meta=meta)


def meta_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.stem + ".meta.json")


def _jsonable_row(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def check_same_model(circuits: CircuitSet, anchors: AnchorSet) -> None:
    """Refuse anchors built with another model or tokenizer than the circuits describe.

    The fingerprints show which model (the library's state-hash root) and tokenizer (vocabulary and special tokens)
    the files were made with; they do not prove the recorded losses are genuine: anyone can edit a JSON file.
    """
    if anchors.model_fingerprint != circuits.model_fingerprint:
        raise UnlearnError(f"the anchors were built with another model (fingerprint {anchors.model_fingerprint[:12]}) "
                           f"than the circuits ({circuits.model_fingerprint[:12]}); build anchors from this model")
    if anchors.tokenizer_fingerprint != circuits.tokenizer_fingerprint:
        raise UnlearnError(f"the anchors were built with another tokenizer (fingerprint "
                           f"{anchors.tokenizer_fingerprint}) than the circuits ({circuits.tokenizer_fingerprint})")
    missing = [i for i in anchors.easy + anchors.hard if i not in set(circuits.ids)]
    if missing:
        raise UnlearnError(f"{len(missing)} anchor sample(s) have no circuit (e.g. id {missing[0]!r}); score the "
                           "anchors' forget samples too")


def compute_cud(circuits: CircuitSet, anchors: AnchorSet, similarity: str = "cosine", aggregate: str = "circuit",
                weighted: bool = False) -> CUDResult:
    """CUD of every sample of ``circuits`` against the anchors.

    ``aggregate="circuit"``: each anchor group is one circuit, cut (as any circuit) from the group's mean edge scores;
    ``"mean"``: the mean similarity to each anchor's own circuit. An anchor sample is scored against its group
    without itself (leave-one-out); with a one-sample group its CUD is undefined (null).
    """
    import numpy as np

    if similarity not in SIMILARITIES:
        raise UnlearnError(f"similarity must be one of {', '.join(SIMILARITIES)}, got {similarity!r}")
    if aggregate not in AGGREGATES:
        raise UnlearnError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}")
    check_same_model(circuits, anchors)
    scores = circuits.scores.numpy()
    graph, n_top, selection = circuits.graph, circuits.config.top_edges, circuits.config.selection
    circuit_list = circuits.circuits
    groups = {"easy": [circuits.index(i) for i in anchors.easy], "hard": [circuits.index(i) for i in anchors.hard]}
    sums = {g: scores[idx].sum(0) for g, idx in groups.items()}
    cache: dict[tuple, Any] = {}

    def group_similarity(group: str, k: int) -> float:
        members = [j for j in groups[group] if j != k]
        if not members:
            return float("nan")
        if aggregate == "mean":
            return float(np.mean([circuit_similarity(circuit_list[k], circuit_list[j], similarity, weighted)
                                  for j in members]))
        key = (group, k if k in groups[group] else None)
        if key not in cache:
            total = sums[group] - (scores[k] if key[1] is not None else 0.0)
            cache[key] = extract_circuit(total / len(members), graph, n_top, selection)
        return circuit_similarity(circuit_list[k], cache[key], similarity, weighted)

    stats = circuits.statistics()
    rows = []
    for k, sid in enumerate(circuits.ids):
        s_easy, s_hard = group_similarity("easy", k), group_similarity("hard", k)
        rows.append({"id": sid, "cud": cud_score(s_easy, s_hard), "s_easy": s_easy, "s_hard": s_hard,
                     "anchor": anchors.role(sid), "answer_loss": float(circuits.clean_loss[k]), "stats": stats[k]})
    meta = {"similarity": similarity, "aggregate": aggregate, "weighted": weighted, "top_edges": n_top,
            "selection": selection, "baseline": circuits.config.baseline, "ig_steps": circuits.config.ig_steps,
            "anchor_methods": anchors.methods, "easy_anchors": len(anchors.easy), "hard_anchors": len(anchors.hard),
            "model_fingerprint": circuits.model_fingerprint, "tokenizer_fingerprint": circuits.tokenizer_fingerprint}
    return CUDResult(rows=rows, meta=meta)


def cud_correlation(result: CUDResult, losses: Mapping[Any, float], include_anchors: bool = False) -> dict[str, Any]:
    """Spearman rank correlation between CUD and a per-sample post-unlearning loss (negative = CUD predicts it:
    harder samples keep a lower loss). Anchors are left out by default (they defined the score)."""
    from scipy.stats import spearmanr

    pairs = [(r["cud"], losses[r["id"]]) for r in result.rows
             if r["cud"] is not None and not math.isnan(r["cud"]) and r["id"] in losses
             and (include_anchors or r.get("anchor") is None)]
    if len(pairs) < 3:
        return {"spearman": float("nan"), "p_value": float("nan"), "n": len(pairs)}
    res = spearmanr([p[0] for p in pairs], [p[1] for p in pairs])
    return {"spearman": float(res.statistic), "p_value": float(res.pvalue), "n": len(pairs)}


# ----------------------------------------------------------------------------------------------------------------
# stratified forget sets


def stratify(result: CUDResult, size: int, seed: int = 0, include_anchors: bool = False) -> dict[str, list]:
    """``{"easy", "hard", "random"}`` id lists of ``size`` samples: lowest CUD, highest CUD (hardest first), and a
    seeded random draw from the same pool. Anchors are left out unless ``include_anchors`` (they defined the score,
    so a set built from them would test the anchors, not CUD)."""
    if size < 1:
        raise UnlearnError(f"size must be >= 1, got {size}")
    pool = [r for r in result.rows if r["cud"] is not None and not math.isnan(r["cud"])
            and (include_anchors or r.get("anchor") is None)]
    if 2 * size > len(pool):
        raise UnlearnError(f"only {len(pool)} scored samples{'' if include_anchors else ' besides the anchors'}; "
                           f"easy and hard sets of {size} need {2 * size}")
    ranked = sorted(range(len(pool)), key=lambda k: (pool[k]["cud"], k))
    easy = [pool[k]["id"] for k in ranked[:size]]
    hard = [pool[k]["id"] for k in ranked[::-1][:size]]
    drawn = sorted(random.Random(seed).sample(range(len(pool)), size))
    return {"easy": easy, "hard": hard, "random": [pool[k]["id"] for k in drawn]}


def write_sets(out: str | Path, sets: Mapping[str, list], result: CUDResult | None = None,
               settings: Mapping[str, Any] | None = None) -> Path:
    """``OUT/{easy,hard,random}.jsonl`` (typed ids, one per line) and ``OUT/manifest.json`` (CUD and circuit
    statistics per set), written whole or not at all."""
    from ..data.ids import write_ids

    rows = result.by_id() if result is not None else {}
    manifest: dict[str, Any] = {"format": "hf_unlearn.cud_sets.v1", "settings": dict(settings or {}),
                                "cud_meta": dict(result.meta) if result is not None else {}, "sets": {}}
    for name, ids in sets.items():
        picked = [rows[i] for i in ids if i in rows]
        entry: dict[str, Any] = {"file": f"{name}.jsonl", "n": len(ids)}
        if picked:
            cuds = [r["cud"] for r in picked]
            entry.update({"cud_mean": sum(cuds) / len(cuds), "cud_min": min(cuds), "cud_max": max(cuds)})
            entry["stats_mean"] = {k: _mean([r["stats"].get(k) for r in picked if r.get("stats")]) for k in STAT_KEYS}
        manifest["sets"][name] = entry
    with atomic_folder(out, marker="manifest.json") as tmp:
        for name, ids in sets.items():
            write_ids(tmp / f"{name}.jsonl", ids)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return Path(out)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------------------------------------------
# plots


def _save(fig, path) -> Path:
    from ..eval.plots import save_figure  # one figure-saving routine for the library's plots

    return save_figure(fig, path)


def plot_cud_vs_loss(result: CUDResult, losses: Mapping[Any, float], path: str | Path,
                     ylabel: str = "answer loss after unlearning (mean over anchor runs)") -> Path:
    """Scatter of CUD against a per-sample post-unlearning loss, anchors marked, Spearman (non-anchors) in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corr = cud_correlation(result, losses)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for role, color, label in ((None, "tab:gray", "scored"), ("easy", "tab:green", "easy anchor"),
                               ("hard", "tab:red", "hard anchor")):
        pts = [(r["cud"], losses[r["id"]]) for r in result.rows
               if r.get("anchor") == role and r["cud"] is not None and r["id"] in losses]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, color=color, label=label, alpha=0.8)
    ax.set_xlabel("CUD (0 = easy-like circuit, 1 = hard-like)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"Spearman (non-anchors) = {corr['spearman']:.2f}, n = {corr['n']}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_circuit_statistics(groups: Mapping[str, Sequence[Mapping[str, float]]], path: str | Path) -> Path:
    """Mean (and standard error) of the circuit statistics per group, e.g. ``{"easy": [...], "hard": [...]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(STAT_KEYS), figsize=(3 * len(STAT_KEYS), 3.2))
    names = list(groups)
    colors = {"easy": "tab:green", "hard": "tab:red", "random": "tab:gray"}
    for ax, key in zip(axes, STAT_KEYS):
        means, errs = [], []
        for name in names:
            vals = np.array([s[key] for s in groups[name] if s and s.get(key) is not None], dtype=float)
            vals = vals[np.isfinite(vals)]
            means.append(vals.mean() if vals.size else np.nan)
            errs.append(vals.std(ddof=1) / np.sqrt(vals.size) if vals.size > 1 else 0.0)
        ax.bar(names, means, yerr=errs, color=[colors.get(n, "tab:blue") for n in names], capsize=3)
        ax.set_title(key.replace("_", " "), fontsize=10)
    return _save(fig, path)
