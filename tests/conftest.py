"""Test-wide setup: run the Triton kernels under the interpreter when no GPU is present, NaN-filled allocations."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton is first imported, so the kernels run on the CPU in CI.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run ("ci", the default), so a test suite that passed once passes
# again and CI cannot fail on a draw nobody saw. To search for new counterexamples, run them with
# HYPOTHESIS_PROFILE=explore (new random draws on each run).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ON_GPU = torch.cuda.is_available()
HAS_TRITON_DEVICE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not ON_GPU:  # not keywords: a folder named gpu is one
            item.add_marker(skip_gpu)


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
