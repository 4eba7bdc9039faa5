"""The end-to-end demo behind ``hf-unlearn demo``: offline, minutes on 2 CPU cores.

Stage 1 fine-tunes a model on a TOFU subset (a few fictitious authors) and reports the loss on the
author that will be forgotten and on the retained authors, with a sample answer. Later stages (record,
delete, unlearn, evaluate, publish) hang off the same fine-tuned run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UnlearnError

ROWS_PER_AUTHOR = 20


@dataclass
class DemoConfig:
    model: str | None = None  # Hub id / local path / GGUF; None = tiny Llama built locally
    tofu_path: str | None = None  # local TOFU folder; None = $HF_UNLEARN_DATA_DIR/tofu, else the Hub
    output_dir: str = "demo_output"
    authors: int = 8
    forget_authors: int = 1
    epochs: float = 25.0
    learning_rate: float | None = None
    batch_size: int = 8
    max_length: int = 128
    seed: int = 0
    trace_baselines: bool = True  # also train the naive filter/repack counterfactuals (2 more runs) in stage 2
    stats: dict = field(default_factory=dict)


def _print(msg: str = "") -> None:
    print(msg, flush=True)


def load_demo_data(cfg: DemoConfig):
    """The first ``authors`` authors of TOFU ``full``; the last ``forget_authors`` of them form the forget set."""
    from .data import load_tofu

    if cfg.forget_authors < 1 or cfg.forget_authors >= cfg.authors:
        raise UnlearnError("--forget-authors must be at least 1 and smaller than --authors")
    full = load_tofu("full", cfg.tofu_path)
    subset = full.select(range(cfg.authors * ROWS_PER_AUTHOR))
    first_forget = (cfg.authors - cfg.forget_authors) * ROWS_PER_AUTHOR
    forget_ids = list(range(first_forget, cfg.authors * ROWS_PER_AUTHOR))
    return subset, forget_ids


def load_demo_model(cfg: DemoConfig, texts):
    from .models import build_tiny_model, build_tiny_tokenizer, load_model, load_tokenizer

    if cfg.model is None:
        tokenizer = build_tiny_tokenizer(texts, vocab_size=1024)
        model = build_tiny_model("llama", tokenizer, hidden_size=128, num_layers=2, num_heads=4, seed=cfg.seed)
        return model, tokenizer, "tiny Llama (built locally, 2 layers x 128)"
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model)
    return model, tokenizer, cfg.model


def fine_tune(cfg: DemoConfig, model, tokenizer, train_dataset, output_dir: Path, trainer_cls=None, **trainer_kwargs):
    """Fine-tune with a plain ``Trainer`` (or ``trainer_cls``), progress bar on, no checkpoints."""
    from transformers import Trainer, TrainingArguments

    from .data import QACollator

    lr = cfg.learning_rate or (3e-3 if cfg.model is None else 2e-5)
    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=lr,
        warmup_steps=10,
        weight_decay=0.0,
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
        use_cpu=not _has_accelerator(),
        remove_unused_columns=False,
        disable_tqdm=False,
    )
    cls = trainer_cls or Trainer
    trainer = cls(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=_DropIds(QACollator.from_tokenizer(tokenizer)) if cls is Trainer else QACollator.from_tokenizer(tokenizer),
        **trainer_kwargs,
    )
    trainer.train()
    return trainer


class _DropIds:
    """A plain ``Trainer`` passes every batch key to ``model.forward``; ids are for hf_unlearn trainers only."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        batch.pop(self.collator.id_column, None)
        return batch


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def mean_answer_loss(model, tokenizer, dataset, batch_size: int = 16) -> float:
    """Mean per-token cross-entropy on answer tokens (labels != -100)."""
    import torch

    from .data import QACollator

    collate = QACollator.from_tokenizer(tokenizer)
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
            labels = batch["labels"].to(device)[:, 1:]
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            mask = labels != -100
            nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            total += float(nll[mask].sum())
            count += int(mask.sum())
    return total / max(count, 1)


