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
