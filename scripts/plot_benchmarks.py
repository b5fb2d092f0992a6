#!/usr/bin/env python3
"""Plot bench-results/redistribute-n*.json (from scripts/bench_redistribute.py --json) as PNGs in
docs/img/: the ratio of dtorch's time to the raw collective's, per transition and size, for the
`auto` path. Needs matplotlib (`make plots` installs it)."""

from __future__ import annotations

import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plot(path: str) -> str:
    with open(path) as fh:
        rows = [r for r in json.load(fh) if r["path"] == "auto"]
    ranks = rows[0]["ranks"]
    transitions = sorted({r["transition"] for r in rows})
    sizes = sorted({r["bytes"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, evenness in zip(axes, ("even", "uneven")):
        width = 0.8 / len(transitions)
        for i, t in enumerate(transitions):
            vals = [next((r["ratio"] for r in rows if r["transition"] == t and r["bytes"] == b
                          and r["evenness"] == evenness), float("nan")) for b in sizes]
            ax.bar([k + i * width for k in range(len(sizes))], vals, width, label=t)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.1, color="grey", linestyle="--", linewidth=0.8)
        ax.axhline(1.5, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(sizes))])
        ax.set_xticklabels([f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB" for b in sizes])
        ax.set_title(f"{evenness} pieces, {ranks} ranks")
        ax.set_ylabel("dtorch / raw mpi4py (lower is better)")
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("redistribute vs the raw collective moving the same bytes (dashed: 1.1x, dotted: 1.5x)")
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "img", f"redistribute-n{ranks}.png")
    fig.savefig(out, dpi=90)
    return out


if __name__ == "__main__":
    for path in sorted(glob.glob(os.path.join(ROOT, "bench-results", "redistribute-n*.json"))):
        print("wrote", plot(path))
