"""The GPU check: the numbers that matter, most important first, each phase in its own process under its own timeout,
every result written as soon as it exists. One try of at most 7 minutes, wheel install included, by construction:

| phase | budget s | what it answers |
| --- | ---: | --- |
| env | 45 | the carried wheels; versions, device, L2; copy and matmul ceilings; our kernels compiled for the headline |
| kernel_tests | 90 | tests/test_gpu.py: the kernels against the float64 oracle on the real device |
| loss_headline | 90+ | the loss table's headline shape (bf16, V=151936, B·T=16384): ours first, compile last |
| l2 | 45 | single launches: the fused kernel on both grids, stats, grad, a copy, a cold/warm control; the |
| | | pipeline schedules; the fused kernel's pass 2 in its order and in row order |
| linear_headline | 55 | the fused-linear table's headline shape (B·T=8192, H=4096, V=151936) |
| loss_rest | 25+ | the loss table's other shapes, while time remains |
| linear_rest | 10+ | the fused-linear table's other shapes, while time remains |
| other_gpu_tests | 0+ | the remaining `-m gpu` tests (torch.compile, fused linear), if any time is left |
| report | 15 | the loss plot, the summary |

The budgets sum to TOTAL_S = 375 s; MARGIN_S = 45 s more covers this script's start, a killed phase's teardown and
the bundle, so the check ends within LIMIT_S = 420 s. A '+' phase also gets the time the phases before it left
unused (the headline first). A phase that runs out of time is killed with its process group; what it wrote stays:
the loss table writes each contender's row as soon as it is timed. With --only, the limit is the sum of the chosen
phases' budgets (at least 60 s). Results go to benchmarks/results/ (or --results-dir), a summary (gpu_check.json,
.md) and the log to gpu_check/ beside them, and, when $OUT is set, everything again as gpu_check.tar.gz plus the
summary and log, rewritten after every phase.

    bash benchmarks/gpu_check.sh                  # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --dry-run      # every phase's code path at toy sizes on the CPU (interpreter)
    python benchmarks/gpu_check.py --only l2      # one phase (names above, comma-separated)

It never installs from the network: before its first phase (env, unless --only leaves it out) it installs the wheels
that benchmarks/fetch_wheels.sh put in benchmarks/.wheels/ (with pip --no-index), only for the modules this Python
lacks, in that phase's time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, when run from anywhere
from benchmarks.lib import harness

LIMIT_S = 420  # 7 minutes: a rerun of any one phase (--only) still fits the 15 minutes of device time of a try
MARGIN_S = 45  # this script's start, the teardown of a phase killed at its deadline (up to 10 s), the last bundle
TOTAL_S = 375


@dataclass(frozen=True)
class Phase:
    name: str
    budget_s: int
    takes_slack: bool = False  # also gets the time the phases before it left unused


PHASES = (
    Phase("env", 45),
    Phase("kernel_tests", 90),
    Phase("loss_headline", 90, takes_slack=True),
    Phase("l2", 55),
    Phase("linear_headline", 55),
    Phase("loss_rest", 15, takes_slack=True),
    Phase("linear_rest", 10, takes_slack=True),
    Phase("other_gpu_tests", 0, takes_slack=True),
    Phase("report", 15),
)
assert sum(p.budget_s for p in PHASES) == TOTAL_S and TOTAL_S + MARGIN_S <= LIMIT_S
WHEELS = harness.BENCH_DIR / ".wheels"
# The loss table's headline (bench_loss.HEADLINE) and, in the dry run, its toy stand-in; the env phase compiles our
# kernels at its dtype, V and options on B·T = WARM_TOKENS (the same specializations: the B·T divide alike).
LOSS_HEADLINE, DRY_LOSS_HEADLINE = ("bf16", 151936, 16384), ("fp32", 64, 16)
WARM_TOKENS = 2048
L2_SHAPES = [("bf16", 151936, 16384), ("fp32", 151936, 16384), ("bf16", 262144, 16384)]
DRY_L2_SHAPES = [("fp32", 64, 8)]
# The L2 phase's last part: the row kernels at the headline shape under each schedule the launcher can be switched
# to, after the shapes above: (triton_logits.TILES_IN_FLIGHT, triton_logits.NARROW_16BIT): 1 tile with the wide
# 16-bit plans (the schedule before the last rounds), 3 tiles with the wide plans, then the default (there the
# narrow plan changes row_stats, 8 warps in place of 16, and the fused kernel, tiles of 16384 in place of 8192).
SCHEDULE_SHAPES, DRY_SCHEDULE_SHAPES = [("bf16", 151936, 16384)], [("fp32", 64, 8)]
SCHEDULES = ((1, False), (3, False), (3, True))
# Then, last (its row-order compile is the phase's one extra), the fused kernel's pass 2 in the launcher's order
# against row order (triton_logits.PASS2_WINDOW = 1), where the two differ: 132 bf16 rows of 262144 exceed L2.
ORDER_SHAPES, DRY_ORDER_SHAPES = [("bf16", 262144, 16384)], [("fp32", 64, 8)]
# Then the fused kernel's row split (triton_logits.ROW_SPLIT): the launcher's default (the split plan, two 8-warp
# programs per SM, 6 or 7 per row at fp32 V = 151936) against no split (the one-program plan) and a split in 2 (two
# compiles more; its budget took 10 s of loss_rest's).
SPLIT_SHAPES, DRY_SPLIT_SHAPES = [("fp32", 151936, 16384)], [("fp32", 64, 8)]
SPLITS = (None, 1, 2)
SUPERVISOR_MARGIN_S = 15  # the loss table's own budget stops it this long before its phase is killed
# A loss contender still running after this long (a hang) costs its own row, not the ones after it; a cold inductor
# compile of the headline's graph takes 20-60 s.
CONTENDER_TIMEOUT_S = 75


def commands(phase: str, ctx: dict[str, Any]) -> list[list[str]]:
    """The processes of a phase, in order (the dry run: the same code paths at toy sizes on the CPU; its rest
    phases time the cheap contenders only, the headline phases cover every contender of both tables)."""
    py, dry, res, here = ctx["python"], ctx["dry"], ctx["results"], ctx["script"]
    loss, linear = str(res / ctx["loss_stem"]), str(res / ctx["linear_stem"])

    def remaining() -> str:
        return str(max(10, int(ctx["phase_deadline"] - time.time() - SUPERVISOR_MARGIN_S)))

    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--continue-on-collection-errors"]
    if phase in ("env", "l2"):
        return [[py, here, f"--measure-{phase}", "--results-dir", str(res), *(["--dry-run"] if dry else [])]]
    if phase == "kernel_tests":
        return [[*pytest, "-v", "tests/test_gpu.py"]]  # -v: each result printed as it comes
    if phase == "other_gpu_tests":
        return [[*pytest, "tests/test_compile.py" if dry else "tests", "-m", "gpu", "--ignore=tests/test_gpu.py"]]
    bench_loss = [py, "benchmarks/bench_loss.py", "--out", loss, "--no-plot"]  # the report phase plots
    bench_linear = [py, "benchmarks/bench_linear.py", "--out", linear]
    if dry:
        bench_loss += ["--dry-run", "--reps", "2", "--min-reps", "1", "--warmup", "1"]
        bench_linear += ["--tiny", "--device", "cpu", "--reps", "1", "--warmup", "1"]
    else:
        bench_loss += ["--device", "cuda", "--contender-timeout-s", str(CONTENDER_TIMEOUT_S)]
        bench_linear += ["--device", "cuda"]
    if phase == "loss_headline":
        shape = ":".join(map(str, DRY_LOSS_HEADLINE if dry else LOSS_HEADLINE))
        return [[*bench_loss, "--shapes", shape, "--budget-s", remaining()]]
    if phase == "loss_rest":
        rest = ["--shapes", "fp32:64:16,fp32:64:24", "--contenders", "ours,ours_inplace,eager"] if dry else []
        return [[*bench_loss, "--resume", *rest, "--budget-s", remaining()]]
    if phase == "linear_headline":
        return [[*bench_linear, "--shapes", "32:16:100" if dry else "headline"]]
    if phase == "linear_rest":
        rest = ["--shapes", "32:16:100,48:16:77", "--contenders", "materialized,fused_linear"] if dry else []
        return [[*bench_linear, "--resume", *(rest or ["--shapes", "rest"]), "--budget-s", remaining()]]
    if phase == "report":
        return [[py, "benchmarks/bench_loss.py", "--render", loss + ".json"]] if Path(loss + ".json").exists() else []
    raise ValueError(f"unknown phase {phase!r}")


# ----------------------------------------------------------------------------------------------------------------
# The two phases measured in this script's own child process


def measure_env(results: Path, dry: bool) -> None:
    import torch

    from benchmarks.lib import report
    from benchmarks.lib.measure import copy_bandwidth, matmul_rate
    from benchmarks.lib.traffic import device_caches

    device = "cpu" if dry else "cuda"
    info = harness.device_info(device)
    payload = {
        "device": info,
        "versions": harness.versions(),
        "git": harness.git_revision(),
        "caches": device_caches(device),
    }
    stem = results / f"ceilings-{harness.device_slug(info)}"
    payload["copy_bandwidth"] = copy_bandwidth(device, (16 << 20) if dry else (4 << 30))
    payload["matmul"] = matmul_rate(device, 256 if dry else 8192, torch.float32 if dry else torch.bfloat16)
    harness.write_json(stem.with_suffix(".json"), payload)
    # Then our kernels, compiled into Triton's disk cache here so that the headline phase does not pay for it.
    dtype_name, vocab, tokens = DRY_LOSS_HEADLINE if dry else LOSS_HEADLINE
    payload["warmup"] = warm_ours(device, dtype_name, vocab, min(tokens, WARM_TOKENS))
    harness.write_json(stem.with_suffix(".json"), payload)
    harness.write_text(stem.with_suffix(".md"), report.ceilings_markdown(payload))
    print(report.ceilings_markdown(payload), flush=True)


def warm_ours(device: str, dtype_name: str, vocab: int, tokens: int) -> dict[str, Any]:
    """Two calls of each of our contenders, as the loss table makes them (the same workload and options), so that
    Triton compiles their kernels here and the headline phase finds them in its cache: (dtype, V) of the headline,
    B·T = `tokens`. Each contender's first and second call times, or why it failed."""
    import torch

    from benchmarks.lib.contenders import CONTENDERS, make_step
    from benchmarks.lib.workload import DTYPES, Workload, make_inputs, split_tokens

    batch, length = split_tokens(tokens)
    out: dict[str, Any] = {"dtype": dtype_name, "V": vocab, "BT": batch * length}
    inp = make_inputs(batch, length, vocab, DTYPES[dtype_name], device)
    for name in ("ours", "ours_inplace"):
        contender = CONTENDERS[name]
        try:
            step = make_step(contender, contender.build(Workload(), device), inp)
            calls = []
            for _ in range(2):
                t0 = time.perf_counter()
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                calls.append(time.perf_counter() - t0)
                if contender.inplace:
                    inp.refill()
            out[name] = {"status": "ok", "first_call_s": calls[0], "second_call_s": calls[1]}
        except Exception as e:  # noqa: BLE001 - the headline phase then compiles them itself, and says so if it fails
            out[name] = {"status": "error", "note": f"{type(e).__name__}: {str(e)[:240]}"}
    return out


