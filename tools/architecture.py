"""The map of hf_unlearn drawn from its code: ``make architecture`` (``python tools/architecture.py``).

Reads the import graph with grimp (imports inside functions included), folds it into rooms (the modules and packages
directly under ``hf_unlearn/``) and writes two files under docs/architecture/:

- ``rooms.txt``: the floors, as the ``rooms`` contract of ``.importlinter`` lists them, and every arrow between two
  rooms. tests/test_architecture.py regenerates it and compares it with the committed one, so the picture cannot
  go stale: a new arrow between rooms fails the suite until this script is run again.
- ``rooms.svg``: the same, drawn (matplotlib): one row per floor, top floor first; an arrow that points down is
  grey, an arrow that points up or sideways (which the contract refuses) is red.

Offline and deterministic: no date in the SVG, a fixed id salt, the rooms in a fixed order.
"""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_unlearn"
CONFIG = ROOT / ".importlinter"
OUT = ROOT / "docs" / "architecture"


def floors(config: Path = CONFIG, contract: str = "rooms") -> list[list[str]]:
    """The floors of a layers contract of ``config``, top floor first, each a list of its rooms."""
    parser = configparser.ConfigParser()
    parser.read(config, encoding="utf-8")
    layers = parser[f"importlinter:contract:{contract}"]["layers"]
    return [[r.strip().strip("()") for r in re.split(r"[|:]", line) if r.strip()] for line in layers.splitlines()
            if line.strip()]


def room_of(module: str) -> str:
    """``hf_unlearn.trace.run`` -> ``trace``; the package root is ``hf_unlearn``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def build_graph():
    import grimp

    return grimp.build_graph(PACKAGE, cache_dir=None)


def present_floors(graph, floor_list: list[list[str]]) -> list[list[str]]:
    """The floors without the rooms the package does not hold (yet): a contract may name one as optional."""
    rooms = {room_of(m) for m in graph.modules}
    return [[r for r in floor if r in rooms] for floor in floor_list]


def room_arrows(graph) -> dict[tuple[str, str], int]:
    """``{(room, room it imports): number of importing modules}`` over the whole import graph."""
    arrows: dict[tuple[str, str], set[str]] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = room_of(module), room_of(imported)
            if a != b:
                arrows.setdefault((a, b), set()).add(module)
    return {k: len(v) for k, v in sorted(arrows.items())}


def floor_index(floor_list: list[list[str]]) -> dict[str, int]:
    """Each room's floor, counted from the ground (0); the package root stands above the top floor."""
    index = {room: len(floor_list) - 1 - i for i, floor in enumerate(floor_list) for room in floor}
    index[PACKAGE] = len(floor_list)
    return index


def listing(floor_list: list[list[str]], arrows: dict[tuple[str, str], int]) -> str:
    """rooms.txt: the floors and the arrows, one a line (no counts: the file changes only when an arrow does)."""
    level = floor_index(floor_list)
    lines = ["# hf_unlearn's rooms and the arrows between them, from the import graph (imports inside functions",
             "# included). Written by tools/architecture.py (make architecture); tests/test_architecture.py checks",
             "# that it is fresh. An arrow marked UP points at a room on the same or a higher floor.", "", "floors:"]
    lines += [f"  {len(floor_list) - i:2d}  {' | '.join(floor)}" for i, floor in enumerate(floor_list)]
    lines += ["", "arrows:"]
    for a, b in arrows:
        up = level.get(b, -1) >= level.get(a, -1) and a != PACKAGE
        lines.append(f"  {a} -> {b}{'  UP' if up else ''}")
    return "\n".join(lines) + "\n"


def draw(floor_list: list[list[str]], arrows: dict[tuple[str, str], int], path: Path) -> None:
    """rooms.svg: one row of boxes per floor, the arrows between them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    matplotlib.rcParams["svg.hashsalt"] = "hf_unlearn-architecture"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: smaller, searchable, no glyph paths
    level = floor_index(floor_list)
    rows = [[PACKAGE]] + floor_list
    width = 2.0 * max(len(r) for r in rows)  # 2 units a room: a box is 1.5 wide
    pos = {}
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        for j, room in enumerate(row):
            pos[room] = ((j + 0.5) * width / len(row), y * 1.6)
    fig, ax = plt.subplots(figsize=(1.3 * width, 0.75 * len(rows)))
    box_w, box_h = 1.5, 0.6
    for a, b in arrows:
        if a not in pos or b not in pos:
            continue
        up = level[b] >= level[a] and a != PACKAGE
        (xa, ya), (xb, yb) = pos[a], pos[b]
        ax.add_patch(FancyArrowPatch((xa, ya - box_h / 2 if yb < ya else ya + box_h / 2),
                                     (xb, yb + box_h / 2 if yb < ya else yb - box_h / 2),
                                     arrowstyle="-|>", mutation_scale=8, lw=1.6 if up else 0.5,
                                     color="#c0392b" if up else "#9aa0a6", alpha=1.0 if up else 0.45,
                                     connectionstyle="arc3,rad=0.08", zorder=1 if not up else 3))
    for room, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h, boxstyle="round,pad=0.05",
                                    facecolor="#fff8e1" if room == PACKAGE else "#e8f0fe", edgecolor="#3c4043",
                                    lw=0.8, zorder=2))
        ax.text(x, y, room, ha="center", va="center", fontsize=9, family="monospace", zorder=4)
    for i, _ in enumerate(floor_list):
        ax.text(-0.4, (len(floor_list) - 1 - i) * 1.6, str(len(floor_list) - i), ha="right", va="center",
                fontsize=8, color="#5f6368")
    ax.set_xlim(-0.8, width + 0.2)
    ax.set_ylim(-0.8, (len(rows) - 1) * 1.6 + 0.8)
    ax.axis("off")
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    graph = build_graph()
    floor_list, arrows = present_floors(graph, floors()), room_arrows(graph)
    (OUT / "rooms.txt").write_text(listing(floor_list, arrows), encoding="utf-8")
    draw(floor_list, arrows, OUT / "rooms.svg")
    print(f"wrote {OUT.relative_to(ROOT)}/rooms.txt and rooms.svg ({len(arrows)} arrows between rooms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
