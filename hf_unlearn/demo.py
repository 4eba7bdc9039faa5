"""The end-to-end demo behind ``hf-unlearn demo``: offline, no data folder, a few minutes on 2 CPU cores.

Stages (each long one shows a progress bar):

1. record a fine-tune on a TOFU subset (the 10-author subset shipped in the package by default) with
   ``TraceRecordingTrainer``;
2. a deletion request arrives for one author (written as ``requests/author-N.jsonl``);
3. ``hf_unlearn.forget(run, ids, oracle=True)``: replay cost, redaction, suffix replay, the trace oracle and the
   bit-for-bit check, optionally the naive ``filter``/``repack`` counterfactuals, the model card and state hashes;
   pushed to a local Hub server the demo starts itself, downloaded again and verified (``hub verify``);
4. a second request, for another author, on a model whose run is treated as unavailable:
   ``hf_unlearn.forget(model, ids, method="masc")`` with evaluation before and after, card, push and verify;
5. a summary table (also ``OUT/demo_summary.json``).

Runnable again in the same folder (an earlier demo output is replaced; any other non-empty folder is refused);
nothing is left behind on failure, and no empty folder on success.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import UnlearnError

ROWS_PER_AUTHOR = 20
SUMMARY_FILE = "demo_summary.json"
DEMO_REPO = "demo/tiny-llama-tofu"


@dataclass
class DemoConfig:
    model: str | None = None  # Hub id / local path / GGUF; None = tiny Llama built locally
    tofu_path: str | None = None  # TOFU folder; None = the embedded 10-author subset (more authors: $HF_UNLEARN_DATA_DIR)
    output_dir: str = "demo_output"
    authors: int = 8
    forget_authors: int = 1
    epochs: float = 25.0
    learning_rate: float | None = None
    batch_size: int = 8
    max_length: int = 128
    seed: int = 0
    trace_baselines: bool = True  # also train the naive filter/repack counterfactuals (2 more runs) in stage 3
    masc: bool = True  # stage 4: MASC on another author
    masc_learning_rate: float | None = None  # None: 1e-3 for the tiny model, 1e-5 otherwise
    publish: bool = True  # push both models to a local Hub server and verify them
    progress: bool = True
    stats: dict = field(default_factory=dict)


def _print(msg: str = "") -> None:
    print(msg, flush=True)


def load_demo_data(cfg: DemoConfig):
    """The first ``authors`` authors of TOFU ``full``; the last ``forget_authors`` of them form the forget set."""
    from .data.embedded import EMBEDDED_TOFU_AUTHORS, load_embedded_tofu

    if cfg.forget_authors < 1 or cfg.forget_authors >= cfg.authors:
        raise UnlearnError("--forget-authors must be at least 1 and smaller than --authors")
    if cfg.tofu_path is None and cfg.authors <= EMBEDDED_TOFU_AUTHORS:
        subset = load_embedded_tofu(cfg.authors)
    else:
        from .data import load_tofu

        subset = load_tofu("full", cfg.tofu_path).select(range(cfg.authors * ROWS_PER_AUTHOR))
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

    from .data.collators import IdDroppingCollator, QACollator
    from .utils import has_cuda

    lr = cfg.learning_rate or (3e-3 if cfg.model is None else 2e-5)
    accelerator = has_cuda()
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
        use_cpu=not accelerator,
        dataloader_pin_memory=accelerator,
        remove_unused_columns=False,
        disable_tqdm=not cfg.progress,
    )
    cls = trainer_cls or Trainer
    trainer = cls(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=IdDroppingCollator(QACollator.from_tokenizer(tokenizer)) if cls is Trainer else QACollator.from_tokenizer(tokenizer),
        **trainer_kwargs,
    )
    trainer.train()
    return trainer


def tiny_tofu_model(authors: int = 3, epochs: float = 15.0, seed: int = 0, max_length: int = 96,
                    progress: bool = False):
    """A tiny Llama that has memorised the first ``authors`` authors of the embedded TOFU subset (seconds on a CPU).

    Returns ``(model, tokenizer, rows)``: the raw QA rows with their TOFU ids. Examples and tests start from it so
    that unlearning has something to remove, offline.
    """
    import tempfile

    from .data import tokenize_qa

    cfg = DemoConfig(authors=max(authors, 2), forget_authors=1, epochs=epochs, seed=seed, max_length=max_length,
                     progress=progress)
    rows, _ = load_demo_data(cfg)
    model, tokenizer, _ = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in rows])
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_tiny_") as tmp:
        fine_tune(cfg, model, tokenizer, tokenize_qa(rows, tokenizer, max_length=max_length), Path(tmp))
    model.eval()
    return model, tokenizer, rows


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


# ---- the local Hub ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def local_hub(root: Path):
    """A Hub-compatible server on 127.0.0.1 for the demo, and huggingface_hub pointed at it while it runs.

    huggingface_hub reads ``HF_HUB_OFFLINE`` once, at import; offline mode keeps the internet away, and this server
    is on the loopback interface, so the flag is lifted for the demo's own calls and restored afterwards.
    """
    from huggingface_hub import constants

    from .hub.server import HubServer

    token = "hf_demo_" + secrets.token_hex(8)
    server = HubServer(root, {token: "demo"}).start()
    saved = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = False, True
    try:
        yield server, token
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = saved
        server.stop()


@contextlib.contextmanager
def _demo_key(out: Path):
    """Keyed tags under a key kept in the demo's folder, unless the user chose a key (the demo is not their data)."""
    if os.environ.get("HF_UNLEARN_KEY_FILE") or os.environ.get("HF_UNLEARN_TAG_KEY"):
        yield
        return
    from .utils import private_dir

    os.environ["HF_UNLEARN_KEY_FILE"] = str(private_dir(out) / "id_tag.key")
    try:
        yield
    finally:
        os.environ.pop("HF_UNLEARN_KEY_FILE", None)