def measure_l2(results: Path, dry: bool) -> None:
    from benchmarks.lib import report
    from benchmarks.lib.traffic import device_caches, measure_shape

    device = "cpu" if dry else "cuda"
    info = harness.device_info(device)
    payload: dict[str, Any] = {"device": info, "git": harness.git_revision(), "caches": device_caches(device)}
    payload["shapes"] = []
    stem = results / f"l2-{harness.device_slug(info)}"
    for dtype_name, vocab, tokens in DRY_L2_SHAPES if dry else L2_SHAPES:
        try:
            shape = measure_shape(dtype_name, vocab, tokens, device, *((1, 0) if dry else (10, 2)))
        except Exception as e:  # noqa: BLE001 - a shape that cannot be set up (out of memory) costs its own rows
            shape = {"dtype": dtype_name, "V": vocab, "BT": tokens, "rows": [], "error": f"{type(e).__name__}: {e}"}
        payload["shapes"].append(shape)
        harness.write_json(stem.with_suffix(".json"), payload)
        harness.write_text(stem.with_suffix(".md"), report.traffic_markdown(payload))
        print(report.traffic_markdown(payload), flush=True)
    payload["schedules"] = [measure_schedules(*shape, device, dry)
                            for shape in (DRY_SCHEDULE_SHAPES if dry else SCHEDULE_SHAPES)]  # fmt: skip
    harness.write_json(stem.with_suffix(".json"), payload)
    schedules = "\n".join(schedules_markdown(sched) for sched in payload["schedules"])
    harness.write_text(stem.with_suffix(".md"), report.traffic_markdown(payload) + "\n" + schedules)
    print(schedules, flush=True)
    payload["pass2_orders"] = [measure_pass2_orders(*shape, device, dry)
                               for shape in (DRY_ORDER_SHAPES if dry else ORDER_SHAPES)]  # fmt: skip
    harness.write_json(stem.with_suffix(".json"), payload)
    orders = "\n".join(orders_markdown(o) for o in payload["pass2_orders"])
    harness.write_text(stem.with_suffix(".md"), report.traffic_markdown(payload) + "\n" + schedules + "\n" + orders)
    print(orders, flush=True)
    payload["row_splits"] = [measure_row_splits(*shape, device, dry)
                             for shape in (DRY_SPLIT_SHAPES if dry else SPLIT_SHAPES)]  # fmt: skip
    harness.write_json(stem.with_suffix(".json"), payload)
    splits = "\n".join(splits_markdown(s) for s in payload["row_splits"])
    harness.write_text(stem.with_suffix(".md"),
                       report.traffic_markdown(payload) + "\n" + schedules + "\n" + orders + "\n" + splits)
    print(splits, flush=True)


