"""The random-label forgetting experiment: fine-tune on several tasks, forget each one, measure.

1. Fine-tune the model on the union of the tasks' training rows (true labels), logging when each row is learned.
2. For every task A, from the fine-tuned weights: random-label training on A's training rows, logging when each row
   is forgotten; then evaluate A (train and unseen test rows) and, for the cross-task matrix, every other task's test.
3. Measure: forget gap/ratio (train vs test), predictors (fine-tuned accuracy, mean confidence, total variance of
   the last-layer last-prompt-token representation), learned-vs-forgotten rank correlation, and per-layer linear
   probes on the forgotten model's representations of A (true labels).

Everything lands in a JSON-able dict (:func:`run_forgetting_experiment`) that :mod:`.report` renders.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from . import forgetting as F


@dataclass
class ForgettingSetup:
    """Sizes and hyperparameters of one run (kept small by default: CPU-sized)."""

    tasks: list[str] = field(default_factory=lambda: ["rte", "cola", "piqa", "sciq"])
    n_train: int = 48
    n_test: int = 48
    epochs: float = 2.0
    forget_epochs: float = 2.0
    learning_rate: float = 2e-5
    forget_learning_rate: float = 2e-5
    batch_size: int = 8
    max_length: int = 128
    label_mode: str = "uniform"
    seed: int = 0
    train_last_layers: int | None = None  # train only the top N transformer blocks (cheaper backward on a CPU)
    cross_task: bool = True
    probes: bool = True
    probe_folds: int = 4
    data_path: str | None = None


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _args(cls, setup: ForgettingSetup, out: Path, lr: float, epochs: float, **extra):
    return cls(output_dir=str(out), learning_rate=lr, num_train_epochs=epochs,
               per_device_train_batch_size=setup.batch_size, per_device_eval_batch_size=setup.batch_size,
               max_length=setup.max_length, seed=setup.seed, save_strategy="no", logging_steps=1,
               disable_tqdm=True, use_cpu=not _has_cuda(), lr_scheduler_type="constant", warmup_steps=0, **extra)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def freeze_below(model, last_layers: int) -> int:
    """Freeze every parameter except the last ``last_layers`` transformer blocks and the final norm.

    Embeddings (tied to the LM head in small models) stay frozen. Returns the number of trainable parameters.
    """
    import re

    pattern = re.compile(r"\.(?:layers|h)\.(\d+)\.")
    indices = {int(m.group(1)) for n, _ in model.named_parameters() if (m := pattern.search(n))}
    if not indices:
        raise UnlearnError("cannot find numbered transformer blocks (…layers.N… or …h.N…) to freeze below")
    if last_layers < 1:
        raise UnlearnError("train_last_layers must be at least 1")
    first = max(indices) - last_layers + 1
    trainable = 0
    for name, param in model.named_parameters():
        m = pattern.search(name)
        keep = int(m.group(1)) >= first if m else param.ndim == 1  # outside the blocks: only the final norm is 1-D
        param.requires_grad_(keep)
        trainable += param.numel() if keep else 0
    return trainable


def _probe_rows(train_res, test_res, setup: ForgettingSetup, prefix: str) -> dict:
    """Per-layer probe accuracies (true labels, train + test rows pooled, cross-validated) under ``prefix``."""
    import numpy as np

    from ..eval.probes import majority_baseline, probe_by_layer

    states = np.concatenate([train_res.hidden_states, test_res.hidden_states], axis=1)
    labels = train_res.labels + test_res.labels
    try:
        accs = probe_by_layer(states, labels, setup.probe_folds, setup.seed)
    except UnlearnError as e:  # e.g. a class with a single row in a tiny subset
        return {f"{prefix}_error": str(e)}
    best = int(max(range(len(accs)), key=accs.__getitem__))
    return {f"{prefix}_by_layer": accs, f"{prefix}_best": accs[best], f"{prefix}_best_layer": best,
            "probe_majority": majority_baseline(labels)}


def load_splits(setup: ForgettingSetup) -> dict:
    """Seeded train/test subsets per task (``n_train`` + ``n_test`` rows drawn, then split)."""
    from ..data import load_task

    if setup.n_train < 4 or setup.n_test < 4:
        raise UnlearnError("n_train and n_test must be at least 4 rows per task")
    if not setup.tasks:
        raise UnlearnError("no tasks given")
    splits = {}
    for name in setup.tasks:
        ds = load_task(name, setup.data_path, test_size=setup.n_test, seed=setup.seed,
                       max_rows=setup.n_train + setup.n_test)
        for part in ("train", "test"):
            if len(ds[part]) == 0:
                raise UnlearnError(f"task {name!r}: the {part} split is empty; use fewer --n-test or more rows")
        splits[name] = ds
    return splits


def run_forgetting_experiment(model, tokenizer, setup: ForgettingSetup, out: str | Path) -> dict:
    """Run the whole experiment on ``model`` (modified in place; its fine-tuned weights are restored per task)."""
    from datasets import concatenate_datasets

    from ..eval.tasks import evaluate_multiple_choice
    from ..methods.random_label import (
        MultipleChoiceConfig,
        MultipleChoiceTrainer,
        RandomLabelConfig,
        RandomLabelForgetTrainer,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    splits = load_splits(setup)

    def score(name, part, hidden=False):
        return evaluate_multiple_choice(model, tokenizer, splits[name][part], batch_size=setup.batch_size,
                                        max_length=setup.max_length, hidden_states=hidden)

    result = {"setup": asdict(setup), "tasks": {}, "cross_task": {}, "timing_s": {}}
    for name in setup.tasks:
        base = score(name, "test")
        result["tasks"][name] = {"n_train": len(splits[name]["train"]), "n_test": len(splits[name]["test"]),
                                 "chance": base.chance, "acc_base_test": base.accuracy}
        _log(f"{name}: base test accuracy {base.accuracy:.3f} (chance {base.chance:.3f})")

    # 1. multi-task fine-tuning with true labels
    t0 = time.time()
    if setup.train_last_layers:
        n = freeze_below(model, setup.train_last_layers)
        _log(f"training the last {setup.train_last_layers} blocks + final norm only: {n:,} parameters")
    train_all = concatenate_datasets([splits[n]["train"] for n in setup.tasks]).shuffle(seed=setup.seed)
    ft = MultipleChoiceTrainer(model=model, args=_args(MultipleChoiceConfig, setup, out / "finetune",
                                                       setup.learning_rate, setup.epochs),
                               train_dataset=train_all, processing_class=tokenizer)
    ft.train()
    learned = {rid: F.first_stable_step(h, True) for rid, h in ft.correctness_history.items()}
    result["timing_s"]["finetune"] = time.time() - t0
    _log(f"fine-tuned in {time.time() - t0:.0f}s")
    ft_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    ft_acc_test = {}
    for name in setup.tasks:
        tr, te = score(name, "train", hidden=True), score(name, "test", hidden=True)
        ft_acc_test[name] = te.accuracy
        reps = tr.hidden_states[-1]
        result["tasks"][name].update({
            "acc_ft_train": tr.accuracy, "acc_ft_test": te.accuracy,
            "confidence_ft_train": tr.mean_confidence, "confidence_ft_test": te.mean_confidence,
            "total_variance_last_layer": F.total_variance(reps),
        })
        if setup.probes:  # the same probes before forgetting: what forgetting has to remove
            result["tasks"][name].update(_probe_rows(tr, te, setup, "probe_ft"))
        _log(f"{name}: fine-tuned accuracy train {tr.accuracy:.3f} test {te.accuracy:.3f}")

    # 2. forget each task from the fine-tuned weights
    for name in setup.tasks:
        t0 = time.time()
        model.load_state_dict(ft_state)
        forget = RandomLabelForgetTrainer(
            model=model, args=_args(RandomLabelConfig, setup, out / f"forget_{name}", setup.forget_learning_rate,
                                    setup.forget_epochs, label_mode=setup.label_mode),
            train_dataset=splits[name]["train"], processing_class=tokenizer)
        forget.train()
        forgotten = {rid: F.first_stable_step(h, False) for rid, h in forget.correctness_history.items()}
        tr, te = score(name, "train", hidden=True), score(name, "test", hidden=True)
        row = result["tasks"][name]
        chance = row["chance"]
        rho, p, n = F.order_rank_correlation(learned, forgotten)
        row.update({
            "acc_forgot_train": tr.accuracy, "acc_forgot_test": te.accuracy,
            "forget_gap_train": F.forget_gap(tr.accuracy, chance), "forget_gap_test": F.forget_gap(te.accuracy, chance),
            "forget_ratio_train": F.forget_ratio(row["acc_ft_train"], tr.accuracy, chance),
            "forget_ratio_test": F.forget_ratio(row["acc_ft_test"], te.accuracy, chance),
            "order_spearman": rho, "order_p": p, "order_n": n,
            "never_forgotten_train": sum(1 for v in forgotten.values() if math.isinf(v)),
        })
        if setup.probes:
            row.update(_probe_rows(tr, te, setup, "probe"))
            row["acc_forgot_all"] = (tr.accuracy * len(tr.labels) + te.accuracy * len(te.labels)) / (
                len(tr.labels) + len(te.labels))
        cross = {name: te.accuracy}
        if setup.cross_task:
            for other in setup.tasks:
                if other != name:
                    cross[other] = score(other, "test").accuracy
        result["cross_task"][name] = cross
        result["timing_s"][f"forget_{name}"] = time.time() - t0
        _log(f"{name}: forgot -> train {tr.accuracy:.3f} test {te.accuracy:.3f} "
             f"(ratio train {row['forget_ratio_train']:.2f} test {row['forget_ratio_test']:.2f}) in {time.time() - t0:.0f}s")

    model.load_state_dict(ft_state)
    chances = {n: result["tasks"][n]["chance"] for n in setup.tasks}
    result["cross_task_ratio"] = F.cross_task_matrix(ft_acc_test, result["cross_task"], chances)
    outcome = {n: result["tasks"][n]["forget_ratio_test"] for n in setup.tasks}
    predictors = {
        "acc_ft_test": {n: result["tasks"][n]["acc_ft_test"] for n in setup.tasks},
        "confidence_ft_test": {n: result["tasks"][n]["confidence_ft_test"] for n in setup.tasks},
        "total_variance_last_layer": {n: result["tasks"][n]["total_variance_last_layer"] for n in setup.tasks},
    }
    result["predictors"] = {m: F.predictor_correlations(predictors, outcome, m) for m in ("spearman", "pearson")}
    result["timing_s"]["total"] = time.time() - t_start
    return result
