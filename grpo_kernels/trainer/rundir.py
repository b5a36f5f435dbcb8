"""The output folder of a run: one run per folder, JSON-lines logs that are never left torn, storage errors in one
line.

A folder holds a run when it has a non-empty metrics.jsonl, a checkpoint or a final adapter. A new run refuses such
a folder unless told to continue it (`resume`) or to replace it (`overwrite`); so two runs never mix their records.
Everything is written so that a failure at any instant (a full disk, a signal, a kill) leaves the files as they
were before the write: temporaries renamed into place, appends cut back to their start when they fail.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from .checkpoint import CHECKPOINT_NAME, TMP_PREFIXES, fsync_tree
from .errors import StorageError

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
ADAPTER_DIR = "adapter"
PLOT_FILE = "training_curves.png"
LOG_FILES = (METRICS_FILE, COMPLETIONS_FILE)
# errno values whose text a library may keep in its message although it drops the OSError itself
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)
_NEARLY_FULL = 1 << 20  # bytes: a write that fails on a filesystem with less than this free failed for lack of space

__all__ = ["StorageError", "storage"]


def storage_cause(err: BaseException, path: Path) -> str | None:
    """Why writing `path` failed, in a few words, when `err` is a storage failure, whatever library raised it:
    an OSError anywhere in its chain; an errno's text in its message (safetensors: "IoError(Os { code: 28, ... })");
    or a full filesystem under `path` (torch.save: "unexpected pos 7424 vs 7312", the errno lost). None otherwise."""
    chain, seen = [], err
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno)
    text = " ".join(str(e) for e in chain)
    for code in _STORAGE_ERRNOS:
        if os.strerror(code) in text:
            return os.strerror(code)
    folder = path
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free < _NEARLY_FULL:
        return f"{os.strerror(errno.ENOSPC)} ({free // 1024} KiB free)"
    return None


@contextlib.contextmanager
def storage(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failure to write `path` into one StorageError naming the path and the cause (`storage_cause`);
    an error that is no storage failure is left as it is."""
    path = Path(path)
    try:
        yield
    except StorageError:
        raise
    except Exception as err:
        cause = storage_cause(err, path)
        if cause is None:
            raise
        raise StorageError(f"cannot write {str(path)!r}: {cause}") from err


class JsonLog:
    """A JSON-lines file that records are appended to; an append that fails part-way (a full disk, a signal) is cut
    back to where it started, so the file only ever holds whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with storage(path):
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, records: list[dict[str, Any]]) -> None:
        data = memoryview("".join(json.dumps(r) + "\n" for r in records).encode())
        with storage(self.path):
            start = os.lseek(self.fd, 0, os.SEEK_END)
            try:
                written = 0
                while written < len(data):
                    written += os.write(self.fd, data[written:])
            except BaseException:
                os.ftruncate(self.fd, start)
                raise

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_files(out_dir: Path) -> list[Path]:
    """What a run left in `out_dir`: logs, checkpoints (complete or not), temporaries, the adapter, the plot."""
    if not out_dir.is_dir():
        return []
    found = []
    for path in sorted(out_dir.iterdir()):
        name = path.name
        if name in LOG_FILES and path.stat().st_size == 0:
            continue  # written at the start of a run that was stopped before its first step
        ours = name in (*LOG_FILES, ADAPTER_DIR, PLOT_FILE) or CHECKPOINT_NAME.fullmatch(name)
        if ours or name.startswith(TMP_PREFIXES):
            found.append(path)
    return found


def prepare_output_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Make `out_dir` ready for a run: refuse one that holds another run unless `resume` (continue it) or
    `overwrite` (delete that run's files, nothing else); remove the temporaries of an interrupted save."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(
            f"--output-dir {str(out_dir)!r} is a file, not a folder: name a folder (a missing one is made)"
        )
    existing = run_files(out_dir)
    if existing and not (resume or overwrite):
        names = ", ".join(p.name for p in existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ValueError(
            f"--output-dir {str(out_dir)!r} already holds a run ({names}): pass --resume to continue it, "
            "--overwrite to replace it, or choose another --output-dir"
        )
    with storage(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in existing:
            if overwrite or path.name.startswith(TMP_PREFIXES):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        probe = out_dir / ".tmp-write-test"  # a read-only folder fails here, not at the first checkpoint
        probe.write_bytes(b"")
        probe.unlink()


def read_records_repairing(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a JSON-lines log and a note when its last line was torn (a crash or a full disk during an
    append by an older version) and is dropped; a damaged line elsewhere is an error naming the file and the line."""
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


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite a JSON-lines log with `records`, atomically."""
    tmp = path.with_name(f".tmp-{path.name}")
    with storage(path):
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)


def save_adapter(model: Any, out_dir: Path) -> Path:
    """Write the final LoRA adapter to `out_dir/adapter` atomically: into a temporary folder, then renamed."""
    final = out_dir / ADAPTER_DIR
    with storage(final):
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-adapter-", dir=out_dir))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            fsync_tree(tmp)
            if final.exists():  # a finished run resumed with a longer schedule
                old = out_dir / f".deleting-{ADAPTER_DIR}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def save_plot(records: list[dict[str, Any]], out_dir: Path) -> Path:
    """Draw the training curves into `out_dir/training_curves.png`, atomically."""
    from .plotting import plot_metrics

    final, tmp = out_dir / PLOT_FILE, out_dir / f".tmp-{PLOT_FILE}"
    with storage(final):
        try:
            plot_metrics(records, tmp, format="png")
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return final
