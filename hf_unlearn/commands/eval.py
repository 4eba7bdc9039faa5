"""`hf-unlearn eval ...`: TOFU, the retain-only TOFU reference, MUSE-News, quantised re-evaluation, robustness
attacks, trade-off plots."""

from __future__ import annotations

import sys
from pathlib import Path

from . import add_subcommands

# written out so that `hf-unlearn --help` imports no torch (tests/test_eval_conventions.py keeps them equal to
# hf_unlearn.data.prompts.PROMPT_FORMATS, eval.metrics.ES_NO_MATCH, eval.muse.VERBMEM_STOPS, eval.robustness.ATTACKS)
PROMPT_FORMATS = ("hf-unlearn", "open-unlearning")
ES_NO_MATCH = ("zero", "one_over_n")
VERBMEM_STOPS = ("ground_truth", "eos")
ATTACKS = ("relearning", "in_context", "quantization", "paraphrase", "probe")


def register(parser) -> None:
    sub = add_subcommands(parser)

    p = sub.add_parser("tofu", help="evaluate a model on TOFU (forget quality needs --reference)")
    p.add_argument("model", help="Hub id, local folder or .gguf file")
    _tofu_options(p)
    p.add_argument("--reference", default=None, help="the retain-only reference's tofu_results.json")
    p.set_defaults(func=run_tofu)

    p = sub.add_parser("tofu-reference", help="train the retain-only reference model on retainNN and evaluate it")
    p.add_argument("base", help="the base model (before any TOFU fine-tuning): Hub id, folder or .gguf")
    _tofu_options(p)
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--train-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--max-train-rows", type=int, default=None, help="train on a seeded subset of the retain split")
    p.add_argument("--train-ids", default=None, help="train on these TOFU ids instead of retainNN (a TOFU subset)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_tofu_reference)

    p = sub.add_parser("muse-news", help="evaluate a model on MUSE-News (verbmem, knowmem, privleak)")
    p.add_argument("model")
    _muse_options(p)
    p.add_argument("--reference", default=None, help="the retain-only model's muse_results.json (for privleak)")
    p.set_defaults(func=run_muse)

    p = sub.add_parser("quantized", help="the same evaluation before and after bitsandbytes weight quantisation")
    p.add_argument("model")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--quant-type", default=None, help="nf4 (default) or fp4 for 4 bits")
    p.add_argument("--benchmark", choices=("tofu", "muse-news"), default="tofu")
    _tofu_options(p)
    p.add_argument("--reference", default=None, help="reference result JSON of the chosen benchmark")
    p.add_argument("--muse", default=None, help="local MUSE-News folder (for --benchmark muse-news)")
    p.add_argument("--max-length", type=int, default=None, help="max tokens per scored sequence")
    p.set_defaults(func=run_quantized)

    p = sub.add_parser("robustness", help="relearning, quantisation, paraphrase and probe attacks on an unlearned model")
    p.add_argument("model", help="the unlearned model: Hub id, local folder or .gguf file")
    p.add_argument("--original", default=None, help="the model before unlearning (the baseline of the recovery "
                                                     "fraction)")
    p.add_argument("--reference", default=None,
                   help="a model attacked the same way: a retain-only model or the exact deletion of the same rows")
    p.add_argument("--reference-name", default="reference", help="its name in the table (default reference)")
    p.add_argument("--out", default="eval_results", help="output folder (default eval_results)")
    p.add_argument("--forget-split", default="forget10", choices=("forget01", "forget05", "forget10"))
    p.add_argument("--forget-ids", default=None, help="TOFU ids of the forgotten rows: 3600-3639,3700 or a file")
    p.add_argument("--relearn-ids", default=None, help="forget rows to relearn on (default: a seeded half)")
    p.add_argument("--retain-ids", default=None,
                   help="rows every model kept, for the truth probe (default: retain_perturbed minus the forget ids)")
    p.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)")
    p.add_argument("--max-items", type=int, default=None, help="only the first N forget (and holdout) rows")
    p.add_argument("--steps", default="0,10,25,50", help="relearning steps measured (default 0,10,25,50)")
    p.add_argument("--lr", type=float, default=1e-5, help="relearning learning rate (default 1e-5)")
    p.add_argument("--relearn-batch-size", type=int, default=4, help="rows per relearning step (default 4)")
    p.add_argument("--bits", default="4,8", help="quantisation widths re-evaluated, 'none' to skip (default 4,8)")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help=f"comma list of attacks (default all: {','.join(ATTACKS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=None, help="tokens per QA pair (default 512)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--chat-template", choices=("auto", "yes", "no"), default="auto",
                   help="prompt with the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--relearn-on", choices=("half", "paraphrased", "kept-same-authors"), default="half",
                   help="what relearning trains on: half (a seeded half of the forget rows, the other half measured; "
                        "default), paraphrased (the forget rows' paraphrased questions and answers: the measured facts "
                        "reworded) or kept-same-authors (the forgotten rows' TOFU authors' other questions, which the "
                        "model was trained on and kept: not outside data); the last two measure every forget row")
    p.add_argument("--in-context-rows", type=int, default=4,
                   help="forget QA pairs put in the prompt by the in_context attack (default 4)")
    p.add_argument("--recovery-min-removed", type=float, default=None,
                   help="no recovery fraction when unlearning lowered the answer probability by less (default 0.01)")
    _preset_option(p)
    _format_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_robustness)

    p = sub.add_parser("plot-tradeoff", help="plot a forget metric against model utility across result files")
    p.add_argument("results", nargs="+", help="tofu_results.json files, in checkpoint order (LABEL=PATH allowed)")
    p.add_argument("--x", default="forget_truth_ratio", help="summary key on the x axis (default forget_truth_ratio)")
    p.add_argument("--y", default="model_utility", help="summary key on the y axis (default model_utility)")
    p.add_argument("--out", default="tradeoff.png")
    p.set_defaults(func=run_plot_tradeoff)


