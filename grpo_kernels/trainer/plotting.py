"""The training figure: held-out accuracy first (when evaluated), then the training reward and each reward
function's mean as rolling means with a light band, the KL, the loss, the entropy and the completion length against
the step.

A band is the rolling mean ± one standard deviation of the per-step values within the window: how much the step
means vary, not the spread of the rewards within a step. The reward panel says so. Panels whose curves are constant
or absent (the clip ratio at mu = 1, the KL at beta = 0) are left out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

# The panels after held-out accuracy and training reward: (title, [(metric, label)])
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("KL to the reference", [("kl", "kl")]),
    ("loss", [("loss", "loss")]),
    (
        "clip ratio",
        [("clip_ratio/region_mean", "region"), ("clip_ratio/low_mean", "low"), ("clip_ratio/high_mean", "high")],
    ),
    ("entropy (nats per token)", [("entropy", "entropy")]),
    ("completion length (tokens)", [("completions/mean_length", "mean length")]),
]


BANDS = "lines: {window}-step rolling means\nbands: ± 1 std of the step means in the window"


def rolling(ys: Sequence[float], window: int) -> tuple[list[float], list[float]]:
    """The mean and standard deviation of each value's trailing window (shorter at the start)."""
    means, stds = [], []
    for i in range(len(ys)):
        part = [y for y in ys[max(0, i - window + 1) : i + 1] if not math.isnan(y)]
        m = sum(part) / len(part) if part else math.nan
        means.append(m)
        stds.append(math.sqrt(sum((y - m) ** 2 for y in part) / len(part)) if part else math.nan)
    return means, stds


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None and not math.isnan(r[key])]
    return [s for s, _ in pairs], [y for _, y in pairs]


def _informative(ys: Sequence[float]) -> bool:
    return len(ys) > 0 and max(ys) - min(ys) > 1e-12 * max(1.0, abs(max(ys)))


def plot_metrics(
    records: Sequence[dict[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "GRPO training",
    before: dict[str, float] | None = None,
    format: str | None = None,
) -> str:
    """Draw the panels from per-step records (as in metrics.jsonl; `eval/<name>` keys where evaluated) into a PNG.
    `before`: the held-out metrics before training, drawn at step 0. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never a GUI window from a training run
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    draws = []
    steps, acc = _series(records, "eval/accuracy")
    if before is not None and "accuracy" in before:
        steps, acc = [0, *steps], [before["accuracy"], *acc]
    if acc:
        draws.append(lambda ax: _held_out(ax, steps, acc, before is not None, PercentFormatter(1.0)))
    window = max(1, round(len(records) / 12))
    reward_keys = [k for k in ("reward", *reward_names(records)) if _series(records, k)[1]]
    if "rewards/accuracy/mean" not in reward_keys and _series(records, "accuracy")[1]:
        reward_keys.append("accuracy")  # records written before the per-reward means were logged
    if reward_keys:
        draws.append(lambda ax: _rolling_panel(ax, records, reward_keys, window))
    for name, curves in PANELS:
        present = [(k, label) for k, label in curves if _informative(_series(records, k)[1])]
        if present:
            draws.append(lambda ax, name=name, present=present: _line_panel(ax, records, name, present))

    cols = min(3, len(draws)) or 1
    rows = math.ceil(len(draws) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), constrained_layout=True, squeeze=False)
    for ax, draw in zip(axes.flat, draws):
        draw(ax)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if not isinstance(ax.yaxis.get_major_formatter(), PercentFormatter):
            ax.ticklabel_format(axis="y", useOffset=False)  # 4.6055, not 0.0005 + 4.605
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(draws) :]:
        ax.remove()
    fig.suptitle(title)
    fig.savefig(path, dpi=100, format=format)
    plt.close(fig)
    return str(path)


def _held_out(ax: Any, steps: list[int], acc: list[float], has_before: bool, formatter: Any) -> None:
    ax.plot(steps, acc, marker="o", color="tab:green", label="held-out accuracy (greedy)")
    if has_before:
        ax.axhline(acc[0], color="gray", linestyle="--", linewidth=1, label=f"before GRPO: {acc[0]:.1%}")
    ax.margins(y=0.12)
    ax.set_title(f"held-out accuracy: {acc[0]:.1%} → {acc[-1]:.1%}" if has_before else "held-out accuracy")
    ax.yaxis.set_major_formatter(formatter)


def reward_names(records: Sequence[dict[str, Any]]) -> list[str]:
    """The `rewards/<name>/mean` keys of the records, in the order the reward functions were listed."""
    keys = dict.fromkeys(k for r in records for k in r if k.startswith("rewards/") and k.endswith("/mean"))
    return list(keys)


def _label(key: str) -> str:
    if key == "reward":
        return "total (weighted sum)"
    return key.removeprefix("rewards/").removesuffix("/mean")


def _rolling_panel(ax: Any, records: Sequence[dict[str, Any]], keys: list[str], window: int) -> None:
    for key in keys:
        steps, ys = _series(records, key)
        mean, std = rolling(ys, window)
        (line,) = ax.plot(steps, mean, label=_label(key), linewidth=2.0 if key == "reward" else 1.2)
        lo, hi = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_title("training reward (sampled completions)")
    # what the lines and the bands are, as the legend's title
    ax.legend(fontsize=8, title=BANDS.format(window=window), title_fontsize=7, alignment="left")


def _line_panel(ax: Any, records: Sequence[dict[str, Any]], name: str, curves: list[tuple[str, str]]) -> None:
    for key, label in curves:
        ax.plot(*_series(records, key), label=label if len(curves) > 1 else None)
    ax.set_title(name)
