"""The trainer's errors that end a run with one line (exit code 2), and the one a rank raises for another's.

A user error is reported as its message alone: the data, the configuration, a reward, a model that won't load or an
output folder that can't be written. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class LoadError(RuntimeError):
    """A model or dataset could not be loaded; the message says what was tried and what to do."""


class StorageError(RuntimeError):
    """A file of the run could not be written (a full disk, a read-only folder, missing permissions); the message
    names the path and the cause."""


class PeerError(RuntimeError):
    """Raised on every rank of a multi-process run when another rank failed: `message` is that rank's, and `code` the
    exit code it ends with (2 for a user error, 1 for a bug, whose traceback that rank prints)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# What ends a run with one line and exit code 2 (a RewardError is a ValueError)
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, LoadError, StorageError)
