"""The suite's own selection, right on any machine: on the GPU machine (CUDA present, TRITON_INTERPRET unset, Triton
3.6 with numpy 2.5, whose interpreter cannot run), simulated here by tests/simulated_gpu_machine.py, every test that
sends CPU tensors to backend="triton" and every dry run skips, saying why, and everything else is selected to run,
the `gpu`-marked tests included. The version rule itself is checked on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import interpreter_blocker

REPO = Path(__file__).resolve().parent.parent
# The modules whose selection turns on CUDA and the interpreter (the rest of the suite selects alike everywhere).
MODULES = [
    "tests/test_triton_path.py",
    "tests/test_per_token.py",
    "tests/test_vocab_parallel.py",
    "tests/test_fused_linear.py",
    "tests/test_fused_linear_log_softmax.py",
    "tests/test_fused_linear_distributed.py",
    "tests/test_gpu.py",
    "tests/test_benchmarks.py",
]
DRY_RUNS = ["test_gpu_check_dry_run", "test_headline_killed_after_its_first_contender_keeps_ours"]
# Tests that call backend="triton" on CPU tensors in their body rather than through a parameter.
TRITON_IN_BODY = ["test_float64_is_refused_by_name_on_triton", "test_l2_grid_switch_is_set_and_undone"]


@pytest.mark.parametrize(
    ("triton", "numpy", "blocked"),
    [
        ("3.6.0", "2.5.2", True),  # the GPU machine
        ("3.5.1", "2.4.0", True),  # the oldest supported Triton, the first numpy that breaks it
        ("3.6.0", "2.3.5", False),  # CI's pin (numpy < 2.4)
        ("3.9.0", "2.5.2", False),  # fixed after 3.6
        ("3.7.0+git1234", "2.4.0rc1", False),
    ],
)
def test_interpreter_blocker(triton, numpy, blocked):
    reason = interpreter_blocker(triton, numpy)
    assert (reason is not None) == blocked
    if blocked:
        assert triton in reason and numpy in reason
    assert interpreter_blocker(None, numpy) == "Triton is not installed"


def test_selection_on_the_gpu_machine(tmp_path):
    report = tmp_path / "selection.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SIMULATED_REPORT=str(report), SIMULATED_TRITON="3.6.0", SIMULATED_NUMPY="2.5.2")
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.simulated_gpu_machine", "-p",
           "no:cacheprovider", "-p", "no:xdist", *MODULES]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selection = json.loads(report.read_text())
    assert {nodeid.split("::")[0] for nodeid in selection} == set(MODULES)
    assert not [n for n, r in selection.items() if r["outcome"] in ("error", "deselected")]

    cpu_triton = {n for n, r in selection.items() if "triton" in r["params"] or n.startswith(MODULES[0])}
    dry_runs = {n for n in selection if n.split("::")[-1] in DRY_RUNS}
    also = {n for n in selection if n.split("::")[-1] in TRITON_IN_BODY}
    assert len(cpu_triton) > 30 and len(dry_runs) == len(DRY_RUNS) and len(also) == len(TRITON_IN_BODY)
    for nodeid in cpu_triton | also:
        assert selection[nodeid]["outcome"] == "skip", nodeid
        assert selection[nodeid]["reason"].startswith("Triton runs CPU tensors only under its interpreter"), nodeid
    for nodeid in dry_runs:
        assert selection[nodeid] | {"reason": ""} == {"outcome": "skip", "reason": "", "markers": ["skipif"],
                                                      "params": []}, nodeid  # fmt: skip
        assert "Triton 3.6.0's interpreter cannot run under numpy 2.5.2" in selection[nodeid]["reason"]
    rest = {n: r for n, r in selection.items() if n not in cpu_triton | dry_runs | also}
    skipped = [n for n, r in rest.items() if r["outcome"] != "run"]
    assert not skipped, skipped  # the torch twins, the GPU tests and the benchmarks' other tests all run there
    gpu = [n for n, r in rest.items() if "gpu" in r["markers"]]
    assert len(gpu) >= 8 and {n.split("::")[0] for n in gpu} == {"tests/test_gpu.py", "tests/test_fused_linear.py"}
    assert any("torch" in r["params"] for r in rest.values())
