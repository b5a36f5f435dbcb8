"""What a run tells its user while it trains: a rich progress bar, or one plain line per logging step."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .config import TrainConfig


def step_summary(record: dict[str, Any]) -> str:
    text = f"reward {record['reward']:.3f}"
    if "accuracy" in record:
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

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=step_summary(record))
        elif step % self.every == 0 or step == self.total:
            print(
                f"step {step}/{self.total}  {step_summary(record)}  loss {record['loss']:.4f}  "
                f"{record['time/step_s']:.1f}s",
                flush=True,
            )

    def note(self, text: str) -> None:
        """A message for the user (resume, warnings), above the bar when there is one."""
        if self.enabled:
            print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[dict[str, bool]]:
    """Ctrl-C asks the loop to stop after the step in progress (`flag["stop"]`); a second Ctrl-C stops at once.
    Off the main thread, where Python delivers no signals, it leaves SIGINT alone."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handle(signum: int, frame: Any) -> None:
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def zero_variance_warning(steps: int, cfg: TrainConfig, record: dict[str, Any]) -> str:
    return (
        f"warning: for {steps} steps in a row every group of {cfg.num_generations} completions got equal rewards "
        f"(mean reward {record['reward']:.3g}), so every advantage is 0 and nothing is being learned. Likely causes: "
        "the rewards never fire (try the reward functions on a few completions; check --answer-column, the prompt "
        "format, --system-prompt, and whether --max-completion-length cuts answers off), every completion is already "
        "right (the task is too easy), or sampling is too cold for the completions to differ (--temperature, "
        "--top-k, --top-p)"
    )
