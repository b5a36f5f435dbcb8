"""The `grpo-kernels` command: `train` (GRPO with LoRA on a model folder or hub id) and `demo` (no download).

Every field of `TrainConfig` is a flag of `train` (`--max-completion-length 512`, `--no-progress`, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from typing import Any

from .trainer.config import TrainConfig
from .trainer.demo import DemoConfig, default_grpo_config, run_demo

_TYPES = {"int": int, "float": float, "str": str}


def _optional(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "") else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """One flag per dataclass field, typed from its annotation, with the field's help text and default."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "")
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if kind == "bool":  # --x / --no-x
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        base = kind.removesuffix("|None")
        convert = _TYPES[base] if base == kind else _optional(_TYPES[base])
        parser.add_argument(flag, dest=f.name, type=convert, default=f.default, metavar=base.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-kernels", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="GRPO with LoRA on a model folder or hub id and a dataset")
    add_config_arguments(train)

    demo = sub.add_parser(
        "demo", help="cold-start SFT then GRPO on two-digit addition, a tiny model, the CPU, no download"
    )
    demo.add_argument("--output-dir", default=DemoConfig.output_dir, help="where the metrics, plot and summary go")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--sft-steps", type=int, default=None, help="cold-start SFT steps (default: the demo's)")
    demo.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .trainer.data import LoadError

    try:
        if args.command == "train":
            return _train(args)
        return _demo(args)
    except (ValueError, FileNotFoundError, LoadError) as err:
        print(f"grpo-kernels {args.command}: error: {err}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from .trainer import train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    if not cfg.model or not cfg.dataset:
        raise ValueError("train needs --model (a folder or hub id) and --dataset (a file or hub dataset name)")
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports for all
        return 0
    last = result.records[-1] if result.records else {}
    print(f"trained {len(result.records)} steps; last reward {last.get('reward', float('nan')):.3f}")
    print(f"adapter: {result.adapter_dir}")
    print(f"metrics: {result.output_dir / 'metrics.jsonl'}")
    if result.plot_path:
        print(f"plot: {result.plot_path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    grpo = default_grpo_config(args.output_dir, args.seed)
    if args.grpo_steps is not None:
        grpo = replace(grpo, max_steps=args.grpo_steps)
    cfg = DemoConfig(output_dir=args.output_dir, seed=args.seed, grpo=grpo)
    if args.sft_steps is not None:
        cfg = replace(cfg, sft_steps=args.sft_steps)
    run_demo(cfg, progress=args.progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
