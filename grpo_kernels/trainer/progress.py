"""What a run tells its user while it trains: a rich progress bar, or one plain line per logging step."""

from __future__ import annotations

import sys
from typing import Any, Self

from .config import TrainConfig


def step_summary(record: dict[str, Any]) -> str:
    text = f"reward {record['reward']:.3f}"
    if record.get("frac_reward_none"):  # completions no reward applied to: their reward counts 0 (TRL's nansum)
        text += f" ({record['frac_reward_none']:.0%} unscored)"
    if record.get("accuracy") is not None:  # None: no completion had a gold answer to compare with
        text += f"  acc {record['accuracy']:.2f}"
    if "kl" in record:
        text += f"  kl {record['kl']:.4f}"
    return text


class Progress:
    """`with Progress(...) as p: p.step(record)`: the bar when `bar`, else a line every `every` steps;
    silent on every rank but the first (`enabled=False`)."""

    def __init__(self, total: int, done: int, *, bar: bool, every: int, enabled: bool) -> None:
        self.total, self.done, self.every, self.enabled = total, done, every, enabled
        self.bar = None
        if bar and enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            columns = [TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}")]
            self.bar = RichProgress(*columns, TimeElapsedColumn(), TimeRemainingColumn())

    def __enter__(self) -> Self:
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=step_summary(record))
        elif step % self.every == 0 or step == self.total:
            _say(
                f"step {step}/{self.total}  {step_summary(record)}  loss {record['loss']:.4f}  "
                f"{record['time/step_s']:.1f}s"
            )

    def note(self, text: str) -> None:
        """A message for the user (resume, warnings), above the bar when there is one."""
        if self.enabled:
            _say(text, sys.stderr)

    def show(self, lines: list[str]) -> None:
        """Lines of output (completions) above the bar, or after the step's line without one."""
        if not self.enabled:
            return
        for line in lines:
            if self.bar is not None:
                self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                _say(line)


def _say(line: str, stream: Any = None) -> None:
    """One line in one write: a signal's own line (written between two of Python's writes) never splits it."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def zero_variance_warning(steps: int, cfg: TrainConfig, record: dict[str, Any], log: str) -> str:
    return (
        f"warning: for {steps} steps in a row every group of {cfg.num_generations} completions got equal rewards "
        f"(mean reward {record['reward']:.3g}), so every advantage is 0 and nothing is being learned. Likely causes: "
        f"the rewards never fire (read what the model wrote and how each reward scored it in {log}; check "
        "--answer-column, the prompt format, --system-prompt, and whether --max-completion-length cuts answers "
        "off), every completion is already right (the task is too easy), or sampling is too cold for the "
        "completions to differ (--temperature, --top-k, --top-p)"
    )
