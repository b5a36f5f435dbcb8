"""Fused linear GRPO: time and peak memory of hidden states -> loss -> ∂hidden, ∂weight, side by side.
Results land in benchmarks/results/linear-<device>.{json,md}.

    python benchmarks/bench_linear.py                     # the GPU table: H ∈ {3584, 4096}, V = 151936,
                                                          # B·T ∈ {8192, 32768}
    python benchmarks/bench_linear.py --tiny --device cpu # the same code path at toy sizes on the CPU (a smoke test)

The pieces (inputs, contenders, the per-contender measure, the oracle's check) are in benchmarks/lib/linear.py, the
markdown in benchmarks/lib/report.py.

Contenders, all computing the same loss (the workload of bench_loss.py: dapo, beta = 0.04, clip-higher) and the
gradients of hidden and the lm_head weight, in bf16:
- materialized: logits = hidden @ weight.T (bf16, B·T x V), then grpo_kernels.grpo_loss: the baseline of the targets
  ("lm_head matmul + our logits-path loss");
- fused_linear: grpo_kernels.fused_linear_grpo_loss; fused_linear_strided: the same on hidden = last[:, :-1], the
  view a trainer passes (row blocks then follow each sequence);
- trl_chunked: TRL 1.16's ChunkedLogProbFunction (ℓ and H from hidden, in tiles), then the loss math in torch;
- liger: Liger-Kernel's LigerFusedLinearGRPOLoss (no entropy: it computes less than the others).
A contender that is not installed or fails gets a row that says so.

Targets (on an H100/H200): fused_linear peak memory ≤ 1/8 of materialized, time ≤ 1.15 x materialized.
Peak memory counts everything allocated during the call, the returned ∂hidden and ∂weight included (they are the
same size for every contender: ∂weight alone is V·H·2 bytes, 1.2 GiB at H = 4096); "transient" excludes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, when run from anywhere
from benchmarks.lib import harness, report
from benchmarks.lib.linear import (
    CONTENDERS,
    GPU_SHAPES,
    HEADLINE,
    TINY_SHAPES,
    bench_contender,
    make_inputs,
    options,
    ratios,
    reference_check,
)
from benchmarks.lib.workload import Workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy shapes: exercise every code path in seconds")
    p.add_argument("--shapes", default=None, help="'headline', 'rest', or comma-separated B·T:H:V (default: all)")
    p.add_argument("--resume", action="store_true", help="keep the rows of the results JSON, run the shapes it lacks")
    p.add_argument("--out", type=Path, default=None, help="output stem; default benchmarks/results/linear-<device>")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; 1 with --tiny)")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 5; 2 with --tiny)")
    p.add_argument("--budget-s", type=float, default=240.0, help="no new shape starts after this many seconds")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS)
    )
    args = p.parse_args(argv)
    args.warmup = (1 if args.tiny else 2) if args.warmup is None else args.warmup
    args.reps = (2 if args.tiny else 5) if args.reps is None else args.reps
    args.names = [n for n in args.contenders.split(",") if n]
    unknown = set(args.names) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contender(s) {sorted(unknown)}; choose from {list(CONTENDERS)}")
    every = TINY_SHAPES if args.tiny else GPU_SHAPES
    first = every[0] if args.tiny else HEADLINE
    if args.shapes in (None, "all"):
        args.shapes = [first] + [s for s in every if s != first]
    elif args.shapes == "headline":
        args.shapes = [first]
    elif args.shapes == "rest":
        args.shapes = [s for s in every if s != first]
    else:
        args.shapes = [tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_linear: no CUDA device; run with --tiny --device cpu for the dry run")
        return 2
    w = Workload()
    dev = harness.device_info(args.device)
    payload: dict[str, Any] = {
        "benchmark": "fused linear GRPO loss",
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": harness.git_revision(),
        "versions": harness.versions(),
        "device": dev,
        "tiny": args.tiny,
        "workload": options(w),
        "contenders": {n: CONTENDERS[n][1] for n in args.names},
        "rows": [],
    }
    stem = args.out or harness.RESULTS_DIR / f"linear-{harness.device_slug(dev)}"
    if args.resume and stem.with_suffix(".json").exists():
        payload["rows"] = [
            row
            for row in json.loads(stem.with_suffix(".json").read_text())["rows"]
            if any(res["status"] == "ok" for res in row["contenders"].values())
        ]
    done = {(row["tokens"], row["width"], row["vocab"]) for row in payload["rows"]}
    t_start = time.perf_counter()
    for tokens, width, vocab in (s for s in args.shapes if tuple(s) not in done):
        row: dict[str, Any] = {"tokens": tokens, "width": width, "vocab": vocab, "contenders": {}}
        payload["rows"].append(row)
        if time.perf_counter() - t_start > args.budget_s:
            why = f"time budget {args.budget_s:.0f} s spent"
            row["contenders"] = {n: {"status": "skipped", "why": why} for n in args.names}
            _save(payload, row, stem)
            continue
        inp = make_inputs(tokens, width, vocab, args.device)
        row["reference"] = reference_check(inp, w, tokens)
        for name in args.names:
            res = bench_contender(name, w, inp, args.device, args.warmup, args.reps)
            row["contenders"][name] = res
            shown = (
                f"{res['ms']['median']:.2f} ms, peak {harness.fmt_bytes(res['peak_bytes'])}"
                if res["status"] == "ok"
                else res["status"] + ": " + res.get("why", "")[:200]
            )
            print(f"bench_linear: N={tokens} H={width} V={vocab} {name}: {shown}", flush=True)
            _save(payload, row, stem)  # after every contender: a run cut short keeps its table
        del inp
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(report.linear_markdown(payload))
    print(f"bench_linear: wrote {stem}.json and .md")
    return 0


def _save(payload: dict[str, Any], row: dict[str, Any], stem: Path) -> None:
    row["ratios"] = {n: ratios(row, n) for n in ("fused_linear", "fused_linear_strided")}
    harness.write_json(stem.with_suffix(".json"), payload)
    harness.write_text(stem.with_suffix(".md"), report.linear_markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