def _common(p, out_default: str) -> None:
    p.add_argument("--out", default=out_default, help=f"output folder (default {out_default})")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-items", type=int, default=None, help="evaluate only the first N items of every set")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _preset_option(p)
    p.add_argument("--mia-attacks", default=None,
                   help="comma list of membership-inference attacks (default all: loss,zlib,min_k,min_k_plus_plus,"
                        "gradnorm,reference; leaving out gradnorm saves one backward per forget/holdout item)")


def _preset_option(p) -> None:
    from ..presets import ATTENTION_MASKS

    p.add_argument("--preset", choices=("hf-unlearn", "open-unlearning"), default=None,
                   help="evaluation conventions: open-unlearning = OpenUnlearning's (zlib on the decoded answer "
                        "tokens, Min-k%%++ variance floor 1e-6, privleak texts cut at 2048, extraction strength 1/n "
                        "when nothing is extracted, MUSE verbmem cut at EOS only and its prompt kept whole, the "
                        "attention mask input_ids != pad, its prompt format for the model family; see "
                        "hf_unlearn.presets); options given explicitly win")
    p.add_argument("--attention-mask", choices=ATTENTION_MASKS, default=None,
                   help="tokens (every token of a sequence; default) or not_pad (input_ids != pad id, OpenUnlearning: "
                        "a pad id inside a prompt, e.g. SmolLM2's end-of-turn, is masked)")


def _format_options(p) -> None:
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                   help="hf-unlearn (the format hf_unlearn trains with; default) or open-unlearning (OpenUnlearning's "
                        "per model family: system prompt, Llama-3 date string, Llama-2 [INST], 'Answer: ')")
    p.add_argument("--es-no-match", choices=ES_NO_MATCH, default=None,
                   help="extraction strength of an answer with no predicted suffix: zero (default) or one_over_n "
                        "(OpenUnlearning)")


