"""Forward+backward of the GRPO loss from logits, side by side: grpo_kernels, eager PyTorch, TRL 1.16, Liger-Kernel
0.8.5 and torch.compile, on the same inputs in one run, timed in that order, each row written as soon as it is timed.
Results land in benchmarks/results/<device>.{json,md,png}.

    python benchmarks/bench_loss.py --device cuda     # the GPU table (benchmarks/gpu_check.sh wraps it)
    python benchmarks/bench_loss.py --device cpu      # the CPU table: each contender in a fresh process
    python benchmarks/bench_loss.py --dry-run         # the GPU code path on the CPU at toy sizes (the smoke test)

Every contender computes the same thing: the per-token log-probs and the entropy (as trainers do, for the entropy
metric; with --entropy-coef != 0 the entropy bonus too), the loss of TRL's GRPOTrainer._compute_loss for the
workload below, and the gradient w.r.t. the logits. A contender that is not installed, or can't run here, gets a
row that says so; none is dropped silently. The pieces live in benchmarks/lib/: the workload and the float64 truth
(workload.py), the contenders (contenders.py), timing and memory (measure.py), where the table runs (runner.py) and
the reports (report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, when run from anywhere
from benchmarks.lib import harness, report, runner
from benchmarks.lib.contenders import COMPILE_BACKEND_ENV, CONTENDERS, faults
from benchmarks.lib.measure import NOT_REACHED
from benchmarks.lib.workload import DTYPES, SEQ_LEN, Workload

# (dtype, V, B·T) of each mode's table; --dtypes / --vocabs / --tokens replace it by their product
HEADLINE = ("bf16", 151936, 16384)  # Qwen's vocabulary, 16 sequences of 1024 tokens: 5 GB of logits
GPU_SHAPES = [HEADLINE] + [
    s for s in ((d, v, t) for d in ("bf16", "fp32") for v in (32000, 151936, 262144) for t in (2048, 16384, 65536))
    if s != HEADLINE
]
CPU_SHAPES = [("fp32", 32000, t) for t in (1024, 2048, 4096)] + [("fp32", 151936, 1024)]  # a few minutes on 2 cores
DRY_SHAPES = [("fp32", 1000, t) for t in (64, 128)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the GPU code path (all contenders in this process) on the CPU at toy sizes",
    )
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS)
    )
    p.add_argument(
        "--dtypes", default=None, help="comma-separated among bf16, fp32, fp16 (GPU default bf16,fp32; CPU fp32)"
    )
    p.add_argument("--vocabs", default=None, help="comma-separated V values")
    p.add_argument("--tokens", default=None, help="comma-separated B·T values")
    p.add_argument("--shapes", default=None, help="comma-separated dtype:V:B·T, in this order (instead of the above)")
    p.add_argument("--resume", action="store_true", help="keep the records of the --out JSON, run the shapes it lacks")
    p.add_argument("--reps", type=int, default=None, help="timed calls per contender and shape (at most)")
    p.add_argument("--min-reps", type=int, default=5, help="timed calls at least, whatever the shape budget")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (GPU default 2, CPU 1)")
    p.add_argument(
        "--contender-budget-s", type=float, default=1.0, help="GPU: time each contender's calls for about this long"
    )
    p.add_argument(
        "--contender-timeout-s",
        type=float,
        default=0.0,
        help="GPU: a contender still running after this many seconds is stopped, its row says so (0: no limit)",
    )
    p.add_argument(
        "--budget-s", type=float, default=330.0, help="GPU: the run stops after this many seconds, wherever it is"
    )
    p.add_argument("--copy-mib", type=int, default=None, help="MiB copied to measure the copy bandwidth (default: "
                   "GPU 4096, CPU 256, dry run 16)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="CPU: fresh processes per contender and shape")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU: torch threads per worker")
    p.add_argument("--worker-timeout-s", type=float, default=600.0)
    p.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus; != 0 sends gradient through H")
    p.add_argument("--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output stem (writes .json/.md/.png); default benchmarks/results/<device>",
    )
    p.add_argument("--no-plot", action="store_true", help="write the JSON and markdown only (--render adds the PNG)")
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite the markdown and the plot beside a results JSON (after a change to the report)",
    )
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run and args.device != "cpu":
        p.error("--dry-run runs on the CPU")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    args.mode = "dry-run" if args.dry_run else args.device
    shapes, reps, args.copy_bytes, warmup = {
        # shapes, reps (at most), copy-bandwidth buffer, warm-up calls
        "cuda": (GPU_SHAPES, 20, 4 << 30, 2),
        "cpu": (CPU_SHAPES, 4, 256 << 20, 1),
        "dry-run": (DRY_SHAPES, 3, 16 << 20, 1),
    }[args.mode]
    args.reps = args.reps or reps
    if args.copy_mib is not None:
        if args.copy_mib <= 0:
            p.error(f"--copy-mib must be > 0, got {args.copy_mib}")
        args.copy_bytes = args.copy_mib << 20
    args.warmup = warmup if args.warmup is None else args.warmup
    try:
        args.shapes = _shapes(args, shapes)
    except ValueError as e:
        p.error(str(e))
    if args.mode == "dry-run":
        args.min_reps = min(args.min_reps, args.reps)
    try:
        faults()  # GRPO_BENCH_FAULT, read again where each fault applies
    except ValueError as e:
        p.error(str(e))
    for flag in ("budget_s", "contender_budget_s", "contender_timeout_s"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    return args


def _shapes(args: argparse.Namespace, defaults: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The (dtype, V, B·T) list to run: --shapes as given, else the product of the narrowed dtypes, V and B·T."""
    if args.shapes:
        shapes = []
        for item in args.shapes.split(","):
            dtype_name, vocab, tokens = item.split(":")
            shapes.append((dtype_name, int(vocab), int(tokens)))
    elif args.dtypes or args.vocabs or args.tokens:
        def pick(text: str | None, i: int, cast: type) -> list:
            return [cast(x) for x in text.split(",")] if text else list(dict.fromkeys(s[i] for s in defaults))

        shapes = [
            (d, v, t)
            for d in pick(args.dtypes, 0, str)
            for v in pick(args.vocabs, 1, int)
            for t in pick(args.tokens, 2, int)
        ]
    else:
        shapes = list(defaults)
    bad = sorted({d for d, _, _ in shapes} - set(DTYPES))
    if bad:
        raise ValueError(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    return shapes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report.finish(json.loads(args.render.read_text()), args.render.with_suffix(""))
        print(f"rewrote {args.render.with_suffix('.md')} and .png", flush=True)
        return 0
    w = Workload(loss_type=args.loss_type, entropy_coef=args.entropy_coef)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    payload = new_payload(args, w, sys.argv[1:] if argv is None else argv)
    out_stem = args.out or harness.RESULTS_DIR / harness.device_slug(payload["device"])
    if args.resume and out_stem.with_suffix(".json").exists():
        payload = _resumed(payload, json.loads(out_stem.with_suffix(".json").read_text()), args)
    if args.mode == "cpu":
        runner.run_cpu(args, w, payload, out_stem)
    else:
        if args.mode == "dry-run":
            os.environ.setdefault(COMPILE_BACKEND_ENV, "aot_eager")  # the worker inherits it
            payload["reference_check"] = runner.reference_check(args, w)
            note = "dry run: the GPU code path on the CPU at toy sizes; its numbers mean nothing"
            payload["notes"] += [note] if note not in payload["notes"] else []
        runner.run_supervised(args, w, payload, out_stem)
    report.finish(payload, out_stem, png=not args.no_plot)
    print(f"results: {out_stem.with_suffix('.json')}, .md{'' if args.no_plot else ', .png'}", flush=True)
    return 0


def new_payload(args: argparse.Namespace, w: Workload, argv: list[str]) -> dict[str, Any]:
    """The results file before any row: where, what and how it measures."""
    return {
        "benchmark": "grpo_loss forward+backward from logits",
        "mode": args.mode,
        "command": "python benchmarks/bench_loss.py " + " ".join(argv),
        "created": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": harness.device_info(args.device),
        "versions": harness.versions(),
        "git": harness.git_revision(),
        "workload": asdict(w),
        "timing": (
            "CUDA events around each call, each contender's calls in a row, contenders one after the other"
            if args.device == "cuda"
            else "wall-clock per call, rounds of fresh processes alternating the contenders"
            if args.mode == "cpu"
            else "wall-clock per call, each contender's calls in a row, contenders one after the other"
        ),
        "bytes_counted": "2·B·T·V·itemsize: one read of the logits, one write of their gradient",
        "contenders": {n: CONTENDERS[n].description for n in args.contenders},
        "shapes": {
            "dtypes": list(dict.fromkeys(s[0] for s in args.shapes)),
            "V": list(dict.fromkeys(s[1] for s in args.shapes)),
            "BT": list(dict.fromkeys(s[2] for s in args.shapes)),
            "T": SEQ_LEN,
            "list": [list(s) for s in args.shapes],
        },
        "records": [],
        "notes": [],
    }


def _resumed(payload: dict[str, Any], old: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The earlier run's payload, to which this run adds the shapes it lacks (same workload and device only)."""
    if old.get("workload") != payload["workload"] or old["device"].get("name") != payload["device"]["name"]:
        raise SystemExit("--resume: the --out JSON was made with another workload or device")
    unfinished = ("skipped", "error", NOT_REACHED)
    done = {(r["dtype"], r["V"], r["BT"]) for r in old["records"] if r["status"] not in unfinished}
    old["records"] = [r for r in old["records"] if (r["dtype"], r["V"], r["BT"]) in done]
    args.shapes = [s for s in args.shapes if tuple(s) not in done]
    old["command"] += f"; then {payload['command']}"
    both = old["shapes"].get("list", []) + payload["shapes"]["list"]
    old["shapes"]["list"] = [list(s) for s in dict.fromkeys(map(tuple, both))]
    old["contenders"].update(payload["contenders"])
    return old


if __name__ == "__main__":
    sys.exit(main())
