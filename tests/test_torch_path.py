"""The CPU path (backend="torch") against the float64 oracle, over shapes, dtypes, masks and options: every test runs
on the fused C rows (ops/cpu_rows.py) and on the chunked torch rows they fall back to (ops/torch_rows.py)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from grpo_kernels import GRPOLoss, grpo_loss, selective_log_softmax
from grpo_kernels.ops import cpu_rows, torch_rows
from reference import reference_selective_log_softmax

from .oracle_check import (
    TOLERANCES,
    assert_close,
    assert_grad_close,
    cases,
    check_cancelling_coefficient,
    check_case,
    check_large_log_ratios,
    check_masked_inputs_are_absent,
    masked_sentinel_cases,
)

pytestmark = pytest.mark.usefixtures("nan_empty", "cpu_path")


@pytest.fixture(autouse=True, params=["fused", "chunked"])
def cpu_path(request, monkeypatch):
    """Which rows backend="torch" runs on: the C extension, or the torch fallback (GRPO_KERNELS_CPU_ROWS=0)."""
    if request.param == "fused" and not cpu_rows.available():
        pytest.skip("the _cpu_rows extension is not built (pip install -e .)")
    if request.param == "chunked":
        monkeypatch.setenv("GRPO_KERNELS_CPU_ROWS", "0")
    return request.param
FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@FAST
@given(case=cases())
def test_matches_oracle(case):
    check_case(case, backend="torch")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_inplace_backward_matches_oracle(case):
    check_case(case, backend="torch", inplace=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(max_vocab=300))
def test_rows_split_across_chunks(case, monkeypatch, cpu_path):
    if cpu_path == "fused":
        pytest.skip("chunks are the torch rows' own")
    monkeypatch.setattr(torch_rows, "CHUNK_ELEMENTS", 64)  # a few rows per chunk, and one row wider than a chunk
    check_case(case, backend="torch")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(pair=masked_sentinel_cases())
def test_masked_inputs_are_absent(pair):
    """NaN, ±inf and −1e4 at masked positions (logits rows, ℓ_old, ℓ_ref, ℓ_s, ρ, A), every loss type and option:
    loss, gradient and metrics are those of the same batch with finite values there."""
    check_masked_inputs_are_absent(*pair, backend="torch")


@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.7, "loss_type": "sapo"}, {"importance_sampling_level": "sequence", "loss_type": "cispo"}],
)
def test_log_ratios_are_exact_for_large_logp(options):
    check_large_log_ratios("torch", options)


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 0.7}, {"importance_sampling_level": "sequence"}, {"loss_type": "grpo"}]
)
def test_cancelling_coefficient_is_exact(options):
    check_cancelling_coefficient("torch", options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_selective_log_softmax_gradients_through_both(dtype):
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(2, 6, 37, generator=gen) * 2).to(dtype)
    ids = torch.randint(0, 37, (2, 5), generator=gen)
    w_logp, w_ent = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    x = full.clone().requires_grad_(True)
    logp, ent = selective_log_softmax(x[:, :-1], ids, temperature=0.8, backend="torch")
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    x64 = full.double().requires_grad_(True)
    rlogp, rent = reference_selective_log_softmax(x64[:, :-1], ids, temperature=0.8)
    ((rlogp * w_logp.double()).sum() + (rent * w_ent.double()).sum()).backward()
    tol = TOLERANCES[dtype]
    assert_close("logp", logp, rlogp.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("entropy", ent, rent.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_grad_close(x.grad, x64.grad, dtype, upstream_is_one=False)


def test_nan_in_logits_propagates_to_the_loss():
    x = torch.randn(2, 3, 7)
    x[1, 2, 4] = math.nan
    out = grpo_loss(x.requires_grad_(), torch.randint(0, 7, (2, 3)), torch.ones(2), backend="torch")
    assert torch.isnan(out.loss)
    assert torch.isnan(out.logp[1, 2]) and torch.isfinite(out.logp[0]).all()


def test_padded_vocabulary_gives_finite_results():
    x = torch.randn(2, 3, 8)
    x[..., 5:] = -math.inf
    out = grpo_loss(x.requires_grad_(), torch.randint(0, 5, (2, 3)), torch.ones(2), entropy_coef=0.1, backend="torch")
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.entropy).all()
    assert torch.isfinite(x.grad).all() and (x.grad[..., 5:] == 0).all()


def test_module_form_equals_function():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, generator=gen)
    ids, adv = torch.randint(0, 9, (2, 4), generator=gen), torch.randn(2, generator=gen)
    ref = torch.randn(2, 4, generator=gen) - 2
    module = GRPOLoss(loss_type="dapo", beta=0.1, backend="torch")
    a = module(x, ids, adv, ref_logp=ref)
    b = grpo_loss(x, ids, adv, ref_logp=ref, loss_type="dapo", beta=0.1, backend="torch")
    assert torch.equal(a.loss, b.loss) and "loss_type='dapo'" in repr(module)


def test_no_grad_forward_gives_the_same_loss():
    gen = torch.Generator().manual_seed(2)
    x, ids, adv = (
        torch.randn(2, 3, 11, generator=gen),
        torch.randint(0, 11, (2, 3), generator=gen),
        torch.randn(2, generator=gen),
    )
    with torch.no_grad():
        plain = grpo_loss(x, ids, adv, backend="torch")
    graded = grpo_loss(x.clone().requires_grad_(), ids, adv, backend="torch")
    assert plain.loss.grad_fn is None
    assert torch.equal(plain.loss, graded.loss.detach())
