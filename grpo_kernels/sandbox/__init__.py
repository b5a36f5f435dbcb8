"""Run untrusted Python (a policy's code) in a throw-away, locked-down sandbox, and judge it from outside.

- `runner`: the caller's side: the layers this machine allows (`isolation()`), a run, its watch, its cleanup.
- `launcher`: the sandboxed side: namespaces, a private tmpfs, a fresh uid, Landlock, seccomp, then the code.
- `judge`: the trusted process that holds the tests and calls the solution through plain-data proxies.
- `wire`: the plain data that crosses between them.
"""

from .launcher import SETUP_FAILED
from .runner import SandboxLimits, SandboxResult, isolation, normalize_output, run_python, run_stdio, run_tests

__all__ = [
    "SETUP_FAILED",
    "SandboxLimits",
    "SandboxResult",
    "isolation",
    "normalize_output",
    "run_python",
    "run_stdio",
    "run_tests",
]