def _tofu_options(p) -> None:
    _common(p, "eval_results")
    p.add_argument("--forget-split", default="forget10", choices=("forget01", "forget05", "forget10"))
    p.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)")
    p.add_argument("--forget-ids", default=None, help="TOFU ids to evaluate as the forget set: 3600-3639,3700 or a file")
    p.add_argument("--retain-ids", default=None, help="TOFU ids of the retain set (same forms)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--chat-template", choices=("auto", "yes", "no"), default="auto",
                   help="prompt with the tokenizer's chat template (auto: when it has one)")
    _format_options(p)


def _muse_options(p) -> None:
    _common(p, "eval_results")
    p.add_argument("--muse", default=None, help="local MUSE-News folder (default: $HF_UNLEARN_DATA_DIR/muse_news)")
    p.add_argument("--max-length", type=int, default=None, help="tokens of each privleak text scored (default 2048)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="tokens of each verbmem prompt kept: the start token and the last ones (default 1024); 0 = "
                        "the whole prompt (OpenUnlearning)")
    p.add_argument("--verbmem-max-new-tokens", type=int, default=128)
    p.add_argument("--verbmem-stop", choices=VERBMEM_STOPS, default=None,
                   help="cut each verbmem generation at the ground truth's length (ground_truth; default) or only at "
                        "EOS (eos, OpenUnlearning)")
    p.add_argument("--knowmem-max-new-tokens", type=int, default=32)
    p.add_argument("--knowmem-examples", default=None,
                   help="few-shot knowmem: 'muse' (MUSE's forget_qa_icl/retain_qa_icl) or a JSON file of "
                        "[{question, answer}] (or {forget: [...], retain: [...]}); default zero-shot")


def parse_ids(spec: str | None) -> list[int] | None:
    """``3600-3639,3700`` (inclusive ranges) or a file of ids (JSON list, or whitespace/comma separated)."""
    import json

    from ..errors import UnlearnError

    if spec is None:
        return None
    path = Path(spec)
    if path.is_file():
        text = path.read_text(encoding="utf-8").strip()
        try:
            values = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
            return [int(v) for v in values]
        except (ValueError, TypeError):
            raise UnlearnError(f"{path} must hold integer TOFU ids (a JSON list or one per line)") from None
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                ids.extend(range(int(lo), int(hi) + 1))
            elif part:
                ids.append(int(part))
        except ValueError:
            raise UnlearnError(f"cannot read ids {spec!r}: use 3600-3639,3700 or a file of ids") from None
    if not ids:
        raise UnlearnError(f"no ids in {spec!r}")
    return ids


# the options a preset sets, per benchmark; their parser default is None, so a value given explicitly (even one equal
# to the documented default) is told from one not given, and wins
PRESET_OPTIONS = {"tofu": ("max_length", "es_no_match", "prompt_format", "attention_mask"),
                  "muse_news": ("max_length", "verbmem_stop", "attention_mask", "max_prompt_tokens"),
                  "robustness": ("max_length", "es_no_match", "prompt_format", "attention_mask")}


def _preset(args, benchmark: str) -> dict:
    """The preset's evaluation keywords with the options given explicitly on top."""
    from ..presets import evaluation_preset

    values = evaluation_preset(getattr(args, "preset", None), benchmark)
    for key in PRESET_OPTIONS[benchmark]:
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    return values


def _tofu_kwargs(args) -> dict:
    return dict(
        **_preset(args, "tofu"),
        forget_split=args.forget_split,
        tofu_path=args.tofu,
        forget_ids=parse_ids(args.forget_ids),
        retain_ids=parse_ids(args.retain_ids),
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_items=args.max_items,
        use_chat_template={"auto": None, "yes": True, "no": False}[args.chat_template],
        mia_attacks=_attacks(args),
        progress=not args.quiet,
    )


