"""The core installs what the loss needs and nothing more: torch, triton, numpy. The trainer's libraries come with
the [train] extra; without them the loss API still imports and runs, and the trainer fails at import with one line
naming the extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from grpo_kernels.extras import TRAIN_MODULES

REPO = Path(__file__).resolve().parents[1]

# A fresh interpreter in which the [train] and [trl] libraries cannot be imported, as after `pip install .`.
BLOCK = f"""
import importlib.abc, sys
BLOCKED = {(*TRAIN_MODULES, "trl")!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Absent())
import importlib.util
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in BLOCKED else _find_spec(name, *a)
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_core_depends_on_torch_triton_and_numpy_only():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for dep in project["dependencies"]}
    assert names == {"torch", "triton", "numpy"}, names
    train = {dep.split(">")[0].split("=")[0].replace("-", "_") for dep in project["optional-dependencies"]["train"]}
    assert train == set(TRAIN_MODULES), train


def test_the_loss_runs_without_the_extras():
    proc = _run(
        "import torch, grpo_kernels\n"
        "x = torch.randn(2, 3, 7, requires_grad=True)\n"
        "out = grpo_kernels.grpo_loss(x, torch.randint(0, 7, (2, 3)), torch.tensor([1.0, -1.0]))\n"
        "out.loss.backward()\n"
        "assert torch.isfinite(x.grad).all()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_trainer_without_its_extra_is_one_line_naming_it():
    proc = _run("import grpo_kernels.trainer\n")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: grpo_kernels.trainer needs the [train] extra"), proc.stderr[-2000:]
    assert "pip install 'grpo-kernels[train]'" in last and "transformers" in last, last


def test_the_command_without_its_extra_is_one_line_naming_it():
    proc = _run("from grpo_kernels.command import main\nsys.exit(main(['demo']))\n")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        and "grpo-kernels: the grpo-kernels command needs the [train] extra" in proc.stderr
    ), proc.stderr


def test_python_m_cli_without_its_extra_is_the_commands_one_line():
    run_as_main = "runpy.run_module('grpo_kernels.cli', run_name='__main__')"
    proc = _run(f"import runpy\nsys.argv = ['grpo_kernels.cli', 'demo']\n{run_as_main}\n")
    command = _run("from grpo_kernels.command import main\nsys.exit(main(['demo']))\n")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == command.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
