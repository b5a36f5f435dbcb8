"""A pytest plugin that collects the suite as the GPU machine would, on any machine: CUDA present (torch's
availability monkeypatched), TRITON_INTERPRET unset, and the Triton and numpy versions the conftest sees set to
that machine's (3.6.0 and 2.5.2 unless SIMULATED_TRITON / SIMULATED_NUMPY say otherwise). Nothing runs: each test
collected is reported as it would be selected there, "run", "skip" (with the reason) or "deselected", as JSON in
the file SIMULATED_REPORT names, and as a table per module at the end of the output.

    python -m pytest --collect-only -q -p tests.simulated_gpu_machine tests

It must load before tests/conftest.py (`-p` plugins do), which reads all of this when it is imported.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from importlib import metadata

import pytest
import torch
from _pytest.skipping import evaluate_skip_marks

VERSIONS = {"triton": os.environ.get("SIMULATED_TRITON", "3.6.0"), "numpy": os.environ.get("SIMULATED_NUMPY", "2.5.2")}

os.environ.pop("TRITON_INTERPRET", None)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
_real_version = metadata.version
metadata.version = lambda dist: VERSIONS.get(dist) or _real_version(dist)  # what tests/conftest.py reads

_selection: dict[str, dict] = {}


def _params(item: pytest.Item) -> list[str]:
    """The test's parameters that are strings (a backend's name, say)."""
    spec = getattr(item, "callspec", None)
    return [] if spec is None else [v for v in spec.params.values() if isinstance(v, str)]


@pytest.hookimpl(trylast=True)  # after the conftest's own selection (the gpu marker)
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        skip = evaluate_skip_marks(item)
        _selection[item.nodeid] = {
            "outcome": "skip" if skip else "run",
            "reason": skip.reason if skip else "",
            "markers": sorted({m.name for m in item.iter_markers()}),
            "params": _params(item),
        }


def pytest_deselected(items):
    for item in items:
        _selection[item.nodeid] = {"outcome": "deselected", "reason": "", "markers": [], "params": _params(item)}


def pytest_collectreport(report):
    if report.skipped:  # a module that skips itself at import
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _selection[report.nodeid] = {"outcome": "skip", "reason": reason, "markers": [], "params": []}
    elif report.failed:
        _selection[report.nodeid] = {"outcome": "error", "reason": str(report.longrepr)[-300:], "markers": [],
                                     "params": []}  # fmt: skip


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("SIMULATED_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_selection, f, indent=1)
    per_module: dict[str, Counter] = {}
    for nodeid, r in _selection.items():
        per_module.setdefault(nodeid.split("::")[0], Counter())[r["outcome"]] += 1
    terminalreporter.write_line(f"On a CUDA machine, TRITON_INTERPRET unset, Triton {VERSIONS['triton']}, numpy "
                                f"{VERSIONS['numpy']}: run / skip / deselected / error")  # fmt: skip
    for module, n in sorted(per_module.items()):
        terminalreporter.write_line(f"  {module}: {n['run']} / {n['skip']} / {n['deselected']} / {n['error']}")
    for reason, n in Counter(r["reason"] for r in _selection.values() if r["outcome"] == "skip").most_common():
        terminalreporter.write_line(f"  skipped x{n}: {reason}")
