"""The per-token coefficient's three copies (ops/coef.py) held to each other: the Triton (`_token_coef`) and C
(`token_coef`) copies against `loss_math`'s float64 definition, differentiated by autograd, on one table of inputs;
and the scalars both launchers pass, in `coef.FLOAT_FIELDS`'s order, against the kernels' own argument lists.

The logits are [1, T, 2] zeros with target 0: p = 1/2 and ℓ = −ln 2 for every token, so the kernels' ∂logits at
the target is g/2 exactly and g is read off it; the ratios, KL terms and masks come from the per-token inputs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from grpo_kernels.config import CLIPPED_LOSS_TYPES, LossConfig
from grpo_kernels.loss_math import TokenInputs, grpo_objective
from grpo_kernels.ops import coef, cpu_rows

from ..conftest import needs_triton_cpu

ROOT = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")

# One sequence of tokens: the ratio r = exp(ℓ − ℓ_old) from tiny to huge (none within 1e-3 of a clip edge, where
# an fp32 r and a float64 one could fall on different sides), advantages of both signs and 0, ρ, and ℓ_ref − ℓ kept
# >= 0.2 from 0 (1 − exp(ℓ_ref − ℓ) cancels there, past any fp32 tolerance). The last token is masked (weight 0)
# and holds non-finite inputs everywhere: its coefficient must be exactly 0.
RATIOS = [1e-6, 0.5, 0.79, 0.95, 1.05, 1.25, 1.3, 3.0, 1e4, NAN]
ADVANTAGES = [1.5, -0.7, -1.1, 0.0, -1.2, 0.8, 0.4, -2.5, 1.0, INF]
RHO = [0.5, 1.5, 1.0, 0.9, 1.2, 0.8, 0.7, 1.1, 0.3, INF]
REF_MINUS_LOGP = [0.3, -0.4, 2.0, -1.5, 0.25, 0.6, -0.2, 5.0, -3.0, -INF]
WEIGHTS = [0.1, 0.2, 0.05, 0.1, 0.3, 0.2, 0.15, 0.1, 0.25, 0.0]

# The clipped types (grpo, bnpo, dr_grpo, dapo, luspo) share one coefficient (loss code 0) and differ only in the
# aggregation weights, which the kernels take as given: three of them stand for the five.
CASES = [  # (LossConfig options, old_logp given, ρ given); β != 0 gives ℓ_ref
    ({"loss_type": "grpo"}, True, False),  # the clipped form, both clip sides
    ({"loss_type": "bnpo", "beta": 0.1}, True, False),  # + the k3 KL
    (
        {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5, "beta": 0.04, "use_bias_correction_kl": True},
        True,
        True,
    ),  # asymmetric clip, the δ cap, KL·r, ρ
    ({"loss_type": "cispo", "epsilon_high": 1.2, "beta": 0.04}, True, True),  # the absolute cap, detached
    ({"loss_type": "sapo"}, True, False),  # the soft gate at its default temperatures
    ({"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5, "beta": 0.1}, True, True),
    # old_logp None: r is exactly 1, on the edges and ties below (clamp passes the gradient on its closed interval,
    # min splits a tie in half)
    ({"loss_type": "grpo", "epsilon_low": 0.0, "epsilon_high": 0.0}, False, False),
    ({"loss_type": "grpo", "epsilon_low": 0.0, "epsilon_high": 0.0, "delta": 1.5}, False, False),  # with the δ cap on
    ({"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.0}, False, True),  # the upper edge only
    ({"loss_type": "cispo", "epsilon_high": 1.0}, False, False),  # r = the cispo cap
]


def _inputs(cfg: LossConfig, with_old: bool, with_rho: bool) -> dict:
    """The per-token inputs of one case as the launchers take them: [1, T] float32."""
    logp = -math.log(2.0)
    row = lambda values: torch.tensor([values], dtype=torch.float32)
    old = [NAN if math.isnan(r) else logp - math.log(r) for r in RATIOS]
    return {
        "advantages": row(ADVANTAGES),
        "old_logp": row(old) if with_old else None,
        "ref_logp": row([logp + d for d in REF_MINUS_LOGP]) if cfg.beta != 0.0 else None,
        "rho": row(RHO) if with_rho else None,
        "weight": row(WEIGHTS),
        "entropy_weight": None,
    }


def _kernel_coef(fused, cfg: LossConfig, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, logp) of one backend's fused pass, g read off the target's ∂logits (g·(1 − p_y)/τ with p_y = 1/2)."""
    length = len(RATIOS)
    logits = torch.zeros(1, length, 2)
    out = torch.empty_like(logits)
    logp, _ = fused(logits, torch.zeros(1, length, dtype=torch.long), 1.0, cfg=cfg, out=out, **inputs)
    return 2.0 * out[..., 0].double(), logp


