"""The ground every benchmark stands on: quantiles, the machine, versions and git revision it ran on, peak host
memory, and atomic writes of the files it leaves in benchmarks/results/. Imports nothing heavier than torch, so a
script stays importable where a contender (trl, liger-kernel) is missing.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent
# Where the revision comes from on a machine the checkout reached without its .git (a GPU machine): this variable,
# else the file benchmarks/fetch_wheels.sh writes beside the wheels it fetches (that folder travels with the run).
REVISION_ENV = "GRPO_BENCH_GIT_REVISION"
REVISION_FILE = BENCH_DIR / ".wheels" / "REVISION"

# Packages whose versions go into every result file; None where not installed (a contender is then "missing").
PACKAGES = ("torch", "triton", "trl", "liger-kernel", "transformers", "grpo-kernels", "numpy", "matplotlib")


# ----------------------------------------------------------------------------------------------------------------
# Statistics


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), without importing numpy."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(times_ms: list[float]) -> dict[str, float]:
    """Median and the 20th/80th percentiles: robust to the odd slow repeat, and honest about the spread."""
    return {
        "median": quantile(times_ms, 0.5),
        "p20": quantile(times_ms, 0.2),
        "p80": quantile(times_ms, 0.8),
        "n": len(times_ms),
    }


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


# ----------------------------------------------------------------------------------------------------------------
# Where it ran


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["grpo-kernels"] is None:  # run from a checkout that isn't pip-installed (a GPU machine): say so
        try:
            import grpo_kernels

            out["grpo-kernels"] = f"{grpo_kernels.__version__} (from the checkout, not installed)"
        except ImportError:
            pass
    return out


def git_revision() -> str | None:
    """HEAD of this checkout, with '+dirty' when the working tree differs from it (numbers from uncommitted code);
    without a .git, the revision recorded before the checkout travelled (REVISION_ENV, then REVISION_FILE)."""
    return _git_head() or os.environ.get(REVISION_ENV) or _recorded_revision()


def _recorded_revision() -> str | None:
    try:
        text = REVISION_FILE.read_text().strip()
    except OSError:
        return None
    return f"{text} (recorded by fetch_wheels.sh)" if text else None


def _git_head() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            check=False,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def total_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": device, "host_cpu": cpu_model(), "host_cpu_count": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False,
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info.update(
            name=cpu_model(),
            torch_threads=torch.get_num_threads(),
            memory_bytes=total_memory_bytes(),
            load_average=list(os.getloadavg()),
        )
    return info


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def device_slug(info: dict[str, Any]) -> str:
    """File stem for benchmarks/results/: 'cuda-NVIDIA-H200', 'cpu-AMD-EPYC'."""
    return f"{info['type']}-{slug(info['name'])}"


# ----------------------------------------------------------------------------------------------------------------
# Peak host memory of this process (CPU mode runs each contender in a fresh process)


def _proc_status_kib(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import resource  # not Linux: fall back to the high-water mark

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) from the current RSS; False where the kernel can't."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024  # within 1 MiB: the reset took


def peak_rss_bytes() -> int:
    kib = _proc_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# ----------------------------------------------------------------------------------------------------------------
# Output


def fmt_bytes(n: float | None) -> str:
    if n is None or not math.isfinite(float(n)):
        return "–"
    n = float(n)
    if abs(n) >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.0f} MiB"


def markdown_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" * len(headers)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False, allow_nan=True) + "\n")
    tmp.replace(path)  # a run killed mid-write leaves the previous complete file


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # as write_json: a run killed mid-write leaves the previous complete file
