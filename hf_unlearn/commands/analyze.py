"""`hf-unlearn analyze ...`: commands of this group register here."""

from . import add_subcommands


def register(parser) -> None:
    sub = add_subcommands(parser)
    p = sub.add_parser(
        "forgetting",
        help="fine-tune on tasks, forget each with random labels, measure whether forgetting generalises",
        description="Fine-tune MODEL on the tasks' training rows, then for each task fine-tune on random labels and "
        "measure forget gap/ratio on trained and unseen rows, the cross-task matrix, predictors, learned-vs-forgotten "
        "order and per-layer linear probes. Writes report.md, results.json and plots to --out.",
    )
    p.add_argument("model", help="Hub id, local folder or .gguf file of a causal LM")
    p.add_argument("--tasks", default="rte,cola,piqa,sciq", help="comma-separated task names (default: %(default)s)")
    p.add_argument("--out", default="forgetting_report", help="output folder (default: %(default)s)")
    p.add_argument("--data", default=None, help="folder of task .jsonl files (default: $HF_UNLEARN_DATA_DIR/tasks)")
    p.add_argument("--n-train", type=int, default=48, help="training rows per task (default: %(default)s)")
    p.add_argument("--n-test", type=int, default=48, help="unseen test rows per task (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=2.0, help="fine-tuning epochs (default: %(default)s)")
    p.add_argument("--forget-epochs", type=float, default=2.0, help="random-label epochs (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-5, help="fine-tuning learning rate (default: %(default)s)")
    p.add_argument("--forget-lr", type=float, default=None, help="random-label learning rate (default: --lr)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per prompt + choice (default: %(default)s)")
    p.add_argument("--label-mode", choices=["uniform", "flipped"], default="uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-last-layers", type=int, default=None,
                   help="train only the top N transformer blocks (cheaper on a CPU; default: all parameters)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is fastest on a machine shared with other jobs)")
    p.add_argument("--no-cross-task", action="store_true", help="skip the cross-task matrix (faster)")
    p.add_argument("--no-probes", action="store_true", help="skip the linear probes")
    p.set_defaults(func=run_forgetting)
    _register_cud(sub)


def run_forgetting(args) -> int:
    from ..analysis.forgetting_experiment import ForgettingSetup, run_forgetting_experiment
    from ..analysis.report import write_report
    from ..errors import UnlearnError
    from ..models import load_model, load_tokenizer

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UnlearnError("--tasks is empty; give comma-separated task names such as rte,cola")
    setup = ForgettingSetup(
        tasks=tasks, n_train=args.n_train, n_test=args.n_test, epochs=args.epochs, forget_epochs=args.forget_epochs,
        learning_rate=args.lr, forget_learning_rate=args.forget_lr if args.forget_lr is not None else args.lr,
        batch_size=args.batch_size, max_length=args.max_length, label_mode=args.label_mode, seed=args.seed,
        train_last_layers=args.train_last_layers, cross_task=not args.no_cross_task, probes=not args.no_probes, data_path=args.data,
    )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    result = run_forgetting_experiment(model, tokenizer, setup, args.out)
    report = write_report(result, args.out)
    print(f"report written to {report}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# circuits and CUD (difficulty before unlearning)


def _add_data_args(p) -> None:
    p.add_argument("--forget-split", default="forget10", help="TOFU forget config (default: %(default)s)")
    p.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)")
    p.add_argument("--ids", default=None, help="only these samples: an id file (typed .jsonl/.json, or one id a line)")
    p.add_argument("--max-samples", type=int, default=None, help="only the first N samples of the split")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a shared machine)")


def _add_circuit_args(p) -> None:
    p.add_argument("--top-edges", type=int, default=75, help="edges per circuit (default: %(default)s, as the paper)")
    p.add_argument("--ig-steps", type=int, default=5, help="integrated-gradient steps m (default: %(default)s)")
    p.add_argument("--baseline", choices=["corrupted", "zero"], default="corrupted",
                   help="corrupted input (question tokens shuffled; the paper's setting) or zero activations")
    p.add_argument("--selection", choices=["greedy", "top"], default="greedy",
                   help="greedy from the logits (the paper) or the top edges anywhere (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per batch (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per QA pair (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the question shuffle (default: %(default)s)")


def _register_cud(sub) -> None:
    p = sub.add_parser("circuit", help="EAP-IG circuits of forget samples (before unlearning)",
                       description="Score every edge of MODEL's graph (input, attention heads with q/k/v inputs, MLPs, "
                       "logits) for each forget sample with EAP-IG, cut each sample's circuit and write scores, "
                       "circuits and circuit statistics to --out.")
    p.add_argument("model", help="Hub id, local folder or .gguf file of a causal LM")
    _add_data_args(p)
    _add_circuit_args(p)
    p.add_argument("--out", default="circuits", help="output folder (default: %(default)s)")
    p.set_defaults(func=run_circuit)

    p = sub.add_parser("anchors", help="easy/hard anchor samples from real unlearning runs",
                       description="Unlearn the forget split with each method (from MODEL each time), record every "
                       "sample's answer loss afterwards and pick easy anchors (high loss under most methods) and "
                       "hard anchors (low loss under most methods).")
    p.add_argument("model", help="Hub id, local folder or .gguf file (the model before unlearning)")
    _add_data_args(p)
    p.add_argument("--retain-split", default=None, help="TOFU retain config (default: the complement, e.g. retain90)")
    p.add_argument("--max-retain-rows", type=int, default=None, help="use only the first N retain rows")
    p.add_argument("--methods", default="grad_diff,npo",
                   help="comma-separated registered methods (see `hf-unlearn unlearn --help`), each optionally "
                        "METHOD@LR with its own learning rate, e.g. grad_diff@2e-5,npo@5e-5 (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=5.0, help="epochs over the forget set per run (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=-1, help="step budget per run (default: --epochs)")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per step (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per QA pair (default: %(default)s)")
    p.add_argument("--fraction", type=float, default=0.2,
                   help="share of the samples taken as easy anchors, and as hard anchors (default: %(default)s)")
    p.add_argument("--criterion", choices=["loss", "increase"], default="loss",
                   help="rank by post-unlearning loss or by its increase (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="anchors", help="output folder (default: %(default)s)")
    p.set_defaults(func=run_anchors)

    p = sub.add_parser("cud", help="circuit-guided unlearning difficulty of each forget sample",
                       description="CUD = (1-s_E)/((1-s_E)+(1-s_H)) with s_E, s_H the similarities of a sample's "
                       "circuit to the easy and hard anchor circuits. Computes the circuits with MODEL, or reuses "
                       "--circuits; refuses anchors built with another model or tokenizer.")
    p.add_argument("model", nargs="?", default=None,
                   help="the model before unlearning (optional with --circuits; then its fingerprint is checked)")
    _add_data_args(p)
    _add_circuit_args(p)
    p.add_argument("--anchors", required=True, help="folder written by `hf-unlearn analyze anchors`")
    p.add_argument("--circuits", default=None, help="folder written by `hf-unlearn analyze circuit` (skip scoring)")
    p.add_argument("--similarity", choices=["cosine", "jaccard", "hamming"], default="cosine",
                   help="how two circuits are compared (default cosine)")
    p.add_argument("--aggregate", choices=["circuit", "mean"], default="circuit",
                   help="one circuit per anchor group (default) or the mean similarity to each anchor")
    p.add_argument("--weighted", action="store_true", help="cosine of |score|-weighted circuit vectors")
    p.add_argument("--out", default="cud.jsonl", help="CUD rows, JSON Lines (default: %(default)s)")
    p.add_argument("--plot", default=None, help="CUD vs post-unlearning loss plot (default: OUT with .png)")
    p.set_defaults(func=run_cud)

    p = sub.add_parser("stratify", help="easy / hard / random forget sets from CUD scores",
                       description="Write OUT/easy.jsonl (lowest CUD), hard.jsonl (highest) and random.jsonl (a seeded "
                       "draw), typed id files usable as forget sets, plus manifest.json and circuit_stats.png.")
    p.add_argument("cud", help="CUD rows written by `hf-unlearn analyze cud`")
    p.add_argument("--size", type=int, required=True, help="samples per set")
    p.add_argument("--seed", type=int, default=0, help="seed of the random set (default: %(default)s)")
    p.add_argument("--include-anchors", action="store_true",
                   help="let anchor samples into the sets (by default they are left out: they defined the score)")
    p.add_argument("--out", default="sets", help="output folder (default: %(default)s)")
    p.set_defaults(func=run_stratify)


def _forget_rows(args):
    from ..data import load_tofu
    from ..data.ids import read_ids, select_ids

    rows = load_tofu(args.forget_split, args.tofu)
    if args.ids:
        rows = select_ids(rows, read_ids(args.ids), f"TOFU {args.forget_split}", args.ids)
    if args.max_samples:
        rows = rows.select(range(min(args.max_samples, len(rows))))
    return rows


def _circuit_config(args):
    from ..analysis.circuits import CircuitConfig

    return CircuitConfig(ig_steps=args.ig_steps, baseline=args.baseline, top_edges=args.top_edges,
                         selection=args.selection, batch_size=args.batch_size, max_length=args.max_length,
                         seed=args.seed)


def _threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _load(model_path):
    from ..models import load_model, load_tokenizer

    return load_model(model_path), load_tokenizer(model_path)


def run_circuit(args) -> int:
    from ..analysis.circuits import compute_circuits

    config = _circuit_config(args)
    rows = _forget_rows(args)
    _threads(args)
    model, tokenizer = _load(args.model)
    circuits = compute_circuits(model, tokenizer, rows, config)
    circuits.save(args.out)
    _print_circuit_summary(circuits)
    print(f"circuits written to {args.out}")
    return 0


def _print_circuit_summary(circuits) -> None:
    g = circuits.graph
    stats = circuits.statistics()
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in ("mean_edge_depth", "longest_path", "mlp_share",
                                                               "late_share")}
    print(f"{len(circuits)} samples, {g.model_type} graph: {g.n_layers} layers x {g.n_heads} heads "
          f"({g.n_kv_heads} kv), {g.num_edges} edges; {circuits.config.passes_per_sample} passes per sample, "
          f"{circuits.seconds / len(circuits):.2f} s per sample")
    print("mean circuit statistics: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()))


def parse_methods(spec: str) -> tuple[list[str], dict[str, dict]]:
    """``"grad_diff@2e-5,npo"`` -> (["grad_diff", "npo"], {"grad_diff": {"learning_rate": 2e-5}})."""
    from ..errors import UnlearnError

    methods, options = [], {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, lr = item.partition("@")
        if name in methods:
            raise UnlearnError(f"--methods names {name!r} twice; each method runs once")
        methods.append(name)
        if lr:
            try:
                options[name] = {"learning_rate": float(lr)}
            except ValueError:
                raise UnlearnError(f"--methods: {item!r} is not METHOD@LEARNING_RATE") from None
    return methods, options


def run_anchors(args) -> int:
    from ..analysis.cud import AnchorConfig, build_anchors
    from ..data import load_tofu
    from .unlearn import retain_split_for

    methods, options = parse_methods(args.methods)
    config = AnchorConfig(methods=methods, epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
                          batch_size=args.batch_size, max_length=args.max_length, fraction=args.fraction,
                          criterion=args.criterion, seed=args.seed, method_options=options)
    forget = _forget_rows(args)
    retain = load_tofu(args.retain_split or retain_split_for(args.forget_split), args.tofu)
    if args.max_retain_rows:
        retain = retain.select(range(min(args.max_retain_rows, len(retain))))
    _threads(args)
    model, tokenizer = _load(args.model)
    anchors = build_anchors(model, tokenizer, forget, retain, config)
    anchors.save(args.out)
    for method, run in anchors.runs.items():
        print(f"{method}: {run['steps']} steps, {run['seconds']:.1f} s, answer loss "
              f"{run['mean_loss_before']:.3f} -> {run['mean_loss_after']:.3f}")
    print(f"{len(anchors.easy)} easy and {len(anchors.hard)} hard anchors of {len(anchors.ids)} samples "
          f"written to {args.out}")
    return 0


def run_cud(args) -> int:
    from pathlib import Path

    from ..analysis.circuits import CircuitSet, compute_circuits, model_fingerprint
    from ..analysis.cud import AnchorSet, check_same_model, compute_cud, cud_correlation, plot_cud_vs_loss
    from ..errors import UnlearnError

    if args.model is None and args.circuits is None:
        raise UnlearnError("give MODEL (to compute the circuits) or --circuits (computed ones)")
    anchors = AnchorSet.load(args.anchors)
    _threads(args)
    if args.circuits:
        circuits = CircuitSet.load(args.circuits)
        check_same_model(circuits, anchors)  # before loading any model
        if args.model is not None:
            model, _ = _load(args.model)
            if model_fingerprint(model) != circuits.model_fingerprint:
                raise UnlearnError(f"{args.circuits} was computed with another model than {args.model}")
    else:
        config = _circuit_config(args)
        rows = _forget_rows(args)
        model, tokenizer = _load(args.model)
        from ..eval.runner import tokenizer_fingerprint

        if tokenizer_fingerprint(tokenizer) != anchors.tokenizer_fingerprint:
            raise UnlearnError(f"the anchors were built with another tokenizer than {args.model}'s")
        if model_fingerprint(model) != anchors.model_fingerprint:
            raise UnlearnError(f"the anchors were built with another model than {args.model}; build anchors from it")
        circuits = compute_circuits(model, tokenizer, rows, config)
    result = compute_cud(circuits, anchors, similarity=args.similarity, aggregate=args.aggregate,
                         weighted=args.weighted)
    out = result.to_jsonl(args.out)
    losses = anchors.mean_post_loss()
    corr = cud_correlation(result, losses)
    plot = plot_cud_vs_loss(result, losses, args.plot or Path(out).with_suffix(".png"))
    scored = [r["cud"] for r in result.rows if r["cud"] is not None]
    print(f"CUD of {len(scored)} samples ({args.similarity}, {args.aggregate}): mean {sum(scored) / len(scored):.3f}, "
          f"min {min(scored):.3f}, max {max(scored):.3f}")
    print(f"Spearman(CUD, answer loss after the anchor runs) on {corr['n']} non-anchor samples: "
          f"{corr['spearman']:.3f} (p = {corr['p_value']:.3g}; negative = harder samples keep more)")
    print(f"written to {out} (+ {plot})")
    return 0


def run_stratify(args) -> int:
    from pathlib import Path

    from ..analysis.cud import CUDResult, plot_circuit_statistics, stratify, write_sets

    result = CUDResult.from_jsonl(args.cud)
    sets = stratify(result, args.size, seed=args.seed, include_anchors=args.include_anchors)
    out = write_sets(args.out, sets, result, {"size": args.size, "seed": args.seed,
                                              "include_anchors": args.include_anchors, "source": str(args.cud)})
    rows = result.by_id()
    groups = {name: [rows[i].get("stats") for i in ids] for name, ids in sets.items()}
    plot = plot_circuit_statistics(groups, Path(out) / "circuit_stats.png")
    for name, ids in sets.items():
        cuds = [rows[i]["cud"] for i in ids]
        print(f"{name}: {len(ids)} samples, CUD {min(cuds):.3f}..{max(cuds):.3f} -> {Path(out) / (name + '.jsonl')}")
    print(f"manifest and {plot.name} in {out}")
    return 0
