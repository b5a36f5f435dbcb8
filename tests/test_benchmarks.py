"""Smoke test of benchmarks/bench_loss.py at toy sizes: both modes run and leave JSON, markdown and a PNG that say
what they should. torch.compile and TRL are left out here for time (compiling or importing them takes 10-40 s on
the 2-core machine); the full CPU run covers them."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
CONTENDERS = ["eager", "liger", "ours", "ours_inplace"]  # liger: a row that says why it didn't run, never a gap
RAN = ["eager", "ours", "ours_inplace"]


def _load(name: str):
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


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
    harness = _load("harness")
    assert harness.quantile([5, 1, 4, 2, 3], 0.5) == 3
    assert harness.quantile([1, 2, 3, 4, 5], 0.2) == pytest.approx(1.8)
    stats = harness.summarize_ms([10.0, 1.0, 2.0])
    assert (stats["p20"], stats["median"], stats["n"]) == (pytest.approx(1.4), 2.0, 3)


def test_dry_run_gpu_code_path(tmp_path, monkeypatch):
    """--dry-run: the GPU table's code path (a supervised child process, alternating rounds, in-place refills) on the
    CPU. A fake sticky CUDA error from ours_inplace at the second shape must cost that row only: a new child goes on
    without it."""
    bench = _load("bench_loss")
    monkeypatch.setenv(bench.FAULT_ENV, "ours_inplace@64")
    stem = tmp_path / "dry"
    argv = ["--dry-run", "--contenders", ",".join(CONTENDERS), "--tokens", "32,64", "--vocabs", "300",
            "--reps", "3", "--min-reps", "3", "--warmup", "1", "--out", str(stem)]  # fmt: skip
    assert bench.main(argv) == 0
    payload = _check_results(stem, "dry-run", [32, 64], 300, broken={("ours_inplace", 64)})
    assert any("ours_inplace broke the CUDA context" in note for note in payload["notes"])
    oracle = payload["reference_check"]
    assert oracle["status"] in ("ok", "unavailable", "error"), oracle
    if oracle["status"] == "ok":  # every contender's loss next to the float64 oracle's, on the first shape
        first = [r for r in payload["records"] if r["BT"] == 32 and r["status"] == "ok"]
        assert first and all(r["reference_rel_diff"] < 1e-5 for r in first), first
    assert all(r["time_ms"]["n"] == 3 for r in payload["records"] if r["status"] == "ok")


def test_cpu_mode_fresh_processes(tmp_path):
    """The CPU table's mode: one fresh worker process per contender, shape and round (one worker here, for time: the
    dry run above compares the contenders; the parent runs in this process to spare a second start of torch)."""
    bench = _load("bench_loss")
    stem = tmp_path / "cpu"
    contenders = ["liger", "ours"]
    argv = ["--device", "cpu", "--contenders", ",".join(contenders), "--tokens", "64", "--vocabs", "500",
            "--rounds", "1", "--reps", "2", "--warmup", "1", "--worker-timeout-s", "100",
            "--out", str(stem)]  # fmt: skip
    assert bench.main(argv) == 0
    payload = _check_results(stem, "cpu", [64], 500, contenders)
    assert "fresh process" in payload["peak_memory_method"]
    assert all(r["inputs_bytes"] > 0 for r in payload["records"] if r["status"] == "ok")
    assert all(r["cpu_time_ms"]["median"] > 0 for r in payload["records"] if r["status"] == "ok")
    assert "CPU-time ms" in stem.with_suffix(".md").read_text()
