"""Stopping a run when asked: Ctrl-C (SIGINT) and SIGTERM, which SLURM, Kubernetes and `kill` send on preemption.

The first signal says at once that the run will stop after the step in progress, and the loop then saves a
checkpoint of that step; a second signal stops at once. Checkpoints are written atomically, so stopping at any
instant leaves the last complete one as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ending = {"with_error": False}


def ending_with_error() -> None:
    """This process is on its way out with an error that every rank agreed on (`dist.settle`): from now on the
    handlers here ignore SIGINT and SIGTERM, which torchrun sends to the ranks still alive when one exits first, so
    that the signal does not replace the error rank 0 is about to report."""
    _ending["with_error"] = True


class Terminated(BaseException):
    """SIGTERM, raised as KeyboardInterrupt is for SIGINT (a BaseException, so no `except Exception` swallows it)."""


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def raise_for(signum: int) -> None:
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


@dataclass
class StopRequest:
    """What the loop reads once per step: `signum`, the first signal received (None: carry on)."""

    total: int
    step: int = 0  # the step in progress, 1-based, for the message
    signum: int | None = None

    @property
    def stop(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def stop_after_step(total: int, first: int = 1, *, enabled: bool = True) -> Iterator[StopRequest]:
    """`with stop_after_step(max_steps, first_step) as request:` the first SIGINT or SIGTERM sets `request.signum`
    and writes one line to stderr at once ("SIGTERM: stopping after step 3; send again to stop now"; with
    `enabled=False`, on the ranks but the first, no line); a second one raises KeyboardInterrupt or `Terminated`
    wherever the loop is. The loop keeps `request.step` on the step a signal would stop after. Off the main thread,
    where Python delivers no signals, the handlers are left alone."""
    request = StopRequest(total, first)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: Any) -> None:
        if _ending["with_error"]:
            return
        if request.stop:
            raise_for(signum)
        request.signum = signum
        if enabled:  # os.write, not print: the handler may run in the middle of another write to stderr
            line = f"{signal.Signals(signum).name}: stopping after step {request.step}; send again to stop now\n"
            os.write(2, line.encode())

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread, so that a run stopped before its loop starts still reports
    and exits with 143, as one stopped by Ctrl-C does with 130. For the CLI: once `ending_with_error`, SIGTERM
    stays ignored after the block, for the little that is left of the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        if not _ending["with_error"]:
            raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:  # a process ending with its error ignores the launcher's SIGTERM until it has exited with its code
        signal.signal(signal.SIGTERM, signal.SIG_IGN if _ending["with_error"] else previous)
