"""The `grpo-kernels` command: `train` (GRPO with LoRA on a model folder or hub id) and `demo` (no download).

Every field of `TrainConfig` is a flag of `train` (`--max-completion-length 512`, `--no-progress`, ...).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m grpo_kernels.cli`: the console command's first check, before the imports
    from grpo_kernels.extras import train_extra_missing

    if train_extra_missing():
        sys.exit(2)

# (the imports below come after that check: the trainer's need the [train] extra)
import argparse
import os
import re
import signal
from dataclasses import fields, replace
from typing import Any

from .config import LossConfig
from .trainer.config import DATA_FORMATS, LOSS_HELP, TRAINER_LOSS_DEFAULTS, TrainConfig, loss_options
from .trainer.demo import DemoConfig, default_grpo_config, run_demo

_TYPES = {"int": int, "float": float, "str": str}
TRAIN_EPILOG = f"""datasets: --dataset takes {DATA_FORMATS}.
  Each row holds a prompt (--prompt-column: text or a list of chat messages) and what the rewards need: the gold
  answer (--answer-column) for accuracy, the tests (--tests-column) for code, and for a reward of your own each
  argument it declares without a default. Every row is checked before the model loads; the first bad one stops
  the run, named by its line. Every column reaches the rewards as a keyword argument under its own name, the
  prompt's included, and the answer and tests columns also as answer= and tests=.
  reasoning-gym:NAME[,NAME...] generates --num-examples per task from --seed (pip install -e '.[reasoning-gym]');
  its prompt is 'question', and the accuracy reward is each task's own scorer on the <answer> block.

rewards of your own: --reward-funcs myrewards:digit_reward,format calls digit_reward from ./myrewards.py (the
  current folder comes first), as digit_reward(completions, **columns) -> list[float | None].

runs: a folder that already holds a run is refused unless --resume (continue from its newest complete checkpoint)
  or --overwrite (replace it). Ctrl-C or SIGTERM (preemption) stops after the step in progress and saves a
  checkpoint of it (exit code 130 or 143); a second one stops at once, leaving the last complete checkpoint.

completions: every logging step appends --log-completions of them to completions.jsonl, with their prompt,
  each reward's value and their advantage; the console shows the best and the worst."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (the error and where the flags are listed), exit code 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


# A flag's value that starts with a minus and a digit (`--learning-rate -1e-5`, `--reward-weights -1,2`): argparse
# takes "-1e-5" for a flag of its own (no flag starts with a digit)
NEGATIVE_NUMBER = re.compile(r"-\.?\d[\d.,eE+-]*")


def join_negative_values(argv: list[str]) -> list[str]:
    """`--flag -1e-5` written as `--flag=-1e-5`, so that argparse reads the number as the flag's value (and the
    config's check then says what the value must be)."""
    out: list[str] = []
    for arg in argv:
        if out and NEGATIVE_NUMBER.fullmatch(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _optional(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "") else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


# TRL's flag names for ours, where the two differ: accepted beside ours
TRL_FLAGS = {"epsilon_low": "--epsilon", "lr_scheduler": "--lr-scheduler-type"}


def _add_flag(parser: argparse.ArgumentParser, name: str, kind: str, default: Any, help_text: str) -> None:
    """`--name-with-dashes` (and TRL's name for it, `TRL_FLAGS`), typed from the annotation `kind` ("int",
    "float | None", "bool", ...)."""
    flag = "--" + name.replace("_", "-")
    flags = [flag, TRL_FLAGS[name]] if name in TRL_FLAGS else [flag]
    kind = kind.replace(" ", "")
    help_text = f"{help_text} (default: {default})"
    if kind == "bool":  # --x / --no-x
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    base = kind.removesuffix("|None")
    convert = _TYPES[base] if base == kind else _optional(_TYPES[base])
    parser.add_argument(*flags, dest=name, type=convert, default=default, metavar=base.upper(), help=help_text)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field, and in place of its `loss` one flag per option of `LossConfig`, typed from
    the annotations, with their help texts and the trainer's defaults."""
    loss_fields = {f.name: f for f in fields(LossConfig)}
    for f in fields(TrainConfig):
        if f.name != "loss":
            _add_flag(parser, f.name, str(f.type), f.default, f.metadata["help"])
            continue
        for name in loss_options():
            lf = loss_fields[name]
            default = TRAINER_LOSS_DEFAULTS.get(name, lf.default)
            _add_flag(parser, name, str(lf.type), default, LOSS_HELP.get(name, "an option of grpo_loss"))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="grpo-kernels", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="GRPO with LoRA on a model folder or hub id and a dataset",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=TRAIN_EPILOG,
    )
    add_config_arguments(train)

    demo = sub.add_parser(
        "demo", help="cold-start SFT then GRPO on two-digit addition, a tiny model, the CPU, no download"
    )
    demo.add_argument("--output-dir", default=DemoConfig.output_dir, help="where the metrics, plot and summary go")
    demo.add_argument("--seed", type=int, default=0)
    sft = DemoConfig.sft_steps
    demo.add_argument("--sft-steps", type=_at_least(1), default=None, help=f"cold-start SFT steps, >= 1 ({sft})")
    steps = default_grpo_config(DemoConfig.output_dir, 0).max_steps
    demo.add_argument("--grpo-steps", type=_at_least(1), default=None, help=f"GRPO steps, >= 1 ({steps})")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    from .trainer.errors import USER_ERRORS, PeerError, StorageError
    from .trainer.preempt import Terminated, terminate_raises

    def report(text: str) -> None:  # under torchrun rank 0 reports for all; every rank exits with the same code
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"grpo-kernels {args.command}: {text}", file=sys.stderr)

    try:
        with terminate_raises():
            return _train(args) if args.command == "train" else _demo(args)
    except PeerError as err:  # another rank failed: its message, or its traceback (a bug) is above
        report(f"error: {name_flags(str(err))}" if err.code == 2 else f"{err}; its traceback is above")
        return err.code
    except USER_ERRORS as err:
        found = _last_checkpoint(args)
        saved = f"; {found}" if isinstance(err, StorageError) and found else ""
        report(f"error: {name_flags(str(err))}{saved}")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step
        report(f"interrupted (SIGINT); {_last_checkpoint(args) or 'no checkpoint was written'}")
        return 130
    except Terminated:  # a second SIGTERM, or one before the first step
        report(f"terminated (SIGTERM); {_last_checkpoint(args) or 'no checkpoint was written'}")
        return 143


