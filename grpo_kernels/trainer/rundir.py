"""The output folder of a run: one run per folder, metrics.jsonl that survives a torn last line, storage errors
in one line.

A folder holds a run when it has a non-empty metrics.jsonl, a checkpoint or a final adapter. A new run refuses such
a folder unless told to continue it (`resume`) or to replace it (`overwrite`); so two runs never mix their records.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .checkpoint import CHECKPOINT_NAME, TMP_PREFIXES

METRICS_FILE = "metrics.jsonl"
ADAPTER_DIR = "adapter"
PLOT_FILE = "training_curves.png"


class StorageError(RuntimeError):
    """The output folder cannot be written (read-only, full, missing permissions); the message names it."""


@contextlib.contextmanager
def storage(folder: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn an OSError raised while writing `what` into one StorageError naming the folder."""
    try:
        yield
    except OSError as err:
        reason = err.strerror or str(err)
        raise StorageError(f"cannot write {what} to the output folder {str(folder)!r}: {reason}") from err


def run_files(out_dir: Path) -> list[Path]:
    """What a run left in `out_dir`: metrics, checkpoints (complete or not), temporaries, the adapter, the plot."""
    if not out_dir.is_dir():
        return []
    found = []
    for path in sorted(out_dir.iterdir()):
        name = path.name
        if name == METRICS_FILE and path.stat().st_size == 0:
            continue  # written at the start of a run that was stopped before its first step
        if name in (METRICS_FILE, ADAPTER_DIR, PLOT_FILE) or CHECKPOINT_NAME.fullmatch(name):
            found.append(path)
        elif name.startswith(TMP_PREFIXES) or name == METRICS_FILE + ".tmp":
            found.append(path)
    return found


def prepare_output_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Make `out_dir` ready for a run: refuse one that holds another run unless `resume` (continue it) or
    `overwrite` (delete that run's files, nothing else); remove the temporaries of an interrupted save."""
    existing = run_files(out_dir)
    if existing and not (resume or overwrite):
        names = ", ".join(p.name for p in existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ValueError(
            f"output_dir {str(out_dir)!r} already holds a run ({names}): pass --resume to continue it, --overwrite "
            "to replace it, or choose another --output-dir"
        )
    with storage(out_dir, "the run's files"):
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in existing:
            if overwrite or path.name.startswith(TMP_PREFIXES):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        probe = out_dir / ".write-test"  # a read-only folder fails here, not at the first checkpoint
        probe.write_bytes(b"")
        probe.unlink()


def read_metrics_repairing(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of metrics.jsonl and a note when its last line was torn (a crash or a full disk during an
    append) and is dropped; a damaged line elsewhere is an error naming the file and the line."""
    if not path.exists():
        return [], None
    lines = path.read_text().splitlines(keepends=True)
    records, note = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise ValueError(f"{path}: line {number} is not a JSON record ({err}); the file is damaged") from err
            note = f"{path}: dropped its torn last line (line {number}, {len(line)} bytes, not a whole record)"
    return records, note


def write_metrics(path: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl with `records`, atomically."""
    tmp = path.with_suffix(".jsonl.tmp")
    with storage(path.parent, METRICS_FILE):
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)
