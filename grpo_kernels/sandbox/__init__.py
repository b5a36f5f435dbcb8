"""Run untrusted Python (a policy's code) in a throw-away, locked-down sandbox, and judge it from outside.

- `runner`: the caller's side: the public entry points, a run and its watch.
- `plan`: the layers this machine allows and what they guarantee (`isolation()`); `cleanup`: killing all of a run.
- `view`: what the sample may read: the system, its interpreter's standard library, the packages named.
- `launcher`: the sandboxed side: namespaces, its view, a private tmpfs, a fresh uid, then the code (per stdin/stdout
  case, afresh); `restrict`: the restrictions it applies to itself (seccomp, Landlock, capabilities).
- `judge`: the trusted process that holds the tests and calls the solution through plain-data proxies.
- `wire`: the plain data that crosses between them.
"""

from .restrict import SETUP_FAILED
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