def _loss_math_coef(cfg: LossConfig, inputs: dict, logp: torch.Tensor) -> torch.Tensor:
    """g = ∂loss/∂ℓ of `loss_math.grpo_objective` in float64 on the same (fp32) inputs, at the kernel's own ℓ."""
    as64 = lambda x: None if x is None else x.double()
    weight = inputs["weight"].double()
    tokens = TokenInputs(
        advantages=as64(inputs["advantages"]),
        mask=(weight != 0).double(),
        old_logp=as64(inputs["old_logp"]),
        ref_logp=as64(inputs["ref_logp"]),
        is_ratio=as64(inputs["rho"]),
        sampling_logp=None,
    )
    leaf = logp.detach().double().requires_grad_(True)
    loss, _ = grpo_objective(leaf, torch.full_like(leaf, math.log(2.0)), tokens, cfg, weight)
    (g,) = torch.autograd.grad(loss, leaf)
    return g


def _backend(name: str):
    if name == "triton":
        from grpo_kernels.ops import triton_logits

        return triton_logits.fused_token_grad
    return cpu_rows.fused_token_grad


BACKENDS = [
    pytest.param("triton", marks=needs_triton_cpu),
    pytest.param(
        "c", marks=pytest.mark.skipif(not cpu_rows.available(), reason="the _cpu_rows extension is not built")
    ),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy sees 0·inf
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("options", "with_old", "with_rho"), CASES)
def test_kernel_coefficient_matches_loss_math(backend, options, with_old, with_rho):
    cfg = LossConfig(**options)
    inputs = _inputs(cfg, with_old, with_rho)
    g, logp = _kernel_coef(_backend(backend), cfg, inputs)
    want = _loss_math_coef(cfg, inputs, logp)
    assert g[0, -1] == 0.0, "a masked token's coefficient must be exactly 0, whatever its inputs hold"
    assert want[0, -1] == 0.0
    assert torch.isfinite(want).all()  # the table stays where the float64 definition is finite
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-9)


def test_launchers_pass_the_scalars_in_the_kernels_order():
    """`coef.FLOAT_FIELDS` is the order of the float arguments of the Triton kernel and of the C `Coef` parse."""
    c_source = (ROOT / "grpo_kernels" / "csrc" / "cpu_rows.c").read_text()
    parse = re.search(r"static PyObject \*py_fused\(.*?PyArg_ParseTuple\((.*?)\)\)", c_source, re.DOTALL)
    assert parse is not None, "py_fused's argument parse not found in cpu_rows.c"
    c_fields = re.findall(r"&c\.(\w+)", parse.group(1))
    assert c_fields == ["loss", "has_delta", "bias_kl", *coef.FLOAT_FIELDS]
    assert c_fields[:3] == list(coef.CoefFlags.__dataclass_fields__)


@needs_triton_cpu
def test_the_triton_kernel_takes_the_scalars_in_coef_order():
    from grpo_kernels.ops import triton_logits

    names = triton_logits.fused_token_grad_fwd_kernel.arg_names
    start = names.index(coef.FLOAT_FIELDS[0])
    assert tuple(names[start : start + len(coef.FLOAT_FIELDS)]) == coef.FLOAT_FIELDS
    assert {"LOSS", "HAS_DELTA", "BIAS_KL"} <= set(names)


def test_coef_scalars_of_a_config():
    cfg = LossConfig(
        loss_type="dapo", epsilon_low=0.1, epsilon_high=0.3, delta=2.0, beta=0.5, use_bias_correction_kl=True
    )
    assert coef.coef_flags(cfg).values() == (0, True, True)
    scalars = dict(zip(coef.FLOAT_FIELDS, coef.coef_scalars(cfg).values()))
    assert scalars == {
        "lo": 0.9,
        "hi": 1.3,
        "delta": 2.0,
        "eps_high": 0.3,
        "beta": 0.5,
        "sapo_pos": 1.0,
        "sapo_neg": 1.05,
    }
    assert coef.coef_flags(LossConfig(loss_type="sapo")).values() == (2, False, False)
    assert [coef.FUSED_LOSS_CODES[name] for name in CLIPPED_LOSS_TYPES] == [0] * len(CLIPPED_LOSS_TYPES)
    assert coef.coef_scalars(LossConfig()).delta == 0.0
