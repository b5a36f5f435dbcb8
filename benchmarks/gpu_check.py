"""The GPU check: the numbers that matter, most important first, each phase in its own process under its own timeout,
every result written as soon as it exists. One try of at most 8 minutes, by construction:

| phase | budget s | what it answers |
| --- | ---: | --- |
| env | 30 | the carried wheels installed; versions, device, L2; the copy-bandwidth and matrix-product ceilings |
| kernel_tests | 110 | tests/test_gpu.py: the kernels against the float64 oracle on the real device |
| loss_headline | 120 | the loss table's headline shape (bf16, V=151936, B·T=16384), every contender |
| l2 | 50 | the one-read fused kernel vs the stats + grad schedule vs a copy of the same bytes: implied DRAM traffic |
| linear_headline | 70 | the fused-linear table's headline shape (B·T=8192, H=4096, V=151936) |
| loss_rest | 40+ | the loss table's other shapes, while time remains (gets what earlier phases left over) |
| linear_rest | 15+ | the fused-linear table's other shapes, while time remains |
| other_gpu_tests | 0+ | the remaining `-m gpu` tests (torch.compile, fused linear), if any time is left |
| report | 15 | the loss plot, the summary |

The budgets sum to TOTAL_S = 450 s (7.5 minutes); a phase that ends early leaves its time to the '+' phases. A
phase that runs out of time is killed with its process group; what it wrote stays. Results go to benchmarks/results/
(or --results-dir), a summary (gpu_check.json, .md) and the log to gpu_check/ beside them, and, when $OUT is set,
everything again as gpu_check.tar.gz plus the summary and log, rewritten after every phase.

    bash benchmarks/gpu_check.sh                  # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --dry-run      # every phase's code path at toy sizes on the CPU (interpreter)
    python benchmarks/gpu_check.py --only l2      # one phase (names above, comma-separated)

It never installs from the network: the `env` phase installs the wheels that benchmarks/fetch_wheels.sh put in
benchmarks/.wheels/ (with pip --no-index), only for the modules this Python lacks.
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
from benchmarks.lib import harness  # noqa: E402

TOTAL_S = 450


@dataclass(frozen=True)
class Phase:
    name: str
    budget_s: int
    elastic: bool = False  # also gets the time earlier phases left unused


PHASES = (
    Phase("env", 30),
    Phase("kernel_tests", 110),
    Phase("loss_headline", 120),
    Phase("l2", 50),
    Phase("linear_headline", 70),
    Phase("loss_rest", 40, elastic=True),
    Phase("linear_rest", 15, elastic=True),
    Phase("other_gpu_tests", 0, elastic=True),
    Phase("report", 15),
)
assert sum(p.budget_s for p in PHASES) == TOTAL_S
WHEELS = harness.BENCH_DIR / ".wheels"
L2_SHAPES = [("bf16", 151936, 16384), ("fp32", 151936, 16384), ("bf16", 262144, 16384)]


def commands(phase: str, ctx: dict[str, Any]) -> list[list[str]]:
    """The processes of a phase, in order (the dry run: the same code paths at toy sizes on the CPU)."""
    py, dry, res, here = ctx["python"], ctx["dry"], ctx["results"], ctx["script"]
    loss, linear = str(res / ctx["loss_stem"]), str(res / ctx["linear_stem"])
    remaining = lambda: str(max(10, int(ctx["phase_deadline"] - time.time() - 20)))  # noqa: E731
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--continue-on-collection-errors"]
    if phase in ("env", "l2"):
        return [[py, here, f"--measure-{phase}", "--results-dir", str(res), *(["--dry-run"] if dry else [])]]
    if phase == "kernel_tests":
        return [[*pytest, "-v", "tests/test_gpu.py"]]  # -v: each result printed as it comes
    if phase == "other_gpu_tests":
        rest = ["tests/test_compile.py", "tests/reference/test_reference_vs_trl.py"] if dry else ["tests"]
        return [[*pytest, *rest, "-m", "gpu", "--ignore=tests/test_gpu.py"]]
    bench_loss = [py, "benchmarks/bench_loss.py", "--out", loss]
    bench_linear = [py, "benchmarks/bench_linear.py", "--out", linear]
    if dry:
        bench_loss += ["--dry-run", "--contenders", "eager,liger,ours,ours_inplace", "--reps", "2", "--min-reps", "1",
                       "--warmup", "1"]  # fmt: skip
        bench_linear += ["--tiny", "--device", "cpu", "--contenders", "materialized,fused_linear,liger", "--reps", "1",
                         "--warmup", "1"]  # fmt: skip
    else:
        bench_loss += ["--device", "cuda"]
        bench_linear += ["--device", "cuda"]
    if phase == "loss_headline":
        return [[*bench_loss, "--shapes", "fp32:64:16" if dry else "bf16:151936:16384", "--budget-s", remaining()]]
    if phase == "loss_rest":
        return [[*bench_loss, "--resume", *(["--shapes", "fp32:64:16,fp32:64:24"] if dry else []), "--budget-s",
                 remaining()]]  # fmt: skip
    if phase == "linear_headline":
        return [[*bench_linear, "--shapes", "32:16:100" if dry else "headline"]]
    if phase == "linear_rest":
        return [[*bench_linear, "--resume", "--shapes", "32:16:100,48:16:77" if dry else "rest", "--budget-s",
                 remaining()]]  # fmt: skip
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
        "copy_bandwidth": copy_bandwidth(device, (16 << 20) if dry else (4 << 30)),
        "matmul": matmul_rate(device, 256 if dry else 8192, torch.float32 if dry else torch.bfloat16),
    }
    stem = results / f"ceilings-{harness.device_slug(info)}"
    harness.write_json(stem.with_suffix(".json"), payload)
    harness.write_text(stem.with_suffix(".md"), report.ceilings_markdown(payload))
    print(report.ceilings_markdown(payload), flush=True)


def measure_l2(results: Path, dry: bool) -> None:
    from benchmarks.lib import report
    from benchmarks.lib.traffic import device_caches, measure_shape

    device = "cpu" if dry else "cuda"
    info = harness.device_info(device)
    payload: dict[str, Any] = {"device": info, "git": harness.git_revision(), "caches": device_caches(device)}
    payload["shapes"] = []
    stem = results / f"l2-{harness.device_slug(info)}"
    for dtype_name, vocab, tokens in [("fp32", 64, 8)] if dry else L2_SHAPES:
        payload["shapes"].append(measure_shape(dtype_name, vocab, tokens, device, reps=2 if dry else 10))
        harness.write_json(stem.with_suffix(".json"), payload)
        harness.write_text(stem.with_suffix(".md"), report.traffic_markdown(payload))
        print(report.traffic_markdown(payload), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The driver


def install_carried_wheels(wheels: Path, site: Path, log) -> list[str]:
    """pip install --no-index the wheels in `wheels` whose module this Python lacks, into `site`, one at a time, so
    that a wheel that does not fit costs its own module only. Returns the wheels installed."""
    import importlib.util

    done = []
    for wheel in sorted(wheels.glob("*.whl")):
        module = wheel.name.split("-")[0].lower()  # each carried wheel's module is its distribution's name
        if importlib.util.find_spec(module) is not None:
            continue
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), str(wheel)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
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
    lines = [
        f"# GPU check ({'dry run' if ctx['dry'] else 'cuda'}), git {summary['git']}",
        "",
        f"Started {summary['started']}; {summary['elapsed_s']:.0f} s of at most {summary['limit_s']} s so far.",
        "",
        harness.markdown_table(
            ["phase", "budget s", "wall s", "exit", "timed out"],
            [[r["phase"], r["budget_s"], r["wall_s"], r["rc"], "yes" if r["timed_out"] else ""] for r in
             summary["phases"]],  # fmt: skip
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
    log(f"git {revision}; results in {results}; at most {scale * TOTAL_S} s")
    deadline = t0 + scale * TOTAL_S
    summary["limit_s"] = scale * TOTAL_S
    todo = [ph for ph in PHASES if ph.name in args.only]
    for i, phase in enumerate(todo):
        later_fixed = scale * sum(p.budget_s for p in todo[i + 1 :] if not p.elastic)
        later_elastic = scale * sum(p.budget_s for p in todo[i + 1 :] if p.elastic)
        left = deadline - time.time()
        if phase.elastic:
            allowed = left - later_fixed - later_elastic
        else:
            allowed = min(scale * phase.budget_s, left - later_fixed - later_elastic)
        allowed = min(max(allowed, 0.0), left)
        if phase.name == "env":
            install_carried_wheels(args.wheels, site, log)
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
