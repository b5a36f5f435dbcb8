"""Work computed once per test run and shared by the pytest-xdist workers (each a process of its own)."""

from __future__ import annotations

import fcntl
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def computed_once(root: Path, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()`, computed by one process of the test run and read back (unpickled) by the others: the first
    caller computes it while holding NAME's lock under `root`, one that comes meanwhile waits for it. `root`: a
    folder every worker sees (the `shared_tmp` fixture)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():
                return pickle.loads(path.read_bytes())
            value = compute()
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.name}.")  # written whole, then renamed into place
            with os.fdopen(fd, "wb") as f:
                f.write(pickle.dumps(value))
            os.replace(tmp, path)
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
