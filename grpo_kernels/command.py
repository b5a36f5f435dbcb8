"""The `grpo-kernels` console command: `cli.main`, or, without the [train] extra, one line that names it."""

from __future__ import annotations

import sys

from .extras import TRAIN_MODULES, require


def main(argv: list[str] | None = None) -> int:
    """`cli.main(argv)`; exit code 2 and one line on stderr when the [train] extra is not installed."""
    try:
        require("train", TRAIN_MODULES, "the grpo-kernels command")
    except ImportError as err:
        print(f"grpo-kernels: {err}", file=sys.stderr)
        return 2
    from .cli import main as cli_main

    return cli_main(argv)
