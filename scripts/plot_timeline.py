#!/usr/bin/env python3
"""Draw timelines written by ``dt.trace`` (dtorch_mpi/timeline.py) as one PNG: one panel per
``--panel TITLE=FILE[,FILE...]`` (per-rank or merged files), a row per (rank, lane), a bar per
event, time in ms from the panel's first event. Needs matplotlib (not a project dependency:
``pip install --target DIR matplotlib`` and put DIR on PYTHONPATH).

  python scripts/plot_timeline.py --panel "replicate=t-replicate.rank0.json,t-replicate.rank1.json" \\
      --panel "fully_shard=..." -o docs/img/timeline.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any

COLOURS = {"all_reduce": "#e6822e", "all_gather": "#3c9a4c", "reduce_scatter": "#c23b3b", "all_to_all": "#8a5ac7",
           "broadcast": "#999999", "scatter": "#999999"}


def load(files: list[str]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in files:
        with open(path) as f:
            events.extend(json.load(f)["traceEvents"])
    return events


def lane_names(events: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def draw(ax: Any, title: str, events: list[dict[str, Any]]) -> None:
    xs = [e for e in events if e["ph"] == "X"]
    names = lane_names(events)
    t0 = min(e["ts"] for e in xs)
    rows = sorted({(e["pid"], e["tid"]) for e in xs})
    y = {row: i for i, row in enumerate(rows)}
    for e in xs:
        row = y[(e["pid"], e["tid"])]
        start, width = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05)
        if e["cat"] == "comm":
            colour, height = COLOURS.get(e["name"], "#555555"), 0.7
        elif e["name"] == "backward()":
            colour, height = "#c8d8ec", 0.9
        elif e["cat"] == "backward":
            colour, height = "#3f6fb5", 0.5
        else:  # a user span: darker the deeper it nests in others on its lane
            depth = sum(1 for o in xs if o is not e and o["cat"] == "user" and (o["pid"], o["tid"]) == (e["pid"], e["tid"])
                        and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"])
            colour, height = ("#dddddd", "#999999", "#666666")[min(depth, 2)], 0.7 - 0.15 * min(depth, 2)
        ax.broken_barh([(start, width)], (row - height / 2, height), facecolors=colour, edgecolors="none")
        if e["cat"] == "user" and width > 4 and e["name"] != "compute":
            ax.text(start + 0.5, row, e["name"], va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {names.get((p, t), t)}" for p, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--panel", action="append", required=True, help="TITLE=FILE[,FILE...]")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    panels = [(p.split("=", 1)[0], load(p.split("=", 1)[1].split(","))) for p in args.panel]
    heights = [len({(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"}) for _, ev in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.28 * sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], panels):
        draw(ax, title, events)
    axes[-1, 0].set_xlabel("ms from the step's start")
    legend = [mpatches.Patch(color=c, label=k) for k, c in list(COLOURS.items())[:3]]
    legend += [mpatches.Patch(color="#c8d8ec", label="backward()"), mpatches.Patch(color="#3f6fb5", label="backward node"),
               mpatches.Patch(color="#dddddd", label="user span"),
               mpatches.Patch(color="#999999", label="span inside it (compute)")]
    fig.legend(handles=legend, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
