"""Smoke tests of the benchmarks at toy sizes: the GPU check's dry run (every phase, on the CPU, with trl made
unimportable) and the CPU table's fresh-process mode leave JSON, markdown and PNG that say what they should.
torch.compile and TRL are left out for time (compiling or importing them takes 10-40 s on the 2-core machine); the
full CPU run covers them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench_loss, gpu_check
from benchmarks.lib import harness
from benchmarks.lib.contenders import FAULT_ENV

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ["eager", "liger", "ours", "ours_inplace"]  # liger: a row that says why it didn't run, never a gap
RAN = ["eager", "ours", "ours_inplace"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()  # the benchmark sets them for its own run
    yield
    torch.set_num_threads(threads)


def _check_results(stem: Path, mode: str, tokens: list[int], vocab: int, contenders=CONTENDERS, broken=()) -> dict:
    ran = [c for c in RAN if c in contenders]
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["mode"] == mode
    assert payload["device"]["type"] == "cpu" and payload["device"]["name"]
    assert payload["versions"]["torch"] and "liger-kernel" in payload["versions"] and "trl" in payload["versions"]
    assert payload["copy_bandwidth"]["GBps"] > 0
    assert "one read of the logits" in payload["bytes_counted"]
    assert list(payload["contenders"]) == contenders
    records = {(r["contender"], r["BT"]): r for r in payload["records"]}
    assert set(records) == {(c, bt) for c in contenders for bt in tokens}
    for bt in tokens:
        liger = records["liger", bt]
        assert liger["status"] in ("missing", "unsupported") and liger["note"], liger
        for name in ran:
            r = records[name, bt]
            if (name, bt) in broken:
                assert r["status"] == "error" and "broke the CUDA context" in r["note"], r
                continue
            assert r["status"] == "ok", r
            assert r["V"] == vocab and r["B"] * r["T"] == bt
            t = r["time_ms"]
            assert 0 < t["p20"] <= t["median"] <= t["p80"] and t["n"] >= 1
            assert r["peak_bytes"] is not None and r["peak_bytes"] >= 0
            assert r["GBps"] > 0 and r["copy_bw_fraction"] > 0
            # Every contender computes the same loss and gradient on the same inputs.
            assert r["checked_against"] == ("eager" if "eager" in contenders else "ours")
            assert r["loss_rel_diff"] < 1e-5 and r["grad_norm_rel_diff"] < 1e-4, r
            assert math.isfinite(r["loss"])
        assert records["ours", bt]["time_vs_ours"] == 1.0
    md = stem.with_suffix(".md").read_text()
    assert payload["device"]["name"] in md.splitlines()[0]
    assert "| V | B·T | contender | median ms |" in md and "## Headline" in md
    for name in ran:
        rows = [line for line in md.splitlines() if line.startswith(f"| {vocab} | ") and f"| {name} |" in line]
        assert len(rows) == len(tokens), rows
    assert "**missing**" in md or "**unsupported**" in md
    png = stem.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    return payload


def test_quantiles():
    assert harness.quantile([5, 1, 4, 2, 3], 0.5) == 3
    assert harness.quantile([1, 2, 3, 4, 5], 0.2) == pytest.approx(1.8)
    stats = harness.summarize_ms([10.0, 1.0, 2.0])
    assert (stats["p20"], stats["median"], stats["n"]) == (pytest.approx(1.4), 2.0, 3)


def test_revision_without_git(tmp_path, monkeypatch):
    """A checkout that travelled without its .git still records its revision: the variable, else the file."""
    monkeypatch.setattr(harness, "_git_head", lambda: None)
    monkeypatch.setattr(harness, "REVISION_FILE", tmp_path / "REVISION")
    monkeypatch.delenv(harness.REVISION_ENV, raising=False)
    assert harness.git_revision() is None
    (tmp_path / "REVISION").write_text("abc123+dirty\n")
    assert harness.git_revision() == "abc123+dirty (recorded by fetch_wheels.sh)"
    monkeypatch.setenv(harness.REVISION_ENV, "def456")
    assert harness.git_revision() == "def456"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead, not reaped


def test_phase_timeout_kills_its_processes(tmp_path):
    """A phase's command that outlives its budget is killed with the processes it started; its output is logged."""
    child = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    ctx = {"log_path": tmp_path / "log", "env": dict(os.environ)}
    assert gpu_check._run([sys.executable, "-c", child], 3.0, ctx) == "timeout"
    grandchild = int((tmp_path / "log").read_text().split()[0])
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert gpu_check._run([sys.executable, "-c", "print('done')"], 30.0, ctx) == 0


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module `name` (VALUE = 1)."""
    import base64
    import hashlib
    import zipfile

    tags = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": tags,
    }

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{name}-1.0.dist-info/RECORD"] = record + f"{name}-1.0.dist-info/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return path


def test_carried_wheels_install_only_what_is_missing(tmp_path):
    """The env phase installs a carried wheel whose module is missing (from the file, --no-index), not one whose
    module this Python has."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "grpo_bench_probe")
    _wheel(wheels, "pytest")  # present here: left alone
    installed = gpu_check.install_carried_wheels(wheels, site, lambda text: None)
    assert installed == ["grpo_bench_probe-1.0-py3-none-any.whl"]
    assert (site / "grpo_bench_probe" / "__init__.py").read_text() == "VALUE = 1\n"
    assert not (site / "pytest").exists()


