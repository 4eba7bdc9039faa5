"""Storage and replay cost per checkpoint retention policy, computed from the retention rule itself.

The rule is a pure function (``hf_unlearn.trace.retention``), so this needs no training run: for each run length T it
counts the checkpoints a finished run keeps under each policy (every step; ``even``: every ceil(T/10) steps;
``geometric``, the default: every T//32 steps thinned to the bound), and for one run length it draws the steps a
deletion replays against its first affected step. Bytes kept are the count times one checkpoint's size (the measured
sizes: docs/benchmarks/exact-deletion.md, "Checkpoints: bytes kept and replay over the minimum").

    PYTHONPATH=. python benchmarks/plot_retention.py --out benchmarks/checkpoint_storage.png
"""

from __future__ import annotations

import argparse

from hf_unlearn.trace.retention import default_every, dense_steps, final_keep, start_for


def kept(total: int, mode: str) -> list[int]:
    every = default_every(total, mode)
    return final_keep(total, dense_steps(total, every, mode), every, mode=mode)


def curves(lengths, total: int) -> dict:
    counts = {"every step": [t + 1 for t in lengths],
              "even (ceil(T/10))": [len(kept(t, "even")) for t in lengths],
              "geometric (T//32, the default)": [len(kept(t, "geometric")) for t in lengths]}
    steps = list(range(total))
    replay = {"minimum T - s": [total - s for s in steps]}
    for label, mode in (("even", "even"), ("geometric", "geometric")):
        ks = kept(total, mode)
        replay[f"{label} ({len(ks)} kept)"] = [total - start_for(s, ks) for s in steps]
    replay["bound 2 (T - s) + K"] = [2 * (total - s) + default_every(total, "geometric") for s in steps]
    return {"lengths": list(lengths), "counts": counts, "steps": steps, "replay": replay}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="checkpoint_storage.png", help="the plot file (default %(default)s)")
    parser.add_argument("--total", type=int, default=256, help="run length of the replay panel (default %(default)s)")
    args = parser.parse_args(argv)
    lengths = sorted({int(round(10 ** (e / 8))) for e in range(12, 41)})  # 32 .. 100,000 steps
    data = curves(lengths, args.total)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, ys in data["counts"].items():
        a.plot(data["lengths"], ys, label=label)
    a.set(xscale="log", yscale="log", xlabel="optimizer steps in the run (T)",
          ylabel="checkpoints kept (x one checkpoint's bytes)", title="Storage per retention policy")
    a.legend()
    for label, ys in data["replay"].items():
        b.plot(data["steps"], ys, label=label, linestyle=":" if label.startswith(("minimum", "bound")) else "-")
    b.set(xlabel="first affected step s of the deletion", ylabel="steps replayed",
          title=f"Replay cost, T = {args.total}")
    b.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    for label, ys in data["counts"].items():
        print(f"{label}: T={data['lengths'][-1]:,} keeps {ys[-1]:,} checkpoints")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