def sample_answer(model, tokenizer, question: str, max_new_tokens: int = 40) -> str:
    import torch

    from .data.tokenize import format_prompt, has_chat_template

    prompt = format_prompt(tokenizer, question)
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=not has_chat_template(tokenizer))
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **{k: v.to(device) for k, v in enc.items()},
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo and return the figures it printed (for tests and scripts)."""
    import torch

    from .data import tokenize_qa

    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    subset, forget_ids = load_demo_data(cfg)
    model, tokenizer, model_name = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    _print(f"== hf_unlearn demo: {model_name}, {cfg.authors} TOFU authors ({len(subset)} QA pairs), "
           f"forget set = last {cfg.forget_authors} author(s) ({len(forget_ids)} rows)")
    data = tokenize_qa(subset, tokenizer, max_length=cfg.max_length)
    forget_set = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in forget_set)
    retain = data.filter(lambda r: r["id"] not in forget_set)

    before = {"forget": mean_answer_loss(model, tokenizer, forget), "retain": mean_answer_loss(model, tokenizer, retain)}
    from .trace import TraceRecordingTrainer

    _print(f"[1/2] fine-tuning for {cfg.epochs:g} epochs (recorded by TraceRecordingTrainer in {out / 'trace'})")
    fine_tune(cfg, model, tokenizer, data, out / "finetune", trainer_cls=TraceRecordingTrainer, trace_dir=out / "trace")
    after = {"forget": mean_answer_loss(model, tokenizer, forget), "retain": mean_answer_loss(model, tokenizer, retain)}
    _print(f"answer loss before fine-tuning: forget {before['forget']:.3f}  retain {before['retain']:.3f}")
    _print(f"answer loss after fine-tuning:  forget {after['forget']:.3f}  retain {after['retain']:.3f}"
           f"  (perplexity {math.exp(after['forget']):.2f} / {math.exp(after['retain']):.2f})")
    question = subset[forget_ids[0]]["question"]
    _print(f"Q: {question}")
    _print(f"A (model):     {sample_answer(model, tokenizer, question)}")
    _print(f"A (reference): {subset[forget_ids[0]]['answer']}")
    cfg.stats.update({"loss_before": before, "loss_after": after})
    cfg.stats["deletion"] = trace_deletion_stage(cfg, model, tokenizer, forget, retain, forget_ids, out)
    return cfg.stats


def trace_deletion_stage(cfg: DemoConfig, model, tokenizer, forget, retain, forget_ids, out: Path) -> dict:
    """Stage 2: honour a deletion request for the forget author exactly (redact, replay, oracle, verify)."""
    import copy
    import shutil

    from .trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, replay_cost
    from .trace.replay import filter_counterfactual, repack_counterfactual
    from .trace.run import full_model_state
    from .trace.verification import compare_states, load_state, verify

    _print(f"[2/2] deletion request: the forget author's {len(forget_ids)} rows, honoured by trace-preserving replay")
    del_dir = out / "deletion"
    if del_dir.exists():
        shutil.rmtree(del_dir)
    run = open_run(out / "trace")
    cost = replay_cost(run, forget_ids)
    _print(f"cost: {cost['slots_deleted']} slots in {cost['affected_steps']} of {cost['total_steps']} optimizer steps; "
           f"suffix replay from checkpoint step {cost['start_checkpoint']} ({100 * cost['fraction_replayed']:.0f}% "
           f"of the run), {cost['segments_emptied']} accumulation segment(s) emptied")
    receipt = redact_store(run.store_path, forget_ids, del_dir / "store", run.key)
    _print(f"redacted store: {receipt['rows_before']} -> {receipt['rows_after']} rows; "
           f"{receipt['checks']['id_column_scanned']}")
    replay = RedactedReplayTrainer(run, del_dir / "store", forget_ids, del_dir / "replay")
    replay.train()
    OracleReplayTrainer(run, forget_ids, out_dir=del_dir / "oracle").train()
    report = verify(del_dir / "replay", del_dir / "oracle")
    p, o = report["params"], report["optimizer"]
    _print(f"verify replay vs oracle: parameters {p['mismatched_elements']} of {p['elements']:,} elements differ, "
           f"optimizer state {o['mismatched_elements']} of {o['elements']:,} differ; state-hash roots "
           f"{report['roots']['a']['params'][:12]}.../{report['roots']['a']['optimizer'][:12]}... "
           f"{'== oracle: VERIFIED bit-identical' if report['identical'] else '!= oracle: NOT identical'}")
    oracle = load_state(del_dir / "oracle")
    distances = {}
    baselines = (("filter", lambda: filter_counterfactual(run, forget_ids)),
                 ("repack", lambda: repack_counterfactual(run, forget_ids, del_dir / "repack_tmp")))
    for name, make in baselines if cfg.trace_baselines else ():
        state = make()
        cmp = compare_states(state, oracle)["params"]
        distances[name] = {"mismatched_elements": cmp["mismatched_elements"], "l2": cmp["l2"]}
        _print(f"naive {name:6s} vs oracle: {cmp['mismatched_elements']:,} of {cmp['elements']:,} parameter elements "
               f"differ, L2 distance {cmp['l2']:.4g}")
    shutil.rmtree(del_dir / "repack_tmp", ignore_errors=True)
    unlearned = copy.deepcopy(model)
    unlearned.load_state_dict(full_model_state(load_state(del_dir / "replay")))  # tied weights are stored once
    loss = {"forget": mean_answer_loss(unlearned, tokenizer, forget), "retain": mean_answer_loss(unlearned, tokenizer, retain)}
    _print(f"answer loss after the deletion: forget {loss['forget']:.3f}  retain {loss['retain']:.3f}")
    return {"cost": cost, "identical": report["identical"], "baselines": distances, "loss": loss}


