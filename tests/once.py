"""Work computed once per test run and shared by the pytest-xdist workers (each a process of its own): a file lock
between processes, files written whole, and `computed_once`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Yields True with the lock file `path` held, or False when another process holds it and `wait` is False."""
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_whole(path: Path, data: bytes) -> None:
    """`data` to `path`, whole or not at all: a temporary file beside it, renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def computed_once(root: Path, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()`, computed by one process of the test run and read back (unpickled) by the others: the first
    caller computes it while holding NAME's lock under `root`, one that comes meanwhile waits for it. `root`: a
    folder every worker sees (the `shared_tmp` fixture)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.pickle"
    with file_lock(root / f"{name}.lock"):
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        write_whole(path, pickle.dumps(value))
        return value
