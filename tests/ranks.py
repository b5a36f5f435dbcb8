"""The processes of a multi-rank test (gloo on the CPU).

`start_ranks(fn, args, world)` runs `fn(rank, *args)` in `world` processes and waits for them. They are forked from
multiprocessing's fork server, which imports torch, the package and the test's own modules once per test process,
rather than started as fresh interpreters ("spawn") that import it all again per rank: some 4 s a rank on a 2-core
machine. The fork server itself runs no torch operation, so the ranks inherit no thread pool (a forked OpenMP pool
can hang), and each rank starts as a spawned one would, with its own random state and thread count.

Two rules for the modules that use it: run no torch operation at import time (the server imports them), and pass a
rank what it needs as arguments, not by changing os.environ before the call (the server keeps the environment it
started with; a rank may set its own variables, as `tests/integrations/__init__.py` does).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "grpo_kernels", "reference"]


def start_ranks(fn: Callable[..., None], args: tuple, world: int) -> None:
    # The modules of `fn` and of any function it is passed (unpickled in each rank by importing them); the list is
    # read when the fork server starts, at a test process's first call: later calls import what it lacks per rank.
    modules = [fn.__module__, *(a.__module__ for a in args if callable(a) and hasattr(a, "__module__"))]
    multiprocessing.set_forkserver_preload([*_PRELOAD, *dict.fromkeys(modules)])
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="forkserver")
