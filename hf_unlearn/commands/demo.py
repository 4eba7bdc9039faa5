"""`hf-unlearn demo`: the whole pipeline offline, on a small model built locally and TOFU rows shipped in the package."""

from __future__ import annotations


def register(parser) -> None:
    parser.description = ("Record a fine-tune, honour a deletion request exactly (verified bit for bit against the "
                          "oracle), unlearn another author with MASC (evaluated before and after), publish both to a "
                          "local Hub server and verify them. Offline, no data folder needed; a few minutes on 2 cores.")
    parser.add_argument("--model", default=None, help="Hub id, local folder or .gguf file (default: tiny local Llama)")
    parser.add_argument("--tofu", default=None,
                        help="local TOFU folder (default: the 10-author TOFU subset shipped with the package)")
    parser.add_argument("--out", default="demo_output",
                        help="output folder (default: demo_output; an earlier demo output there is replaced)")
    parser.add_argument("--authors", type=int, default=8, help="TOFU authors to fine-tune on (20 QA pairs each; "
                                                               "default 8)")
    parser.add_argument("--forget-authors", type=int, default=1, help="authors in the deletion request (default 1)")
    parser.add_argument("--epochs", type=float, default=25.0, help="fine-tuning epochs (default 25)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 3e-3 tiny model, 2e-5 otherwise)")
    parser.add_argument("--masc-lr", type=float, default=None,
                        help="MASC learning rate (default: 1e-3 tiny model, 1e-5 otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the naive filter/repack counterfactuals of the deletion stage (saves two runs)")
    parser.add_argument("--no-masc", action="store_true", help="skip the MASC stage")
    parser.add_argument("--no-publish", action="store_true", help="skip the local Hub push and verification")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..demo import DemoConfig, run_demo

    stats = run_demo(
        DemoConfig(
            model=args.model,
            tofu_path=args.tofu,
            output_dir=args.out,
            authors=args.authors,
            forget_authors=args.forget_authors,
            epochs=args.epochs,
            learning_rate=args.lr,
            masc_learning_rate=args.masc_lr,
            seed=args.seed,
            trace_baselines=not args.no_baselines,
            masc=not args.no_masc,
            publish=not args.no_publish,
            progress=not args.no_progress,
        )
    )
    ok = stats.get("deletion", {}).get("identical") is not False and all(
        part.get("receipt", {}).get("ok", True) for part in (stats.get("deletion", {}), stats.get("masc", {})))
    return 0 if ok else 1