def measure_row_splits(dtype_name: str, vocab: int, tokens: int, device: str, dry: bool) -> dict[str, Any]:
    """Median time and floor-traffic rate of fused_token_grad with each SPLITS entry (triton_logits.ROW_SPLIT; None:
    the launcher's default), each split timed once; a row that fails says why."""
    from grpo_kernels.ops import triton_logits as tk

    kernels, x = _row_kernels(dtype_name, vocab, tokens, device)
    nbytes, fn = kernels["fused_token_grad"]
    rows, seen = [], set()
    saved = tk.ROW_SPLIT
    try:
        for forced in SPLITS:
            tk.ROW_SPLIT = forced
            block_v, num_warps, split, _, _ = _fused_launch(x)
            if split in seen:
                continue
            seen.add(split)
            row = {"split": split, "default": forced is None, "tiles": -(-vocab // block_v),
                   "warps": num_warps}  # fmt: skip
            rows.append(_timed_row(row, nbytes, fn, device, dry))
    finally:
        tk.ROW_SPLIT = saved
    return {"dtype": dtype_name, "V": vocab, "BT": tokens, "rows": rows}


def _fused_launch(x: Any) -> tuple[int, int, int, int, int]:
    """(BLOCK_V, num_warps, SPLIT, pass-2 window in tiles, tiles of a program's row or slice) of the timed
    fused_token_grad launch over `x` (its output a fresh tensor: `_row_kernels`)."""
    import torch

    from grpo_kernels.ops import triton_logits as tk

    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    _, block_v, num_warps, window, _, split = tk._fused_plan(x, out)
    tiles = -(-x.shape[-1] // block_v)
    return block_v, num_warps, split, window, -(-tiles // split)


def splits_markdown(splits: dict[str, Any]) -> str:
    title = f"Row split (fused_token_grad, {splits['dtype']}, V = {splits['V']}, B·T = {splits['BT']})"
    cells = [f"{r['split']}{' (default)' if r['default'] else ''} | {r['warps']} | {r['tiles']}"
             for r in splits["rows"]]  # fmt: skip
    return _timed_rows_markdown(title, "programs per row | warps per program | tiles per row", "---: | ---: | ---:",
                                splits["rows"], cells)  # fmt: skip


def measure_pass2_orders(dtype_name: str, vocab: int, tokens: int, device: str, dry: bool) -> dict[str, Any]:
    """Median time and floor-traffic rate of fused_token_grad on its default grid with pass 2 in the launcher's
    order (the row's last `pass2_window` share first) and in row order; a row that fails says why."""
    from grpo_kernels.ops import triton_logits as tk

    kernels, x = _row_kernels(dtype_name, vocab, tokens, device)
    nbytes, fn = kernels["fused_token_grad"]
    rows = []
    saved = tk.PASS2_WINDOW
    try:
        for share in (None, 1.0):
            tk.PASS2_WINDOW = share
            _, _, _, window, tiles = _fused_launch(x)
            row = {"order": "launcher's" if share is None else "row order", "window_tiles": window,
                   "tiles": tiles}  # fmt: skip
            rows.append(_timed_row(row, nbytes, fn, device, dry))
    finally:
        tk.PASS2_WINDOW = saved
    return {"dtype": dtype_name, "V": vocab, "BT": tokens, "rows": rows}


def orders_markdown(orders: dict[str, Any]) -> str:
    title = f"Pass 2's order (fused_token_grad, {orders['dtype']}, V = {orders['V']}, B·T = {orders['BT']})"
    cells = [f"{r['order']} | the last {r['window_tiles']} of {r['tiles']}" for r in orders["rows"]]
    return _timed_rows_markdown(title, "order | first tiles of pass 2", "--- | ---", orders["rows"], cells)


def _row_kernels(dtype_name: str, vocab: int, tokens: int, device: str) -> tuple[dict[str, tuple[int, Any]], Any]:
    """({name: (floor bytes, launch)} of row_stats, row_grad and fused_token_grad, the logits) over one seeded
    workload."""
    import torch

    from benchmarks.lib.workload import DTYPES, LOGIT_STD, Workload, split_tokens
    from grpo_kernels.ops import triton_logits as tk

    batch, length = split_tokens(tokens)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.empty(batch, length, vocab, dtype=DTYPES[dtype_name], device=device)
    x.normal_(0.0, LOGIT_STD, generator=gen)
    ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    g = torch.randn(batch, length, generator=gen, device=device)
    out = torch.empty_like(x)
    size = x.numel() * x.element_size()
    logp, _, state = tk.row_stats(x, ids, 1.0)
    fused = {"advantages": torch.randn(batch, 1, generator=gen, device=device).expand(batch, length),
             "old_logp": logp.float(), "ref_logp": logp.float() - 0.1, "rho": None,
             "weight": torch.full((batch, length), 1.0 / tokens, device=device), "entropy_weight": None,
             "cfg": Workload().config()}  # fmt: skip
    kernels = {
        "row_stats": (size, lambda: tk.row_stats(x, ids, 1.0)),
        "row_grad": (2 * size, lambda: tk.row_grad(x, ids, state, g, None, 1.0, out)),
        "fused_token_grad": (2 * size, lambda: tk.fused_token_grad(x, ids, 1.0, out=out, **fused)),
    }
    return kernels, x


def _timed_row(row: dict[str, Any], nbytes: int, fn: Any, device: str, dry: bool) -> dict[str, Any]:
    """`row` with the median time of `fn` and its rate of `nbytes` floor traffic, or why it failed."""
    from benchmarks.lib.traffic import _timed

    row["bytes"] = nbytes
    try:
        t = _timed(fn, device, *((1, 0) if dry else (5, 2)))
        row.update(time_ms=t, GBps=nbytes / (t["median"] / 1e3) / 1e9)
    except Exception as e:  # noqa: BLE001 - a row that fails says why, the others still run
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def _timed_rows_markdown(title: str, head: str, rule: str, rows: list[dict[str, Any]], cells: list[str]) -> str:
    lines = [f"## {title}", "", f"| {head} | median ms | GB/s of floor traffic |", f"| {rule} | ---: | ---: |"]
    for r, cell in zip(rows, cells, strict=True):
        timed = f"error: {r['error']} | " if "error" in r else f"{r['time_ms']['median']:.3f} | {r['GBps']:.0f}"
        lines.append(f"| {cell} | {timed} |")
    return "\n".join(lines) + "\n"


def measure_schedules(dtype_name: str, vocab: int, tokens: int, device: str, dry: bool) -> dict[str, Any]:
    """Median time and floor-traffic rate of row_stats, row_grad and fused_token_grad under each SCHEDULES entry
    (triton_logits.TILES_IN_FLIGHT, the least tiles in flight per program, and triton_logits.NARROW_16BIT, the
    16-bit rows' narrow plans); a row that fails says why."""
    from grpo_kernels.ops import triton_logits as tk

    kernels, _ = _row_kernels(dtype_name, vocab, tokens, device)
    rows = []
    saved = tk.TILES_IN_FLIGHT, tk.NARROW_16BIT
    try:
        for count, narrow in SCHEDULES:
            tk.TILES_IN_FLIGHT, tk.NARROW_16BIT = count, narrow
            for name, (nbytes, fn) in kernels.items():
                row = {"kernel": name, "tiles_in_flight": count, "narrow_16bit": narrow}
                rows.append(_timed_row(row, nbytes, fn, device, dry))
    finally:
        tk.TILES_IN_FLIGHT, tk.NARROW_16BIT = saved
    return {"dtype": dtype_name, "V": vocab, "BT": tokens, "rows": rows}


def schedules_markdown(sched: dict[str, Any]) -> str:
    title = f"Pipeline schedules ({sched['dtype']}, V = {sched['V']}, B·T = {sched['BT']})"
    cells = [f"{r['kernel']} | {r['tiles_in_flight']} | {'narrow' if r.get('narrow_16bit') else 'wide'}"
             for r in sched["rows"]]  # fmt: skip
    return _timed_rows_markdown(title, "kernel | tiles in flight | 16-bit plan", "--- | ---: | ---", sched["rows"],
                                cells)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The driver


def install_carried_wheels(wheels: Path, site: Path, log, deadline: float | None = None) -> list[str]:
    """pip install --no-index the wheels in `wheels` whose module this Python lacks, into `site`, one at a time, so
    that a wheel that does not fit costs its own module only; none starts after `deadline` (wall-clock; the first
    phase's time). Returns the wheels installed."""
    import importlib.util

    done = []
    for wheel in sorted(wheels.glob("*.whl")):
        module = wheel.name.split("-")[0].lower()  # each carried wheel's module is its distribution's name
        if importlib.util.find_spec(module) is not None:
            continue
        left = 120.0 if deadline is None else deadline - time.time()
        if left < 2:
            log(f"{module} was missing: {wheel.name} not installed, the phase's time is spent")
            continue
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), str(wheel)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=min(120.0, left))
        except subprocess.TimeoutExpired:
            log(f"{module} was missing: {wheel.name} into {site}: pip timed out after {min(120.0, left):.0f} s")
            continue
        log(f"{module} was missing: {wheel.name} into {site}: exit code {proc.returncode} {proc.stderr.strip()[-300:]}")
        if proc.returncode == 0:
            done.append(wheel.name)
    return done


def run_phase(phase: Phase, ctx: dict[str, Any], log) -> dict[str, Any]:
    started = time.time()
    result: dict[str, Any] = {"phase": phase.name, "budget_s": phase.budget_s, "commands": [], "timed_out": False}
    for cmd in commands(phase.name, ctx):
        left = ctx["phase_deadline"] - time.time()
        if left < 3:
            result["timed_out"] = True
            break
        log(f"$ {' '.join(cmd)}   (at most {left:.0f} s)")
        rc = _run(cmd, left, ctx)
        result["commands"].append({"command": cmd, "rc": rc})
        if rc == "timeout":
            result["timed_out"] = True
            log(f"{phase.name}: timed out; what it wrote so far stays")
            break
    result["wall_s"] = round(time.time() - started, 1)
    codes = [c["rc"] for c in result["commands"]]
    result["rc"] = 124 if result["timed_out"] else next((c for c in codes if c != 0), 0)
    return result


def _run(cmd: list[str], timeout_s: float, ctx: dict[str, Any]) -> int | str:
    """Run one command in its own process group, its output echoed and logged line by line; killed with its
    children after `timeout_s` ("timeout")."""
    with open(ctx["log_path"], "a") as logf:
        proc = subprocess.Popen(
            cmd, cwd=harness.REPO_ROOT, env=ctx["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                logf.write(line)
                logf.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        reader.join(timeout=10)
    return rc


def write_summary(summary: dict[str, Any], ctx: dict[str, Any]) -> None:
    logs: Path = ctx["logs"]
    harness.write_json(logs / "gpu_check.json", summary)
    table = [[p["phase"], _budget_text(p["phase"]), p["wall_s"], p["rc"], "yes" if p["timed_out"] else ""]
             for p in summary["phases"]]  # fmt: skip
    lines = [
        f"# GPU check ({'dry run' if ctx['dry'] else 'cuda'}), git {summary['git']}",
        "",
        f"Started {summary['started']}; {summary['elapsed_s']:.0f} s of at most {summary['limit_s']} s so far.",
        "",
        harness.markdown_table(
            ["phase", "budget s", "wall s", "exit", "timed out"],
            table,
            "lrrrl",
        ),
        "",
    ]
    for pattern in ("ceilings-*.md", "l2-*.md", ctx["loss_stem"] + ".md", ctx["linear_stem"] + ".md"):
        for f in sorted(ctx["results"].glob(pattern)):
            if f.stat().st_mtime >= ctx["t0"]:  # this run's tables, one after the other
                lines += [f"<!-- {f.name} -->", "", "#" + f.read_text(), ""]
    harness.write_text(logs / "gpu_check.md", "\n".join(lines))
    out = os.environ.get("OUT")
    if not out:
        return
    out_dir = Path(out)
    with tempfile.TemporaryDirectory() as tmp:  # written beside, then moved: a kill mid-write keeps the last one
        tar_path = Path(tmp) / "gpu_check.tar.gz"
        with tarfile.open(tar_path, "w:gz") as tar:
            for f in sorted(ctx["results"].glob("*")):
                if f.is_file() and (f.stat().st_mtime >= ctx["t0"] or f.parent == logs):
                    tar.add(f, arcname=f.name)
            tar.add(logs, arcname="gpu_check")
        shutil.move(str(tar_path), out_dir / "gpu_check.tar.gz")
    for name in ("gpu_check.json", "gpu_check.md", "gpu_check.log"):
        shutil.copy(logs / name, out_dir / name)


def allowance(todo: list[Phase], i: int, left: float, scale: float = 1) -> float:
    """Seconds phase todo[i] may run when `left` seconds remain before the check's limit: its budget, never what
    the phases after it are kept; a '+' phase all there is less that (its budget and the earlier phases' slack)."""
    later = scale * sum(p.budget_s for p in todo[i + 1 :])
    phase = todo[i]
    allowed = left - later if phase.takes_slack else min(scale * phase.budget_s, left - later)
    return min(max(allowed, 0.0), max(left, 0.0))


def _budget_text(name: str) -> str:
    phase = next(p for p in PHASES if p.name == name)
    return f"{phase.budget_s}+" if phase.takes_slack else str(phase.budget_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="every phase at toy sizes on the CPU (Triton interpreter)")
    p.add_argument("--only", default=None, help="comma-separated phases to run (default: all, in order)")
    p.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results (dry run: a temp dir)")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="the carried wheels (default benchmarks/.wheels)")
    p.add_argument("--measure-env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-l2", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [ph.name for ph in PHASES]
    args.only = names if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        p.error(f"unknown phase(s) {unknown}; choose from {names}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure_env or args.measure_l2:
        (measure_env if args.measure_env else measure_l2)(args.results_dir, args.dry_run)
        return 0
    t0 = time.time()
    results = args.results_dir or (Path(tempfile.mkdtemp(prefix="gpu_check_")) if args.dry_run else harness.RESULTS_DIR)
    logs = results / "gpu_check"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "gpu_check.log"
    log_path.write_text("")

    def log(text: str) -> None:
        line = f"gpu_check [{time.time() - t0:5.0f} s] {text}\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        with open(log_path, "a") as f:
            f.write(line)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env.setdefault("TRITON_INTERPRET", "1")  # ours takes its Triton path on the CPU, as it does on the GPU
    tmp = tempfile.gettempdir()
    site = Path(tempfile.mkdtemp(prefix="grpo_bench_site_") if args.dry_run else f"{tmp}/grpo_bench_site")
    paths = [str(harness.REPO_ROOT), env.get("PYTHONPATH", ""), str(site)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    revision = harness.git_revision()
    if revision:
        env[harness.REVISION_ENV] = revision  # the children record it even where they can't ask git
    slug = "cpu" if args.dry_run else "cuda-" + harness.slug(_gpu_name())
    ctx = {
        "python": sys.executable, "dry": args.dry_run, "results": results, "logs": logs, "log_path": log_path,
        "script": str(Path(__file__).resolve()), "env": env, "t0": t0,
        "loss_stem": f"dry-{slug}" if args.dry_run else slug, "linear_stem": f"linear-{slug}",
    }  # fmt: skip
    summary: dict[str, Any] = {"git": revision, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
                               "budgets_s": {p.name: p.budget_s for p in PHASES}, "phases": []}  # fmt: skip
    # The dry run's budgets are stretched: it checks the code paths, on a CPU that may be shared and slow.
    scale = 3 if args.dry_run else 1
    todo = [ph for ph in PHASES if ph.name in args.only]
    limit = scale * (TOTAL_S if len(todo) == len(PHASES) else max(60, sum(p.budget_s for p in todo)))
    log(f"git {revision}; results in {results}; at most {limit} s")
    deadline = t0 + limit
    summary["limit_s"] = limit
    for i, phase in enumerate(todo):
        allowed = allowance(todo, i, deadline - time.time(), scale)
        if i == 0:  # the install is part of the first phase's time (env's, unless --only leaves it out)
            t_install = time.time()
            install_carried_wheels(args.wheels, site, log, deadline=t_install + allowed)
            allowed = max(0.0, allowed - (time.time() - t_install))
        if allowed < 5:
            summary["phases"].append({"phase": phase.name, "budget_s": phase.budget_s, "wall_s": 0, "rc": "skipped",
                                      "timed_out": True, "commands": []})  # fmt: skip
            log(f"{phase.name}: skipped, no time left")
            continue
        ctx["phase_deadline"] = time.time() + allowed
        log(f"phase {phase.name}: up to {allowed:.0f} s")
        result = run_phase(phase, ctx, log)
        summary["phases"].append(result)
        summary["elapsed_s"] = time.time() - t0
        log(f"phase {phase.name}: exit {result['rc']} in {result['wall_s']} s")
        write_summary(summary, ctx)
    summary["elapsed_s"] = time.time() - t0
    write_summary(summary, ctx)
    print((logs / "gpu_check.md").read_text(), flush=True)
    failed = [r for r in summary["phases"] if r["rc"] not in (0, "skipped")]
    return 1 if failed else 0


def _gpu_name() -> str:
    """The GPU's name without starting CUDA in this process (the phases' processes need all of its memory)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout  # fmt: skip
        return out.strip().splitlines()[0] if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
