"""The float64 oracle of the row backends (reference/, differentiated by autograd) and the checks against it, at the
bounds of docs/loss.md, "Tolerances" (tests/oracle_check.TOLERANCES). Shared by the Triton and C row tests."""

from __future__ import annotations

import torch

from reference import reference_selective_log_softmax

from ..oracle_check import TOLERANCES, ulp


def exact_rows(x: torch.Tensor, ids: torch.Tensor, tau: float):
    """The oracle's (logp, entropy) in float64 on the same input values, and its graph for `exact_grad`."""
    leaf = x.detach().double().requires_grad_(True)
    logp, entropy = reference_selective_log_softmax(leaf, ids, tau)
    return logp.detach(), entropy.detach(), (leaf, logp, entropy)


def exact_grad(graph, g: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """∂(Σ g·ℓ + Σ h·H)/∂logits of the oracle, float64."""
    leaf, logp, entropy = graph
    objective = (g.double() * logp).sum()
    if h is not None:
        objective = objective + (h.double() * entropy).sum()
    (grad,) = torch.autograd.grad(objective, leaf, retain_graph=True)
    return grad


def check_stats(name: str, ours: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(ours[~torch.isnan(exact)]).any(), f"{name}: a row was not written (NaN fill survived)"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        ours.double(), exact, rtol=tol["loss_rtol"], atol=tol["loss_atol"], equal_nan=True, msg=lambda m: f"{name}: {m}"
    )


def check_grad(ours: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    ours = ours.double()
    assert torch.equal(torch.isnan(ours), torch.isnan(exact)), (
        f"grad: NaN pattern differs ({int(torch.isnan(ours).sum())} NaN ours, {int(torch.isnan(exact).sum())} exact)"
    )
    finite = ~torch.isnan(exact)
    ours, exact = ours[finite], exact[finite]
    if exact.numel() == 0:
        return
    err = (ours - exact).abs()
    scale = exact.abs().max()
    tol = TOLERANCES[dtype]
    if dtype == torch.float32:
        bound = tol["grad_rtol_of_max"] * scale + torch.finfo(torch.float32).tiny
    else:
        # One ulp of the storage dtype per element, plus the shared fp32 floor for elements that are tiny only
        # because g and h·(z − Σpz) cancel (see oracle_check.TOLERANCES).
        bound = tol["grad_ulps"] * ulp(exact, dtype) + tol["grad_fp32_floor"] * scale
    bad = err > bound
    if bad.any():
        i = (err - bound).argmax()
        raise AssertionError(
            f"grad ({dtype}): {int(bad.sum())} elements off; worst exact {exact[i].item():.8e} ours "
            f"{ours[i].item():.8e} err {err[i].item():.3e} bound {bound if bound.dim() == 0 else bound[i]:.3e}"
        )
