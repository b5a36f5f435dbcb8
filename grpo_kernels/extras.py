"""The optional parts of the package and the extras that install them.

The loss (`grpo_kernels.grpo_loss` and the rest of the top-level API) needs torch and Triton only. The trainer, its
rewards, the sandbox and the CLI need the `[train]` extra, the TRL drop-in the `[trl]` extra; importing one of them
without its extra fails at once with one line that names it.
"""

from __future__ import annotations

import importlib.util
import sys

TRAIN_MODULES = ("transformers", "peft", "datasets", "math_verify", "rich", "matplotlib", "safetensors")


def require(extra: str, modules: tuple[str, ...], what: str) -> None:
    """ImportError, one line naming `extra`, when any of `modules` is not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{what} needs the [{extra}] extra, which is not installed (missing: {', '.join(missing)}): "
            f"pip install 'grpo-kernels[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
        )



def train_extra_missing() -> bool:
    """The console command's first check: True, after one line on stderr naming the [train] extra, when it is not
    installed (`grpo-kernels` and `python -m grpo_kernels.cli` then exit with code 2)."""
    try:
        require("train", TRAIN_MODULES, "the grpo-kernels command")
    except ImportError as err:
        print(f"grpo-kernels: {err}", file=sys.stderr)
        return True
    return False