def test_gpu_check_dry_run_without_trl(tmp_path):
    """`gpu_check.py --dry-run`: every phase, in order, on the CPU under the Triton interpreter, where trl fails to
    import. The kernel tests still run, trl's tests skip instead of aborting the collection, a fake sticky CUDA error
    of ours_inplace at the second loss shape costs that row only, and $OUT gets the bundle."""
    fake = tmp_path / "site"
    (fake / "trl").mkdir(parents=True)
    (fake / "trl" / "__init__.py").write_text("raise ModuleNotFoundError('simulated: trl is missing', name='trl')\n")
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(REPO)]), OUT=str(out))
    env[FAULT_ENV] = "ours_inplace@24"
    env.pop(harness.REVISION_ENV, None)
    (tmp_path / "wheels").mkdir()  # none carried: the env phase installs nothing, whatever this checkout holds
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--results-dir", str(results)]
    cmd += ["--wheels", str(tmp_path / "wheels")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((results / "gpu_check" / "gpu_check.json").read_text())
    phases = [p["phase"] for p in summary["phases"]]
    assert phases == list(summary["budgets_s"]) and sum(summary["budgets_s"].values()) <= 480
    assert all(p["rc"] == 0 and not p["timed_out"] for p in summary["phases"]), summary["phases"]
    log = (results / "gpu_check" / "gpu_check.log").read_text()
    assert "6 skipped" in log  # tests/test_gpu.py collected and reported (no CUDA here)
    assert "test_reference_vs_trl.py" in log and "trl does not import" in log
    assert summary["git"] and summary["git"] in log
    ceilings = json.loads(next(results.glob("ceilings-cpu-*.json")).read_text())
    assert ceilings["copy_bandwidth"]["GBps"] > 0 and ceilings["matmul"]["TFLOPs"] > 0
    l2 = json.loads(next(results.glob("l2-cpu-*.json")).read_text())["shapes"][0]
    assert set(l2["schedules"]) == {"copy", "read", "stats_only", "fused_one_read", "stats_then_grad"}, l2
    assert l2["schedules"]["copy"]["implied_S"] == pytest.approx(2.0) and "reread_from_dram" in l2
    contenders = ["eager", "liger", "ours", "ours_inplace"]
    payload = _check_results(results / "dry-cpu", "dry-run", [16, 24], 64, contenders, {("ours_inplace", 24)})
    assert payload["git"] == summary["git"]
    linear = json.loads((results / "linear-cpu.json").read_text())
    assert [(r["tokens"], r["width"], r["vocab"]) for r in linear["rows"]] == [(32, 16, 100), (48, 16, 77)]
    for row in linear["rows"]:
        assert row["contenders"]["fused_linear"]["status"] == "ok" and row["reference"]["status"] == "ok"
        assert row["contenders"]["liger"]["status"] == "missing"
        ref = row["reference"]["loss"]
        assert abs(row["contenders"]["fused_linear"]["loss"] - ref) <= 1e-5 * abs(ref)
    assert "| 48 | 16 | 77 | fused_linear |" in (results / "linear-cpu.md").read_text()
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"dry-cpu.json", "dry-cpu.png", "linear-cpu.md", "gpu_check/gpu_check.log"} <= names, names
    assert (out / "gpu_check.md").read_text().startswith("# GPU check (dry run)")


def test_cpu_mode_fresh_processes(tmp_path):
    """The CPU table's mode: one fresh worker process per contender, shape and round (one worker here, for time: the
    dry run above compares the contenders; the parent runs in this process to spare a second start of torch)."""
    stem = tmp_path / "cpu"
    contenders = ["liger", "ours"]
    argv = ["--device", "cpu", "--contenders", ",".join(contenders), "--tokens", "64", "--vocabs", "500",
            "--rounds", "1", "--reps", "2", "--warmup", "1", "--worker-timeout-s", "100",
            "--out", str(stem)]  # fmt: skip
    assert bench_loss.main(argv) == 0
    payload = _check_results(stem, "cpu", [64], 500, contenders)
    assert "fresh process" in payload["peak_memory_method"]
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    assert ok and all(r["inputs_bytes"] > 0 and r["cpu_time_ms"]["median"] > 0 for r in ok)
    assert all(r["first_call_ms"]["median"] > 0 and r["build_ms"]["median"] >= 0 for r in ok)
    md = stem.with_suffix(".md").read_text()
    assert "CPU-time ms" in md and "first call ms" in md and "First call:" in md


def test_cpu_default_shapes():
    """The CPU table's default shapes: V=32000 at three B·T and Qwen's vocabulary at B·T=1024, all fp32."""
    args = bench_loss.parse_args(["--device", "cpu"])
    assert args.shapes == [("fp32", 32000, 1024), ("fp32", 32000, 2048), ("fp32", 32000, 4096), ("fp32", 151936, 1024)]
    assert bench_loss.parse_args(["--device", "cpu", "--tokens", "64"]).shapes == [
        ("fp32", 32000, 64),
        ("fp32", 151936, 64),
    ]
