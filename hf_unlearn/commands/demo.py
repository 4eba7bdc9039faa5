"""`hf-unlearn demo`: the end-to-end pipeline, offline, on a small model built locally by default."""

from __future__ import annotations


def register(parser) -> None:
    parser.add_argument("--model", default=None, help="Hub id, local folder or .gguf file (default: tiny local Llama)")
    parser.add_argument("--tofu", default=None, help="local TOFU folder (default: $HF_UNLEARN_DATA_DIR/tofu, else the Hub)")
    parser.add_argument("--out", default="demo_output", help="output folder (default: demo_output)")
    parser.add_argument("--authors", type=int, default=8, help="TOFU authors to fine-tune on (20 QA pairs each)")
    parser.add_argument("--forget-authors", type=int, default=1, help="authors in the deletion request")
    parser.add_argument("--epochs", type=float, default=25.0)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 3e-3 tiny model, 2e-5 otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the naive filter/repack counterfactuals of the deletion stage (saves two runs)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(
            model=args.model,
            tofu_path=args.tofu,
            output_dir=args.out,
            authors=args.authors,
            forget_authors=args.forget_authors,
            epochs=args.epochs,
            learning_rate=args.lr,
            seed=args.seed,
            trace_baselines=not args.no_baselines,
        )
    )
    return 0