def _last_checkpoint(args: argparse.Namespace) -> str:
    from .trainer.checkpoint import latest_checkpoint

    found = latest_checkpoint(args.output_dir) if args.command == "train" else None
    return f"last checkpoint: {found} (continue with --resume)" if found else ""


def option_names() -> list[str]:
    """Every name a flag of `train` is made from: the config's fields and the loss options."""
    return [f.name for f in fields(TrainConfig) if f.name != "loss"] + loss_options()


def name_flags(message: str) -> str:
    """An error message with the config's field names written as the flags the user typed (`num_generations` ->
    `--num-generations`, `device='x'` -> `--device 'x'`). Quoted text (paths, values, columns) is left as it is; a
    one-word name is a flag only where it starts a clause ("beta must be >= 0", "resume and overwrite ...")."""
    names = sorted(option_names(), key=len, reverse=True)
    joined = [n for n in names if "_" in n]
    single = [n for n in names if "_" not in n]
    patterns = [
        re.compile(r"(?<![\w./-])(" + "|".join(joined) + r")(?![\w/-])(=?)"),
        re.compile(r"(?:^|(?<=and )|(?<=, ))(" + "|".join(single) + r")(?= must\b| and | exclude\b|=)(=?)"),
    ]

    def flag(match: re.Match) -> str:
        return "--" + match.group(1).replace("_", "-") + (" " if match.group(2) else "")

    parts = re.split(r"((?<!\w)'[^']*'|(?<!\w)\"[^\"]*\")", message)  # an apostrophe (GRPO's) quotes nothing
    for i in range(0, len(parts), 2):  # the even parts are outside quotes
        for pattern in patterns:
            parts[i] = pattern.sub(flag, parts[i])
    return "".join(parts)


def _train(args: argparse.Namespace) -> int:
    from .trainer import train
    from .trainer.preempt import exit_code

    cfg = TrainConfig.from_flat({k: v for k, v in vars(args).items() if k != "command"})
    if not cfg.model or not cfg.dataset:
        raise ValueError("train needs --model (a folder or hub id) and --dataset (a file or hub dataset name)")
    result = train(cfg)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 reports for all
    if result.interrupted:
        if rank0:
            step = result.records[-1]["step"] if result.records else 0
            name = signal.Signals(result.signal).name
            print(
                f"{name}: stopped after step {step} of {cfg.max_steps}; {_last_checkpoint(args)}", file=sys.stderr
            )
        return exit_code(result.signal)
    if not rank0:
        return 0
    last = result.records[-1] if result.records else {}
    print(f"trained {len(result.records)} steps; last reward {last.get('reward', float('nan')):.3f}")
    print(f"adapter: {result.adapter_dir}")
    print(f"metrics: {result.output_dir / 'metrics.jsonl'}")
    if cfg.log_completions:
        print(f"completions: {result.output_dir / 'completions.jsonl'}")
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