def _attacks(args) -> list[str] | None:
    from ..eval.metrics import check_mia_attacks

    if args.mia_attacks is None:
        return None
    return list(check_mia_attacks([a.strip() for a in args.mia_attacks.split(",") if a.strip()]))  # before loading


def _knowmem_examples(spec: str | None):
    import json

    from ..errors import UnlearnError

    if spec is None or spec == "muse":
        return spec
    path = Path(spec)
    if not path.is_file():
        raise UnlearnError(f"--knowmem-examples: {spec} is neither 'muse' nor a JSON file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UnlearnError(f"--knowmem-examples: {path} is not JSON ({e.msg})") from None


def _load(name: str):
    from ..models import load_model, load_tokenizer

    return load_model(name), load_tokenizer(name)


def _write(result, out: Path, stem: str) -> None:
    from ..utils import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    result.to_json(out / f"{stem}.json")
    markdown = result.to_markdown()
    atomic_write_text(out / f"{stem.replace('results', 'summary')}.md", markdown)
    print(markdown)
    print(f"wrote {out / f'{stem}.json'}", file=sys.stderr)


def _write_tofu(result, out: Path, reference) -> None:
    import importlib.util

    _write(result, out, "tofu_results")
    if importlib.util.find_spec("matplotlib") is None:  # the numbers are written; the picture is optional
        print("matplotlib is not installed; skipped truth_ratio.png", file=sys.stderr)
        return
    from ..eval.plots import plot_truth_ratio_histogram

    print(f"wrote {plot_truth_ratio_histogram(result, reference, out / 'truth_ratio.png')}", file=sys.stderr)


def run_tofu(args) -> int:
    from ..eval.tofu import evaluate_tofu

    kwargs = _tofu_kwargs(args)
    model, tok = _load(args.model)
    result = evaluate_tofu(model, tok, reference=args.reference, **kwargs)
    _write_tofu(result, Path(args.out), args.reference)
    return 0


def run_tofu_reference(args) -> int:
    from ..eval.reference import ReferenceRecipe, train_retain_reference
    from ..eval.tofu import evaluate_tofu

    kwargs = _tofu_kwargs(args)
    out = Path(args.out)
    model, tok = _load(args.base)
    recipe = ReferenceRecipe(epochs=args.epochs, learning_rate=args.lr, batch_size=args.train_batch_size,
                             gradient_accumulation_steps=args.grad_accum, max_train_rows=args.max_train_rows,
                             seed=args.seed)
    train_retain_reference(model, tok, forget_split=args.forget_split, output_dir=out / "model", tofu_path=args.tofu,
                           recipe=recipe, use_chat_template=kwargs["use_chat_template"],
                           prompt_format=kwargs.get("prompt_format"),
                           attention_mask=kwargs.get("attention_mask", "tokens"),
                           train_ids=parse_ids(args.train_ids), forget_ids=kwargs["forget_ids"], progress=not args.quiet)
    result = evaluate_tofu(model, tok, **kwargs)
    result.meta["reference_recipe"] = vars(recipe)
    _write_tofu(result, out, None)
    return 0


def run_muse(args) -> int:
    from ..eval.muse import evaluate_muse_news

    attacks, examples = _attacks(args), _knowmem_examples(args.knowmem_examples)
    model, tok = _load(args.model)
    conventions = _preset(args, "muse_news")
    if conventions.get("max_prompt_tokens") == 0:  # --max-prompt-tokens 0: the whole prompt
        conventions["max_prompt_tokens"] = None
    result = evaluate_muse_news(
        model, tok, muse_path=args.muse, reference=args.reference, batch_size=args.batch_size,
        max_items=args.max_items, **conventions, verbmem_max_new_tokens=args.verbmem_max_new_tokens,
        knowmem_max_new_tokens=args.knowmem_max_new_tokens, knowmem_examples=examples,
        mia_attacks=attacks, progress=not args.quiet,
    )
    _write(result, Path(args.out), "muse_results")
    return 0


def run_quantized(args) -> int:
    from ..eval.quantized import evaluate_quantized

    attacks = _attacks(args)
    model, tok = _load(args.model)
    if args.benchmark == "tofu":
        kwargs = _tofu_kwargs(args)
    else:
        kwargs = dict(muse_path=args.muse, batch_size=args.batch_size, max_items=args.max_items,
                      mia_attacks=attacks, progress=not args.quiet, **_preset(args, "muse_news"))
    comparison = evaluate_quantized(model, tok, bits=args.bits, quant_type=args.quant_type,
                                    benchmark=args.benchmark.replace("-", "_"), reference=args.reference, **kwargs)
    _write(comparison, Path(args.out), "quantized_results")
    return 0


def _int_list(spec: str, what: str) -> list[int]:
    from ..errors import UnlearnError

    if spec.strip().lower() == "none":
        return []
    try:
        return [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise UnlearnError(f"{what} must be a comma list of integers, got {spec!r}") from None


def run_robustness(args) -> int:
    import importlib.util

    from ..errors import UnlearnError
    from ..eval.robustness import ATTACKS, evaluate_robustness, tofu_robustness_rows
    from ..models import load_model

    steps, bits = _int_list(args.steps, "--steps"), _int_list(args.bits, "--bits")
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise UnlearnError(f"unknown attack {unknown[0]!r}; choose from {', '.join(ATTACKS)}")
    if not bits:
        attacks = [a for a in attacks if a != "quantization"]
    conventions = {"max_length": 512, **_preset(args, "robustness")}
    if args.recovery_min_removed is not None:
        conventions["recovery_min_removed"] = args.recovery_min_removed
    sets = tofu_robustness_rows(args.forget_split, args.tofu, parse_ids(args.forget_ids), parse_ids(args.retain_ids),
                                max_items=args.max_items)  # data problems fail before models load
    relearn_rows = {"half": None, "paraphrased": "paraphrased",
                    "kept-same-authors": sets["kept_same_authors"]}[args.relearn_on]
    if args.relearn_on == "kept-same-authors" and not relearn_rows:
        raise UnlearnError("--relearn-on kept-same-authors: the forgotten authors have no kept questions (every question "
                           "of theirs is forgotten); name fewer --forget-ids or use --relearn-on half/paraphrased")
    model, tok = _load(args.model)
    original = load_model(args.original) if args.original else None
    reference = load_model(args.reference) if args.reference else None
    result = evaluate_robustness(
        model, tok, sets["forget"], original=original, reference=reference, reference_name=args.reference_name,
        holdout_rows=sets["holdout"], probe_rows=sets["retain"], relearn_ids=parse_ids(args.relearn_ids), steps=steps or [0], learning_rate=args.lr,
        relearn_batch_size=args.relearn_batch_size, bits=bits, attacks=attacks, seed=args.seed,
        use_chat_template={"auto": None, "yes": True, "no": False}[args.chat_template], batch_size=args.batch_size,
        relearn_rows=relearn_rows, in_context_rows=args.in_context_rows, progress=not args.quiet, **conventions)
    out = Path(args.out)
    _write(result, out, "robustness_results")
    if "relearning" not in attacks:
        return 0
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed; skipped recovery.png", file=sys.stderr)
        return 0
    from ..eval.plots import plot_recovery_curves

    print(f"wrote {plot_recovery_curves(result, out / 'recovery.png')}", file=sys.stderr)
    return 0


def run_plot_tradeoff(args) -> int:
    from ..eval.plots import plot_tradeoff

    results = {}
    for spec in args.results:
        label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).parent.name or spec, "", spec)
        results[label] = path
    print(f"wrote {plot_tradeoff(results, args.out, x=args.x, y=args.y)}", file=sys.stderr)
    return 0
