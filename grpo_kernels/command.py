"""The `grpo-kernels` console command: `cli.main`, or, without the [train] extra, one line that names it."""

from __future__ import annotations

from .extras import train_extra_missing


def main(argv: list[str] | None = None) -> int:
    """`cli.main(argv)`; exit code 2 and one line on stderr when the [train] extra is not installed."""
    if train_extra_missing():
        return 2
    from .cli import main as cli_main

    return cli_main(argv)
