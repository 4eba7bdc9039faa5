"""Time a TOFU evaluation of SmolLM2-135M-Instruct and extrapolate to the full forget10 evaluation.

The full run scores 6,868 teacher-forced sequences (forget and retain: answer + paraphrase + 5 perturbed each, 400
items; real_authors 100 and world_facts 117: answer + 3 perturbed; 400 holdout answers) and generates 1,017 greedy
answers of up to 200 tokens. On a shared 2-core machine we time the first ``--max-items`` items of every set and
scale each phase by its own count (scoring per sequence, generation per prompt); ``--max-items 0`` runs it all.

    PYTHONPATH=. python benchmarks/bench_eval_tofu.py --max-items 16
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_UNLEARN_SHARED", ROOT.parent / "shared"))
FULL_SEQUENCES = 400 * 7 + 400 * 7 + 100 * 4 + 117 * 4 + 400
FULL_PROMPTS = 400 + 400 + 100 + 117


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--max-items", type=int, default=16, help="items per set (0 = the full forget10 evaluation)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()

    import torch

    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.models import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model), load_tokenizer(args.model)
    load_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    result = evaluate_tofu(model, tok, forget_split="forget10", tofu_path=SHARED / "data" / "tofu",
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           max_items=args.max_items or None, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = result.meta["timings"]
    per_seq = t["scoring_s"] / t["sequences_scored"]
    per_prompt = t["generation_s"] / t["prompts_generated"]
    est_scoring, est_generation = per_seq * FULL_SEQUENCES, per_prompt * FULL_PROMPTS
    print(f"torch threads: {torch.get_num_threads()}, model load: {load_s:.1f} s")
    print(f"measured: {t['sequences_scored']} sequences scored in {t['scoring_s']:.1f} s ({per_seq * 1e3:.0f} ms each), "
          f"{t['prompts_generated']} answers generated in {t['generation_s']:.1f} s ({per_prompt:.2f} s each); "
          f"evaluate_tofu wall {wall:.1f} s, process CPU {cpu:.1f} s (CPU/wall {cpu / wall:.2f}: how much of the "
          f"machine it got)")
    if args.max_items:
        print(f"extrapolated full forget10 evaluation: scoring {est_scoring / 60:.1f} min + generation "
              f"{est_generation / 60:.1f} min = {(est_scoring + est_generation) / 60:.1f} min "
              f"(scoring is {est_scoring / (est_scoring + est_generation):.0%} of it)")
    s = result.summary
    print(f"forget: probability {s['forget_probability']:.3f}, ROUGE-L {s['forget_rouge_l']:.3f}, truth ratio "
          f"{s['forget_truth_ratio']:.3f}; model utility {s['model_utility']:.3f}")


if __name__ == "__main__":
    main()
