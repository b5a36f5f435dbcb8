"""Test-wide setup: which Triton tests can run here, the Triton interpreter on a machine without a GPU, NaN-filled
allocations.

Two questions the suite keeps apart:
- TRITON_CPU: can Triton run CPU tensors? Only under its interpreter (TRITON_INTERPRET=1, set here when no CUDA
  device is present and the interpreter works). The tests that call backend="triton" on CPU tensors need it.
- ON_GPU: is there a CUDA device for compiled kernels? The `gpu`-marked tests need it, and the interpreter off
  (it would run them on the host, hours at their sizes).
On a CUDA machine without TRITON_INTERPRET the first kind skip and the second run; on a CPU machine the reverse.
"""

import os
from importlib import metadata
from pathlib import Path

# pytest-xdist workers (`-n 2`, the README's test command) run one intra-op thread each, as do the processes they
# start: torch reads the variable when it is first imported, below, and child processes inherit it. torch's default,
# a thread per core in every worker, oversubscribes the cores: OpenMP threads that spin-wait at the end of each
# parallel region then take turns with the other worker's. On the 2-core CI machine one thread per worker cut the
# suite's summed test time from 892 s to 763 s, TRL's parity module alone from 74 s to 9 s. A value set before pytest
# is kept; a test that needs more threads sets them itself (tests/ops/test_cpu_rows.py).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import settings


def interpreter_blocker(triton_version: str | None, numpy_version: str | None) -> str | None:
    """Why Triton's interpreter cannot run with these versions (None: it can). Triton 3.5/3.6's interpreter converts
    its one-element arrays to Python ints in a way numpy 2.4 rejects ("only 0-dimensional arrays can be converted to
    Python scalars" at every loop bound; triton-lang/triton#9171, fixed after 3.6)."""
    if triton_version is None:
        return "Triton is not installed"

    def release(version: str) -> tuple[int, int]:
        major, minor = [*version.split("+")[0].split("."), "0"][:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if numpy_version is not None and release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return f"Triton {triton_version}'s interpreter cannot run under numpy {numpy_version} (needs numpy < 2.4)"
    return None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


CUDA = torch.cuda.is_available()
INTERPRETER_BLOCKER = interpreter_blocker(_installed("triton"), _installed("numpy"))
if not CUDA and INTERPRETER_BLOCKER is None:
    # Must happen before triton is first imported, so the kernels run on the CPU in CI.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

TRITON_CPU = INTERPRETER and INTERPRETER_BLOCKER is None  # Triton runs CPU tensors (the interpreter)
ON_GPU = CUDA and not INTERPRETER  # a CUDA device runs compiled kernels
HAS_TRITON_DEVICE = TRITON_CPU  # the former name of TRITON_CPU, for the tests that still import it

if INTERPRETER_BLOCKER is not None:
    TRITON_CPU_REASON = f"Triton runs CPU tensors only under its interpreter: {INTERPRETER_BLOCKER}"
else:  # (unused where TRITON_CPU holds)
    TRITON_CPU_REASON = "Triton runs CPU tensors only under its interpreter: TRITON_INTERPRET=1 is not set" + (
        " (a CUDA device is present)" if CUDA else "")  # fmt: skip
GPU_REASON = "needs a CUDA GPU" if not CUDA else "needs compiled kernels: TRITON_INTERPRET=1 is set"
# The mark of a test that sends CPU tensors to backend="triton".
needs_triton_cpu = pytest.mark.skipif(not TRITON_CPU, reason=TRITON_CPU_REASON)

# Property tests draw the same examples on every run ("ci", the default), so a test suite that passed once passes
# again and CI cannot fail on a draw nobody saw. To search for new counterexamples, run them with
# HYPOTHESIS_PROFILE=explore (new random draws on each run).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture parameters), which the sort keeps
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None and not ON_GPU:  # not keywords: a folder named gpu is one
            item.add_marker(skip_gpu)
    # The `slow` tests first (otherwise in collection order): under pytest-xdist each worker takes the next test
    # when it is nearly idle (below), so the long ones start early and the workers end together on short ones.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config):
    """pytest-xdist: `-n N` alone (the README's test command) schedules with --dist loadgroup rather than xdist's
    default, load, which deals out a quarter of the tests round-robin before it looks at which worker is idle;
    loadgroup hands each test to a worker that has at most two left. (Its grouping by `xdist_group` is not used:
    with pytest 9.2 it does not group, pytest-xdist#1386.) Not an addopts entry: `--dist` is an unknown option
    where xdist is disabled (`-p no:xdist`). An explicit --dist is kept."""
    explicit = any(arg == "-d" or arg.startswith("--dist") for arg in map(str, config.invocation_params.args))
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "loadgroup"


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so an output element a kernel forgot fails.

    Kernel test modules opt in with `pytestmark = pytest.mark.usefixtures("nan_empty")`.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory) -> Path:
    """A folder of this test run that every xdist worker sees (their temporary folders share a parent), for work
    done once per run (tests/once.py)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def aot_cache(shared_tmp):
    """The folder of sm_90a/sm_100a compile results (tests/ops/hopper_aot.py's CompileCache) for this test run, one
    for all xdist workers: a specialization that test_hopper_compile.py and test_performance_model.py both compile
    is compiled once."""
    return shared_tmp / "aot-compile-cache"
