"""The training figure: reward ± std, loss, KL, clip ratio, entropy and completion length against the step."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

# (title, [(metric, label)], optional std metric drawn as a band around the first curve)
PANELS: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ("reward", [("reward", "reward (mean ± std)"), ("accuracy", "accuracy")], "reward_std"),
    ("loss", [("loss", "loss")], None),
    ("KL to the reference", [("kl", "kl")], None),
    (
        "clip ratio",
        [("clip_ratio/region_mean", "region"), ("clip_ratio/low_mean", "low"), ("clip_ratio/high_mean", "high")],
        None,
    ),
    ("entropy", [("entropy", "entropy")], None),
    ("completion length", [("completions/mean_length", "mean length (tokens)")], None),
]


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(records: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str = "GRPO training") -> str:
    """Draw the six panels from per-step metric records (as in metrics.jsonl) into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never a GUI window from a training run
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7), constrained_layout=True)
    steps = [r["step"] for r in records]
    for ax, (name, curves, band) in zip(axes.flat, PANELS):
        for key, label in curves:
            ys = [r.get(key, math.nan) for r in records]
            if all(y is None or math.isnan(y) for y in ys):
                continue
            ys = [math.nan if y is None else y for y in ys]
            (line,) = ax.plot(steps, ys, label=label)
            if band and key == curves[0][0]:
                std = [r.get(band, 0.0) or 0.0 for r in records]
                ax.fill_between(
                    steps,
                    [y - s for y, s in zip(ys, std)],
                    [y + s for y, s in zip(ys, std)],
                    color=line.get_color(),
                    alpha=0.2,
                )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
