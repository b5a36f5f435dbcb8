"""grpo_loss(backend="triton") end to end against the float64 oracle: the one-read token-level kernel and the
two-read sequence-level path, through the public API. On a CPU this runs under TRITON_INTERPRET=1 (slow, so
fewer examples than the torch path; the row kernels have their own, wider tests in tests/ops)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from grpo_kernels import grpo_loss, selective_log_softmax
from reference import reference_selective_log_softmax

from .conftest import needs_triton_cpu
from .oracle_check import (
    TOLERANCES,
    assert_close,
    assert_grad_close,
    cases,
    check_case,
    check_large_log_ratios,
    check_masked_inputs_are_absent,
    masked_sentinel_cases,
)

pytestmark = [
    pytest.mark.usefixtures("nan_empty"),
    needs_triton_cpu,  # CPU tensors throughout: the interpreter runs them
]
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(case=cases(token_level_only=True))
def test_one_read_token_level_kernel_matches_oracle(case):
    check_case(case, backend="triton")


@SETTINGS
@given(case=cases())
def test_every_option_matches_oracle(case):
    check_case(case, backend="triton")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_inplace_backward_matches_oracle(case):
    check_case(case, backend="triton", inplace=True)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(pair=masked_sentinel_cases())
def test_masked_inputs_are_absent(pair):
    """As tests/test_torch_path.py's, through both Triton paths (the one-read kernel, stats + row gradient)."""
    check_masked_inputs_are_absent(*pair, backend="triton")


def test_log_ratios_are_exact_for_large_logp():
    """The one-read kernel (ℓ in fp64 registers) and the two-read path (ℓ from the row state), |ℓ| 1e3 to 1e4."""
    for options in ({}, {"temperature": 0.7, "loss_type": "sapo"}, {"importance_sampling_level": "sequence"}):
        check_large_log_ratios("triton", options)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax(dtype):
    gen = torch.Generator().manual_seed(3)
    full = (torch.randn(2, 5, 50, generator=gen) * 3).to(dtype)
    ids = torch.randint(0, 50, (2, 4), generator=gen)
    w = torch.randn(2, 4, generator=gen)
    x = full.clone().requires_grad_(True)
    logp, ent = selective_log_softmax(x[:, 1:], ids, temperature=1.1, backend="triton")
    (logp * w + ent).sum().backward()
    x64 = full.double().requires_grad_(True)
    rlogp, rent = reference_selective_log_softmax(x64[:, 1:], ids, temperature=1.1)
    (rlogp * w.double() + rent).sum().backward()
    tol = TOLERANCES[dtype]
    assert_close("logp", logp, rlogp.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("entropy", ent, rent.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_grad_close(x.grad, x64.grad, dtype, upstream_is_one=False, oracle_error=1e-15)


def test_triton_and_torch_backends_agree_on_metrics():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, 40, generator=gen)
    ids, adv = torch.randint(0, 40, (3, 6), generator=gen), torch.randn(3, generator=gen)
    old = torch.randn(3, 6, generator=gen) * 0.2 - 3.7
    a = grpo_loss(x, ids, adv, old_logp=old, backend="triton")
    b = grpo_loss(x, ids, adv, old_logp=old, backend="torch")
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        torch.testing.assert_close(a.metrics[k], b.metrics[k], rtol=1e-5, atol=1e-6)
