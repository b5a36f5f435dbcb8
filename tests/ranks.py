"""The processes of a multi-rank test (gloo on the CPU).

`rank_results(fn, args, world)` runs `fn(rank, world, *args)` in `world` processes joined in one gloo group (a file
store in a temporary folder, set up before `fn` runs and torn down after it) and returns what each rank's `fn`
returned, by rank. With `group=False` the ranks join no group: `fn` sets one up itself, as a launcher's variables
would (`tests/integrations/__init__.py`).

The ranks are forked from multiprocessing's fork server, which imports torch, the package and the test's own modules
once per test process, rather than started as fresh interpreters ("spawn") that import it all again per rank: some
4 s a rank on a 2-core machine. The fork server itself runs no torch operation, so the ranks inherit no thread pool
(a forked OpenMP pool can hang), and each rank starts as a spawned one would, with its own random state and thread
count.

Two rules for the modules that use it: run no torch operation at import time (the server imports them), and pass a
rank what it needs as arguments, not by changing os.environ before the call (the server keeps the environment it
started with; a rank may set its own variables, as `tests/integrations/__init__.py` does).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "grpo_kernels", "reference"]


def rank_results(fn: Callable[..., Any], args: tuple, world: int, group: bool = True) -> list:
    """`fn(rank, world, *args)` in `world` ranks (in one gloo group unless `group` is False); its results by rank."""
    # The modules a rank unpickles its arguments from (this one, `fn`'s, any function passed to it); the list is
    # read when the fork server starts, at a test process's first call: later calls import what it lacks per rank.
    modules = [__name__, *(a.__module__ for a in (fn, *args) if callable(a) and hasattr(a, "__module__"))]
    multiprocessing.set_forkserver_preload([*_PRELOAD, *dict.fromkeys(modules)])
    with tempfile.TemporaryDirectory() as tmp:
        ranks = (fn, world, tmp, group, *args)
        mp.start_processes(_rank, args=ranks, nprocs=world, join=True, start_method="forkserver")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _rank(rank: int, fn: Callable[..., Any], world: int, tmp: str, group: bool, *args) -> None:
    if group:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        if group:
            dist.destroy_process_group()
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