# ---- the demo -----------------------------------------------------------------------------------------------
@dataclass
class _Stage:
    name: str
    outcome: str
    seconds: float


def _check_earlier_output(summary: Path) -> None:
    """The demo replaces its own earlier output in place; a folder that merely holds a file of that name (someone's
    notes called demo_summary.json) is not one, and is refused rather than deleted."""
    try:
        stats = json.loads(summary.read_text())
        ok = isinstance(stats, dict) and isinstance(stats.get("stages"), list) and "total_s" in stats and all(
            isinstance(s, dict) and {"name", "outcome", "seconds"} <= s.keys() for s in stats["stages"])
    except (OSError, UnicodeDecodeError, ValueError):
        ok = False
    if not ok:
        raise UnlearnError(f"{summary.parent} holds a {SUMMARY_FILE} that is not a demo summary, so it is not an earlier "
                           "demo output to replace; choose a new --out folder")


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo and return the figures it printed (for tests and scripts)."""
    from .validation import check_positive, output_folder

    if cfg.forget_authors < 1 or cfg.forget_authors >= cfg.authors:
        raise UnlearnError("--forget-authors must be at least 1 and smaller than --authors")
    check_positive(authors=cfg.authors, epochs=cfg.epochs, batch_size=cfg.batch_size, max_length=cfg.max_length,
                   lr=cfg.learning_rate, masc_lr=cfg.masc_learning_rate)
    if cfg.model is not None:
        from .validation import check_model_source

        check_model_source(cfg.model)
    if cfg.tofu_path is not None:
        from .validation import check_existing_folder

        check_existing_folder(cfg.tofu_path, "TOFU folder")
    if cfg.masc and cfg.authors - cfg.forget_authors < 2:
        raise UnlearnError("the MASC stage forgets another author and keeps at least one: use --authors >= "
                           f"{cfg.forget_authors + 2} (or --no-masc)")
    started = time.perf_counter()
    with output_folder(cfg.output_dir, marker=SUMMARY_FILE, overwrite=True, marker_check=_check_earlier_output) as out, \
            _demo_key(out):
        stages = _run(cfg, out)
        total = time.perf_counter() - started
        _print(f"\n[5/5] summary ({total:.0f} s; {out})")
        width = max(len(s.name) for s in stages)
        for s in stages:
            _print(f"  {s.name.ljust(width)}  {s.seconds:6.1f} s  {s.outcome}")
        cfg.stats["stages"] = [asdict(s) for s in stages]
        cfg.stats["total_s"] = total
        from .utils import atomic_write_text

        atomic_write_text(out / SUMMARY_FILE, json.dumps(cfg.stats, indent=1, default=str) + "\n")
    return cfg.stats


def _run(cfg: DemoConfig, out: Path) -> list[_Stage]:
    import torch

    from .data import tokenize_qa
    from .data.ids import write_ids
    from .trace import TraceRecordingTrainer

    torch.manual_seed(cfg.seed)
    stages: list[_Stage] = []
    subset, forget_ids = load_demo_data(cfg)
    model, tokenizer, model_name = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    source = "embedded TOFU subset (MIT)" if cfg.tofu_path is None and cfg.authors <= 10 else f"TOFU from {cfg.tofu_path}"
    _print(f"== hf_unlearn demo: {model_name}, {cfg.authors} TOFU authors ({len(subset)} QA pairs, {source})")
    data = tokenize_qa(subset, tokenizer, max_length=cfg.max_length)
    forget_set = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in forget_set)
    retain = data.filter(lambda r: r["id"] not in forget_set)

    # 1. record
    t = time.perf_counter()
    before = {"forget": mean_answer_loss(model, tokenizer, forget), "retain": mean_answer_loss(model, tokenizer, retain)}
    _print(f"\n[1/5] fine-tuning for {cfg.epochs:g} epochs, recorded by TraceRecordingTrainer in {out / 'trace'}")
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
    stages.append(_Stage("record", f"answer loss {before['forget']:.2f} -> {after['forget']:.3f}; trace in "
                                   f"{out / 'trace'}", time.perf_counter() - t))

    # 2. the request
    first = forget_ids[0] // ROWS_PER_AUTHOR
    request = write_ids(out / "requests" / f"author-{first}.jsonl", forget_ids)
    _print(f"\n[2/5] deletion request: author {first}'s {len(forget_ids)} rows (ids {forget_ids[0]}-{forget_ids[-1]}), "
           f"written to {request}")
    stages.append(_Stage("deletion request", f"{len(forget_ids)} ids in {request.name}", 0.0))

    hub = local_hub(out / "hub") if cfg.publish else contextlib.nullcontext((None, None))
    with hub as (server, token):
        if server is not None:
            _print(f"local Hub server for the demo: {server.url} (storage {out / 'hub'})")
        publish = {"repo": DEMO_REPO, "endpoint": server.url, "token": token} if server is not None else {}
        stages += _exact_stage(cfg, out, request, tokenizer, model, forget, retain, forget_ids, publish)
        if cfg.masc:
            stages += _masc_stage(cfg, out, subset, forget_ids, publish)
    return stages


def _exact_stage(cfg, out, request, tokenizer, model, forget, retain, forget_ids, publish) -> list[_Stage]:
    import copy

    from .deletion import forget as forget_call
    from .trace.run import full_model_state
    from .trace.verification import compare_states, load_state

    _print("\n[3/5] exact deletion: hf_unlearn.forget(run, ids, oracle=True"
           + (f", repo={DEMO_REPO!r})" if publish else ")"))
    t = time.perf_counter()
    receipt = forget_call(out / "trace", request, out / "deletion-exact", oracle=True, tokenizer=tokenizer,
                          datasets=["locuslab/TOFU"], progress=cfg.progress, log=_print, **publish)
    seconds = time.perf_counter() - t
    ev = receipt.evidence
    stages = [_Stage("exact deletion", f"{receipt.verdict}, replay from step {ev['cost']['start_checkpoint']}",
                     seconds)]
    distances = {}
    if cfg.trace_baselines:
        t = time.perf_counter()
        distances = _baselines(cfg, out, tokenizer, forget_ids, load_state(out / "deletion-exact" / "oracle"),
                               compare_states)
        stages.append(_Stage("naive baselines", ", ".join(f"{k} L2 {v['l2']:.3g} from the oracle"
                                                         for k, v in distances.items()), time.perf_counter() - t))
    unlearned = copy.deepcopy(model)
    unlearned.load_state_dict(full_model_state(load_state(out / "deletion-exact" / "replay")))  # tied: stored once
    loss = {"forget": mean_answer_loss(unlearned, tokenizer, forget), "retain": mean_answer_loss(unlearned, tokenizer, retain)}
    _print(f"answer loss after the deletion: forget {loss['forget']:.3f}  retain {loss['retain']:.3f}")
    stages.append(_Stage("card + state hashes", f"saved-tensor root {receipt.state_hashes['params_root'][:16]}..., "
                                                f"optimizer root {receipt.state_hashes['optimizer_root'][:16]}...", 0.0))
    stages += _publish_stages(receipt)
    cfg.stats["deletion"] = {"cost": ev["cost"], "identical": ev["oracle"]["identical"], "verified": ev["verified"], "baselines": distances, "loss": loss,
                             "receipt": receipt.to_dict()}
    return stages


def _baselines(cfg, out: Path, tokenizer, forget_ids, oracle: dict, compare_states) -> dict:
    """The naive counterfactuals next to the oracle: ``filter`` (drop rows before the forward) and ``repack``."""
    import shutil

    from .deletion import with_replay_progress
    from .trace import open_run
    from .trace.replay import ReplayTrainer, repack_counterfactual

    run = open_run(out / "trace")
    distances = {}
    _print("naive counterfactuals (for comparison; neither is the deletion):")
    states = {"filter": lambda: with_replay_progress(ReplayTrainer, "filter baseline", cfg.progress)(
        run, forget_ids=forget_ids, start="full", filter_rows=True).train()}
    tmp = out / "deletion-exact" / "repack_tmp"
    states["repack"] = lambda: repack_counterfactual(run, forget_ids, tmp, callbacks=[step_bar(
        "repack baseline (retraining on the retained rows, fresh batching)", cfg.progress)])
    for name, make in states.items():
        cmp = compare_states(make(), oracle)["params"]
        distances[name] = {"mismatched_elements": cmp["mismatched_elements"], "l2": cmp["l2"]}
        _print(f"  {name:6s} vs oracle: {cmp['mismatched_elements']:,} of {cmp['elements']:,} parameter elements "
               f"differ, L2 distance {cmp['l2']:.4g}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(run.path / "_replay_tmp", ignore_errors=True)
    return distances


def step_bar(desc: str, progress: bool):
    """A ``TrainerCallback`` showing a bar of optimizer steps named ``desc``, like the replays' bars (the repack
    baseline is a plain Trainer run of a minute or more, which had only a clock)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class StepBar(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", leave=False, disable=not progress)

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return StepBar()


def _masc_stage(cfg, out: Path, subset, forget_ids, publish) -> list[_Stage]:
    from .deletion import forget as forget_call

    deleted = set(forget_ids)
    kept = subset.filter(lambda r: r["id"] not in deleted)  # what the exactly-unlearned model still knows
    author = (forget_ids[0] // ROWS_PER_AUTHOR) - 1
    ids = [i for i in kept["id"] if i // ROWS_PER_AUTHOR == author]
    request = out / "requests" / f"author-{author}.jsonl"
    from .data.ids import write_ids

    write_ids(request, ids)
    lr = cfg.masc_learning_rate or (1e-3 if cfg.model is None else 1e-5)
    _print(f"\n[4/5] a second request, author {author} ({len(ids)} rows), for a model whose training run is not "
           f"available: hf_unlearn.forget(model, ids, method='masc')")
    t = time.perf_counter()
    receipt = forget_call(out / "deletion-exact" / "model", request, out / "unlearn-masc", method="masc",
                          data=kept, learning_rate=lr, num_train_epochs=20, batch_size=4,
                          max_length=cfg.max_length, eval_rows=ROWS_PER_AUTHOR, max_retain_rows=0, seed=cfg.seed,
                          method_args={"retain_loss": "ce", "probe_size": 0}, datasets=["locuslab/TOFU"],
                          progress=cfg.progress, log=_print, **publish)
    seconds = time.perf_counter() - t
    ev = receipt.evidence
    b, a = ev["before"], ev["after"]
    _print("evaluation before -> after (answer loss, answer probability, ROUGE-L of the greedy answer):")
    for name in ("forget", "retain"):
        _print("  " + name + ": " + ", ".join(f"{m} {b[name][m]:.3f} -> {a[name][m]:.3f}"
                                            for m in ("answer_loss", "probability", "rouge_l") if a[name][m] is not None))
    stop = ev.get("stopped_step")
    stages = [_Stage("MASC", (f"stopped itself at step {stop}" if stop is not None else f"{ev['steps']} steps (cap)")
                     + f"; forget prob {b['forget']['probability']:.2f} -> {a['forget']['probability']:.2f}, "
                       f"retain {b['retain']['probability']:.2f} -> {a['retain']['probability']:.2f}", seconds),
              _Stage("card + state hashes", f"saved-tensor root {receipt.state_hashes['params_root'][:16]}...", 0.0)]
    stages += _publish_stages(receipt)
    cfg.stats["masc"] = {"author": author, "before": b, "after": a, "steps": ev["steps"], "stopped_step": stop,
                         "receipt": receipt.to_dict()}
    return stages


def _publish_stages(receipt) -> list[_Stage]:
    p = receipt.published
    if not p:
        return []
    return [_Stage("push (local Hub)", f"{p['repo']} {p['tag']} commit {p['commit'][:12]}",
                   receipt.timings.get("publish_s", 0.0)),
            _Stage("hub verify", ("OK" if p["verify_ok"] else "FAILED") + f": {p['verify_checked_tensors']} tensors "
                                 "match the manifest and the card", 0.0)]


def __getattr__(name):
    # The collator's old private name here. Imported on first use (data loads torch), so `hf-unlearn demo --help`
    # stays light.
    if name == "_DropIds":
        from .data.collators import IdDroppingCollator

        return IdDroppingCollator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
