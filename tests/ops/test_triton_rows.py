"""The Triton row kernels (grpo_kernels/ops/triton_logits.py) against the float64 oracle (reference/).

On a CPU they run under TRITON_INTERPRET=1 (tests/conftest.py sets it), so shapes stay small: the interpreter runs
each program's tile ops as numpy calls, one program after another.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_kernels.config import CLIPPED_LOSS_TYPES, FUSED_LOSS_TYPES, LossConfig
from grpo_kernels.loss_math import aggregation_weights, entropy_bonus_weights
from grpo_kernels.ops import torch_rows
from reference import reference_grpo_loss

from .row_oracle import check_grad, check_stats, exact_grad, exact_rows

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1: the Triton kernels cannot run", allow_module_level=True)

from grpo_kernels.ops import triton_logits

pytestmark = pytest.mark.usefixtures("nan_empty")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_LOSSES = FUSED_LOSS_TYPES
NAN = float("nan")


# ------------------------------------------------------------------------------------------------------------------
# Inputs


def make_logits(values: torch.Tensor, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A (B, T, V) view holding `values` in `layout`; storage outside the view is NaN, so a stray read shows."""
    batch, length, vocab = values.shape
    if layout == "contiguous":
        x = torch.empty(batch, length, vocab, dtype=dtype, device=DEVICE)
    elif layout == "time_slice":  # full_logits[:, 1:-1]: the shifted completion window of a longer sequence
        x = torch.full((batch, length + 2, vocab), NAN, dtype=dtype, device=DEVICE)[:, 1:-1]
    elif layout == "batch_pad":  # batch stride (T + 3)·V
        x = torch.full((batch, length + 3, vocab), NAN, dtype=dtype, device=DEVICE)[:, :length]
    elif layout == "row_pad":  # time stride V + 5: rows not 16-element aligned (the unaligned kernel variant)
        x = torch.full((batch, length, vocab + 5), NAN, dtype=dtype, device=DEVICE)[..., :vocab]
    elif layout == "vocab_offset":  # row strides of whole 16-element blocks, the logits 1 element past 16 bytes
        x = torch.full((batch, length, vocab + 16), NAN, dtype=dtype, device=DEVICE)[..., 1 : vocab + 1]
    elif layout == "transposed":  # a (T, B, V) buffer seen as (B, T, V)
        x = torch.full((length, batch, vocab), NAN, dtype=dtype, device=DEVICE).transpose(0, 1)
    else:
        raise AssertionError(layout)
    x.copy_(values.to(dtype))
    return x


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


def make_ids(batch: int, length: int, vocab: int, gen: torch.Generator, transposed: bool = False) -> torch.Tensor:
    if transposed:  # strided (B, T) ids as well
        return torch.randint(0, vocab, (length, batch), generator=gen).t().to(DEVICE)
    return torch.randint(0, vocab, (batch, length), generator=gen, dtype=torch.int32).to(DEVICE)


def nan_out_like(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A NaN-filled gradient buffer in the same kind of layout (so `out` strides differ from the logits')."""
    return make_logits(torch.full(x.shape, NAN, dtype=torch.float64), x.dtype, layout)


# ------------------------------------------------------------------------------------------------------------------
# float64 truth: the oracle, differentiated by autograd


def exact_loss_grad(x, ids, cfg: LossConfig, inputs: dict, old, ref) -> torch.Tensor:
    """∂loss/∂logits of the oracle's GRPO loss on the fused kernel's inputs, float64."""
    leaf = x.detach().double().requires_grad_(True)
    options = {f.name: getattr(cfg, f.name) for f in fields(LossConfig) if f.name != "check_inputs"}
    out = reference_grpo_loss(
        leaf, ids, inputs["advantages"], inputs["mask"], old, ref, importance_sampling_ratio=inputs["rho"],
        **options,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return grad


# ------------------------------------------------------------------------------------------------------------------
# Checks (bounds: docs/loss.md, "Tolerances", via tests/oracle_check.TOLERANCES)


def run_rows(x, ids, tau, g, h, out=None):
    """row_stats + row_grad, checked against the oracle; returns the gradient buffer."""
    dtype = x.dtype
    exact_lp, exact_h, graph = exact_rows(x, ids, tau)
    logp, entropy, state = triton_logits.row_stats(x, ids, tau)
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    check_state(state, logp, entropy, x, tau)
    if out is None:
        out = nan_out_like(x, "contiguous")
    triton_logits.row_grad(x, ids, state, g, h, tau, out)
    check_grad(out, exact_grad(graph, g, h), dtype)
    return out


def check_state(state: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor, x: torch.Tensor, tau: float) -> None:
    """The row state is the shared layout of ops/backend.py: (m, log Σe, 1 − p_y, Σ p·z'), so H = s − c."""
    assert state.shape == (*logp.shape, 4) and state.dtype == torch.float32
    finite = torch.isfinite(entropy)
    assert torch.equal(state[..., 0][finite], x.float().amax(-1)[finite])
    torch.testing.assert_close((state[..., 1] - state[..., 3])[finite], entropy[finite], rtol=1e-5, atol=1e-5)


def token_inputs(batch, length, gen, *, old=True, ref=True, ratio=True, per_token_adv=False):
    """Per-token inputs as api.py passes them: fp32, advantages and ρ as stride-0 (B, 1) -> (B, T) expansions."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    adv = randn(batch, length) if per_token_adv else randn(batch, 1).expand(batch, length)
    mask = (torch.rand(batch, length, generator=gen) > 0.2).float().to(DEVICE)
    rho = (0.5 + torch.rand(batch, 1, generator=gen)).to(DEVICE).expand(batch, length) if ratio else None
    return {
        "advantages": adv,
        "mask": mask,
        "rho": rho,
        "old_delta": 0.3 * randn(batch, length) if old else None,
        # ℓ_ref − ℓ kept >= 0.2 away from 0: 1 − exp(ℓ_ref − ℓ) cancels there, and an fp32 ℓ (off by up to an
        # ulp of ℓ, 1e-6 at ℓ ~ −8) cannot give that small coefficient to 1e-5 (or to the bf16/fp16 ulp).
        "ref_delta": (
            torch.sign(randn(batch, length)) * (0.2 + 0.4 * torch.rand(batch, length, generator=gen).to(DEVICE))
        )
        if ref
        else None,
    }


def run_fused(x, ids, cfg: LossConfig, inputs: dict, out=None):
    """fused_token_grad against the oracle's ℓ, H and ∂loss/∂logits; returns the gradient buffer. The weights are
    loss_math's, as api.py passes them."""
    dtype, tau = x.dtype, cfg.temperature
    exact_lp, exact_h, _ = exact_rows(x, ids, tau)
    old = None if inputs["old_delta"] is None else (exact_lp + inputs["old_delta"]).float()
    ref = None if inputs["ref_delta"] is None or cfg.beta == 0 else (exact_lp + inputs["ref_delta"]).float()
    mask = inputs["mask"].double()
    expected = exact_loss_grad(x, ids, cfg, inputs, old, ref)  # before the kernel: `out` may be `x` itself
    if out is None:
        out = nan_out_like(x, "contiguous")
    logp, entropy = triton_logits.fused_token_grad(
        x,
        ids,
        tau,
        advantages=inputs["advantages"],
        old_logp=old,
        ref_logp=ref,
        rho=inputs["rho"],
        weight=aggregation_weights(mask, cfg).float(),
        entropy_weight=entropy_bonus_weights(mask, cfg).float() if cfg.entropy_coef != 0 else None,
        cfg=cfg,
        out=out,
    )
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    check_grad(out, expected, dtype)
    return out


# ------------------------------------------------------------------------------------------------------------------
# row_stats / row_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "vocab",
    [
        1,  # a single column: p = 1, ℓ = 0, H = 0, gradient 0
        2,
        7,  # odd: masked lanes in the one tile
        33,  # just over a power of two
        300,
        1000,  # the num_warps=4 row of the table
    ],
)
def test_rows_match_float64(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    batch, length = 2, 3
    x = make_logits(3 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), dtype, "contiguous")
    ids = make_ids(batch, length, vocab, gen)
    g = torch.randn(batch, length, generator=gen).to(DEVICE)
    h = torch.randn(batch, length, generator=gen).to(DEVICE)
    run_rows(x, ids, 0.7, g, None)
    run_rows(x, ids, 1.0, g, h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_two_tiles(dtype):
    """V = 5000 > 4096: two tiles per pass with the table's own block size (the online rescale across tiles)."""
    gen = torch.Generator().manual_seed(1)
    x = make_logits(2 * torch.randn(1, 2, 5000, generator=gen, dtype=torch.float64), dtype, "time_slice")
    ids = make_ids(1, 2, 5000, gen)
    assert triton_logits._block_config(5000)[0] < 5000
    run_rows(x, ids, 1.0, randn(gen, 1, 2), randn(gen, 1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["time_slice", "batch_pad", "row_pad", "vocab_offset", "transposed"])
def test_rows_strided_views(dtype, layout):
    gen = torch.Generator().manual_seed(2)
    batch, length, vocab = 2, 3, 48
    x = make_logits(3 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), dtype, layout)
    ids = make_ids(batch, length, vocab, gen, transposed=layout == "transposed")
    g = torch.randn(length, batch, generator=gen).to(DEVICE).t()  # strided g, h too
    h = randn(gen, batch, 1).expand(batch, length)
    out = nan_out_like(x, layout)
    run_rows(x, ids, 0.9, g, h, out=out)
    base = out._base if out._base is not None else out
    assert int(torch.isnan(base).sum()) == base.numel() - out.numel(), "wrote outside the output view"


def test_whole_vector_reads_need_logits_on_16_bytes():
    """Word reads of bf16 (WORDS) and the tail tile's whole-vector reads (VECTORS) only where the logits start on
    16 bytes: a view like x[..., 1:] has row strides of whole 16-element blocks (ALIGNED) but starts 2 bytes off,
    where a 32-bit read would be a misaligned access on a GPU (the interpreter would not notice)."""
    base = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    for view, expected in ((base[..., :48], True), (base[..., 1:49], False)):
        args = {"x_ptr": view, "V": 48, "BLOCK_V": 64, "num_warps": 1,
                "ALIGNED": triton_logits._aligned(view.stride(0), view.stride(1)), "HEAD": False}  # fmt: skip
        assert args["ALIGNED"]
        assert triton_logits._words(args) is expected and triton_logits._vectors(args) is expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tiles_rising_max_and_persistent_loop(dtype, monkeypatch):
    """BLOCK_V forced to 16 (19 tiles of V = 300) on rows sorted ascending, so the running max rises at every
    tile and the sums are rescaled 18 times; the first tile is all −inf (no scale yet); 2 programs loop over 5 rows."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (16, 1))
    monkeypatch.setattr(triton_logits, "_num_programs", lambda rows, *a: 2)
    gen = torch.Generator().manual_seed(3)
    values = (4 * torch.randn(1, 5, 300, generator=gen, dtype=torch.float64)).sort(-1).values
    values[..., :16] = -math.inf
    values[0, 3] = values[0, 3].flip(-1)  # one row with its max in the first real tile instead
    x = make_logits(values, dtype, "contiguous")
    ids = 16 + make_ids(1, 5, 284, gen)
    run_rows(x, ids, 0.8, randn(gen, 1, 5), randn(gen, 1, 5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_overlapping_last_tile(dtype, monkeypatch):
    """An aligned row of V = 304, a multiple of 16, in tiles of 32: its last tile is [272, 304), overlapping the
    one before by 16 logits, which it must neither count again (rows sorted ascending: the overlap holds the
    largest logits seen so far) nor store again (the in-place gradient has overwritten them). Targets in the
    overlap, after it and in the first tile; a masked token's row (g = h = 0) is zeroed over the overlap too."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    assert triton_logits._tail_tile({"ALIGNED": True, "V": 304, "BLOCK_V": 32})
    assert not triton_logits._tail_tile({"ALIGNED": True, "V": 300, "BLOCK_V": 32})  # the masked tail tiles
    gen = torch.Generator().manual_seed(12)
    values = (3 * torch.randn(2, 3, 304, generator=gen, dtype=torch.float64)).sort(-1).values
    x = make_logits(values, dtype, "time_slice")
    ids = torch.tensor([[280, 287, 300], [3, 272, 303]], dtype=torch.int32, device=DEVICE)
    g, h = randn(gen, 2, 3), randn(gen, 2, 3)
    g[1, 1], h[1, 1] = 0.0, 0.0
    out = run_rows(x, ids, 0.8, g, h)
    assert (out[1, 1] == 0).all()
    inputs = token_inputs(2, 3, gen)
    cfg = LossConfig(loss_type="bnpo", beta=0.1, temperature=0.7, entropy_coef=0.01)
    run_fused(x.clone(), ids, cfg, inputs)
    run_fused(x, ids, cfg, inputs, out=x)  # in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_vocabulary(dtype):
    """−inf logits (padded vocabulary) give finite ℓ, H and a zero gradient there, also with the entropy term."""
    gen = torch.Generator().manual_seed(4)
    values = 2 * torch.randn(2, 2, 300, generator=gen, dtype=torch.float64)
    values[..., 250:] = -math.inf
    values[1, 0, :100] = -math.inf
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 2, 100, gen) + 100
    out = run_rows(x, ids, 1.0, randn(gen, 2, 2), randn(gen, 2, 2))
    assert torch.isfinite(out).all() and (out[..., 250:] == 0).all()


@pytest.mark.parametrize(
    "dtype,scale",
    [
        (torch.float32, 1e4),  # an fp32 lse of 1e4 is off by 1e-3: the kernel must work relative to the row max
        (torch.bfloat16, 300.0),  # peaked rows: 1 − p_y far below fp32's eps next to 1
        (torch.float16, 300.0),
    ],
)
def test_extreme_logits(dtype, scale):
    gen = torch.Generator().manual_seed(5)
    values = scale * (2 * torch.rand(2, 3, 300, generator=gen, dtype=torch.float64) - 1)
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 3, 300, gen)
    ids[0, 0] = int(x[0, 0].float().argmax())  # the target is the max: ℓ ≈ 0, gradient g·(1 − p_y) tiny
    ids[1, 2] = int(x[1, 2].float().argmin())  # the target has probability ~0: ℓ ≈ −2·scale/τ
    g = randn(gen, 2, 3)
    run_rows(x, ids, 0.7, g, randn(gen, 2, 3))
    run_rows(x, ids, 1.0, g, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_row_beyond_the_fp32_reference_is_nan(dtype, temperature):
    """16-bit rows take z2 = x·k2 − r from r = m·k2 in fp32 (`_fma_frame`): a row whose max·k2 overflows fp32
    (logits of 3e38) has no reference, and reads NaN rather than a wrong number; the other rows are exact. fp32
    rows keep z2 = (x − m)·k2, which needs no reference: the same rows are exact there."""
    gen = torch.Generator().manual_seed(11)
    values = 3 * torch.randn(2, 2, 320, generator=gen, dtype=torch.float64)
    values[0, 1, 17] = 3.0e38
    values[1, 0] = -3.0e38 + values[1, 0]  # a whole row far below: its max·k2 overflows to −inf
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 2, 320, gen)
    logp, entropy, _ = triton_logits.row_stats(x, ids, temperature)
    bad = torch.tensor([[False, True], [True, False]], device=DEVICE)
    if dtype == torch.float32:
        bad = torch.zeros_like(bad)
    assert torch.isnan(logp[bad]).all() and torch.isnan(entropy[bad]).all()
    exact_lp, exact_h, _ = exact_rows(x, ids, temperature)
    check_stats("logp", logp[~bad], exact_lp[~bad], dtype)
    check_stats("entropy", entropy[~bad], exact_h[~bad], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_per_row(dtype):
    gen = torch.Generator().manual_seed(6)
    values = torch.randn(2, 2, 64, generator=gen, dtype=torch.float64)
    values[0, 1, 7] = NAN  # a NaN that is not the target
    values[1, 0, 3] = NAN
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 2, 64, gen)
    ids[1, 0] = 3  # ... and one that is
    out = run_rows(x, ids, 1.0, randn(gen, 2, 2), randn(gen, 2, 2))
    assert torch.isnan(out[0, 1]).all() and torch.isnan(out[1, 0]).all()
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1, 1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_grad_in_place(dtype):
    """out is the logits tensor itself (a strided view): every tile is read before it is overwritten."""
    gen = torch.Generator().manual_seed(7)
    values = 3 * torch.randn(2, 3, 5000, generator=gen, dtype=torch.float64)
    x = make_logits(values, dtype, "time_slice")
    ids = make_ids(2, 3, 5000, gen)
    g, h = randn(gen, 2, 3), randn(gen, 2, 3)
    expected = exact_grad(exact_rows(x, ids, 1.0)[2], g, h)
    _, _, state = triton_logits.row_stats(x, ids, 1.0)
    triton_logits.row_grad(x, ids, state, g, h, 1.0, x)
    check_grad(x, expected, dtype)


# ------------------------------------------------------------------------------------------------------------------
# fused_token_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", TOKEN_LOSSES)
@pytest.mark.parametrize("options", ["plain", "everything"])
def test_fused_every_loss_type(dtype, loss_type, options):
    gen = torch.Generator().manual_seed(TOKEN_LOSSES.index(loss_type) + 10 * len(options))
    batch, length, vocab = 2, 4, 33
    x = make_logits(3 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), dtype, "time_slice")
    ids = make_ids(batch, length, vocab, gen)
    full = options == "everything"
    kwargs = {"loss_type": loss_type, "temperature": 0.8 if full else 1.0}
    if full:
        kwargs.update(beta=0.04, use_bias_correction_kl=True, entropy_coef=0.01)
        kwargs.update(delta=1.5 if loss_type in CLIPPED_LOSS_TYPES else None)
        kwargs.update(epsilon_high=1.2 if loss_type == "cispo" else 0.28)  # cispo: an absolute cap that binds
    cfg = LossConfig(**kwargs)
    inputs = token_inputs(batch, length, gen, old=full, ref=full, ratio=full, per_token_adv=full)
    run_fused(x, ids, cfg, inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "options",
    [
        {
            "loss_type": "grpo",
            "epsilon_low": 0.0,
            "epsilon_high": 0.0,
        },  # r = 1 = 1 − ε = 1 + ε: min's tie, clamp's edge
        {"loss_type": "grpo", "epsilon_low": 0.0, "epsilon_high": 0.0, "delta": 1.5},  # ... with the δ cap on
        {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.0},  # r on the upper edge only
        {"loss_type": "cispo", "epsilon_high": 1.0},  # r = the cispo cap
        {"loss_type": "sapo"},  # r = 1: σ'(0)
    ],
)
def test_fused_ratio_exactly_at_clip_edges(dtype, options):
    """old_logp None makes r exactly 1; advantages include 0 and both signs (the A > 0 switches)."""
    gen = torch.Generator().manual_seed(8)
    x = make_logits(2 * torch.randn(3, 2, 40, generator=gen, dtype=torch.float64), dtype, "contiguous")
    ids = make_ids(3, 2, 40, gen)
    inputs = token_inputs(3, 2, gen, old=False, ref=False, ratio=False)
    inputs["advantages"] = torch.tensor([[1.5], [0.0], [-0.7]], device=DEVICE).expand(3, 2)
    run_fused(x, ids, LossConfig(**options), inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_in_place_two_tiles(dtype):
    """The gradient written over the logits (a strided view), V = 5000 so pass 2 re-reads tiles 1 and 2."""
    gen = torch.Generator().manual_seed(9)
    x = make_logits(3 * torch.randn(2, 2, 5000, generator=gen, dtype=torch.float64), dtype, "batch_pad")
    ids = make_ids(2, 2, 5000, gen)
    cfg = LossConfig(loss_type="bnpo", beta=0.1, temperature=0.7, entropy_coef=0.01)
    run_fused(x, ids, cfg, token_inputs(2, 2, gen), out=x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_extreme_logits_and_padding(dtype, monkeypatch):
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))  # 10 tiles, some all −inf
    gen = torch.Generator().manual_seed(10)
    scale = 1e4 if dtype == torch.float32 else 300.0
    values = scale * (2 * torch.rand(2, 3, 300, generator=gen, dtype=torch.float64) - 1)
    values[..., 200:] = -math.inf
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 3, 200, gen)
    ids[0, 0] = int(x[0, 0].float().argmax())
    # ℓ ~ −3e4 here, whose fp32 ulp is 2e-3: exp(ℓ − ℓ_old) and exp(ℓ_ref − ℓ) are ill-conditioned past any fp32 ℓ
    # (the output dtype the spec fixes), so this stays on-policy without a KL, as tests/oracle_check.py does.
    cfg = LossConfig(loss_type="dr_grpo", temperature=0.7, entropy_coef=0.01)
    out = run_fused(x, ids, cfg, token_inputs(2, 3, gen, old=False, ref=False))
    assert torch.isfinite(out).all() and (out[..., 200:] == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy sees 0·inf
def test_fused_nan_propagates_and_masked_tokens_are_zero():
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(2, 3, 40, generator=gen, dtype=torch.float64)
    values[0, 0, 5] = NAN
    x = make_logits(values, torch.float32, "contiguous")
    ids = make_ids(2, 3, 40, gen)
    weight = torch.full((2, 3), 0.1, device=DEVICE)
    weight[1, 2] = 0.0
    adv = torch.randn(2, 3, generator=gen).to(DEVICE)
    adv[0, 2] = NAN  # NaN advantage on an active token
    adv[1, 2] = math.inf  # inf advantage on a masked token: contributes nothing, no 0·inf
    out = nan_out_like(x, "contiguous")
    cfg = LossConfig(loss_type="grpo", beta=0.04)
    logp, entropy = triton_logits.fused_token_grad(
        x, ids, 1.0, advantages=adv, old_logp=None, ref_logp=torch.zeros(2, 3, device=DEVICE) - 3.0,
        rho=None, weight=weight, entropy_weight=None, cfg=cfg, out=out,
    )  # fmt: skip
    assert torch.isnan(logp[0, 0]) and torch.isnan(entropy[0, 0]) and torch.isnan(out[0, 0]).all()
    assert torch.isnan(out[0, 2]).all()
    assert (out[1, 2] == 0).all()
    finite_rows = [(0, 1), (1, 0), (1, 1)]
    assert all(torch.isfinite(out[r]).all() for r in finite_rows)


# ------------------------------------------------------------------------------------------------------------------
# Properties


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    vocab = draw(st.sampled_from([1, 2, 3, 17, 64, 255, 1000, 4097, 4112]))
    scale = draw(st.sampled_from([0.1, 3.0, 30.0, 300.0]))
    layout = draw(st.sampled_from(["contiguous", "time_slice", "batch_pad", "row_pad", "transposed"]))
    tau = draw(st.sampled_from([0.3, 0.7, 1.0, 1.6]))
    seed = draw(st.integers(0, 2**31 - 1))
    fused = draw(st.booleans())
    opts = {}
    if fused:
        opts = {
            "loss_type": draw(st.sampled_from(TOKEN_LOSSES)),
            "beta": draw(st.sampled_from([0.0, 0.04])),
            "use_bias_correction_kl": draw(st.booleans()),
            "epsilon_low": draw(st.sampled_from([0.0, 0.2])),
            "epsilon_high": draw(st.sampled_from([0.0, 0.28, 3.0])),
            "delta": draw(st.sampled_from([None, 1.25, 1.5])),
            "entropy_coef": draw(st.sampled_from([0.0, 0.01])),
        }
        opts["flags"] = {"old": draw(st.booleans()), "ratio": draw(st.booleans()), "per_token_adv": draw(st.booleans())}
    return dtype, (batch, length, vocab), scale, layout, tau, seed, fused, opts


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_property_rows_and_fused(problem):
    dtype, (batch, length, vocab), scale, layout, tau, seed, fused, opts = problem
    gen = torch.Generator().manual_seed(seed)
    x = make_logits(scale * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), dtype, layout)
    ids = make_ids(batch, length, vocab, gen, transposed=layout == "transposed")
    out = nan_out_like(x, layout)
    if not fused:
        g = torch.randn(batch, length, generator=gen).to(DEVICE)
        h = torch.randn(batch, length, generator=gen).to(DEVICE) if seed % 2 else None
        run_rows(x, ids, tau, g, h, out=out)
        return
    flags = opts.pop("flags")
    if exact_rows(x, ids, tau)[0].abs().max() > 8.0:
        # exp(ℓ − ℓ_old) and exp(ℓ_ref − ℓ) inherit ℓ's fp32 rounding (an ulp of ℓ: 1e-4 at ℓ ~ −2e3), past the 1e-5
        # the gradient must meet: ill-conditioned for any fp32 ℓ (the spec's output dtype), not a kernel error.
        # Such rows stay on-policy without a KL, as tests/oracle_check.py does for extreme logits.
        flags["old"], opts["beta"] = False, 0.0
    cfg = LossConfig(temperature=tau, **opts)
    inputs = token_inputs(batch, length, gen, ref=cfg.beta != 0, **flags)
    run_fused(x, ids, cfg, inputs, out=out)


# ------------------------------------------------------------------------------------------------------------------
# Vocabulary shards: the Triton shard partials against torch_rows' (single process, no collective)


# Shard partials against the float64 partials of the same rounded logits: each e is exp of a z rounded once or twice
# in float32 (|z| up to ~60 in a peaked row: ~1e-6 relative), then summed in float32.
SHARD_PARTIALS_RTOL = 4e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "time_slice", "row_pad"])
def test_shard_partials_match_the_torch_partials(dtype, layout):
    gen = torch.Generator().manual_seed(5)
    batch, length, vocab, offset = 2, 3, 40, 40  # the shard [40, 80) of a 120-id vocabulary
    values = randn(gen, batch, length, vocab) * 3
    values[1, 2] = -math.inf  # an all −inf shard row (padded vocabulary): it must add nothing when merged
    values[0, 0, 7] += 30.0  # a peaked row whose target is in the shard: Σ_{v≠y} e must not be formed as a difference
    ids = torch.tensor([[offset + 7, 3, offset + 39], [offset, 119, offset + 12]], device=DEVICE)  # in and out
    x = make_logits(values, dtype, layout)
    for temperature in (1.0, 0.7):
        got = triton_logits.shard_partials(x, ids, offset, temperature)
        # the float64 partials of the same rounded values; 4e-6 holds torch's own float32 partials too
        want = torch_rows.shard_partials(x.double(), ids, offset, temperature)
        assert got.shape == (batch, length, 5)
        torch.testing.assert_close(got.double(), want, rtol=SHARD_PARTIALS_RTOL, atol=0.0)
        torch.testing.assert_close(torch_rows.shard_partials(x.float(), ids, offset, temperature).double(), want,
                                   rtol=SHARD_PARTIALS_RTOL, atol=0.0)  # fmt: skip
        # target logit −inf: outside the shard (ids 3, 119), or the all −inf row
        outside = torch.tensor([[False, True, False], [False, True, True]], device=DEVICE)
        assert torch.equal(torch.isinf(got[..., 3]), outside)
        assert torch.isinf(got[1, 2, 0]) and got[1, 2, 1:3].eq(0).all() and got[1, 2, 4] == 0  # adds nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_state_merged_then_row_grad(dtype):
    """Two vocabulary shards: each shard's partials, merged (vocab_parallel.merge_partials) into the shared row state,
    then row_grad with shard-local ids writes each shard's gradient: the whole-vocabulary oracle's, piece by piece."""
    from grpo_kernels.vocab_parallel import merge_partials

    gen = torch.Generator().manual_seed(12)
    values = 3 * torch.randn(2, 3, 70, generator=gen, dtype=torch.float64)
    values[1, 1, 40:] = -math.inf  # one row whose second shard is all padding
    x = make_logits(values, dtype, "contiguous")
    ids = make_ids(2, 3, 40, gen)
    ids[0, 0] = 55  # a target in the second shard
    g, h = randn(gen, 2, 3), randn(gen, 2, 3)
    shards = [(x[..., :40], 0), (x[..., 40:], 40)]
    parts = torch.stack([triton_logits.shard_partials(s, ids, off, 0.9) for s, off in shards])
    logp, entropy, state = merge_partials(parts, 0.9)
    exact_lp, exact_h, graph = exact_rows(x, ids, 0.9)
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    out = torch.cat([nan_out_like(s.contiguous(), "contiguous") for s, _ in shards], -1)
    for (s, off), piece in zip(shards, (out[..., :40], out[..., 40:])):
        buffer = nan_out_like(s.contiguous(), "contiguous")
        triton_logits.row_grad(s, ids - off, state, g, h, 0.9, buffer)
        piece.copy_(buffer)
    check_grad(out, exact_grad(graph, g, h), dtype)


@pytest.mark.parametrize("vocab", [16400, 16401])  # aligned (overlapping last tile) and realigned (masked tail)
def test_16bit_plan_rows(vocab):
    """The 16-bit plan of the statistics, shard-partials and fused kernels past V = 16384: tiles of 4096 over 4 warps
    (5 tiles, the last overlapping or masked), against the oracle and the torch partials; the gradient kernel and
    fp32 rows keep theirs; the fused kernel takes tiles of 8192 over 8 warps above V = 32768 and of 16384 over 16
    above 65536, where the scans keep 4 warps, then 8."""
    assert triton_logits._block_config(vocab, False, "scan") == (4096, 4)
    assert triton_logits._block_config(vocab, False, "fused") == (4096, 4)
    assert triton_logits._block_config(50257, False, "scan") == (4096, 4)
    assert triton_logits._block_config(50257, False, "fused") == (8192, 8)
    # sm_100: the realigned rows keep the 4-warp plan there (its ptxas spills the 8-warp one), aligned ones do not
    assert triton_logits._fused_block_config(50257, False, "fused", True, 100) == (4096, 4)
    assert triton_logits._fused_block_config(50257, False, "fused", True, 90) == (8192, 8)
    assert triton_logits._fused_block_config(50304, False, "fused", False, 100) == (8192, 8)
    assert triton_logits._fused_block_config(50257, False, "", True, 100) == (8192, 8)
    assert triton_logits._fused_block_config(151937, False, "fused", True, 100) == (16384, 16)
    assert [triton_logits._programs_per_sm(w, True, 2) for w in (4, 8, 16)] == [3, 2, 1]
    assert [triton_logits._programs_per_sm(w, True, 4) for w in (4, 8, 16)] == [3, 1, 1]
    # the fused grid: two programs per SM of the 16-bit plan at 50257 (as many rows as fit L2), one of scalar rows
    plan = (1 << 30, 50257, 2, True, triton_logits.REFERENCE_SMS, 50 << 20, 8, "sms")
    assert triton_logits._grid_size(*plan) == 2 * triton_logits.REFERENCE_SMS
    assert triton_logits._grid_size(*plan, scalar=True) == triton_logits.REFERENCE_SMS
    assert triton_logits._block_config(vocab, False, "") == (8192, 8)
    assert triton_logits._block_config(151936, False, "scan") == (8192, 8)
    assert triton_logits._block_config(151936, False, "fused") == (16384, 16)
    check_scans_and_fused(vocab, torch.bfloat16, "time_slice", [5, vocab - 3])


def check_scans_and_fused(vocab: int, dtype: torch.dtype, layout: str, targets: list[int]) -> None:
    """Two seeded rows (the second's max in its last tile) through the statistics, shard-partials and fused
    kernels, against the oracle and the torch partials."""
    gen = torch.Generator().manual_seed(vocab)
    values = 3 * torch.randn(1, 2, vocab, generator=gen, dtype=torch.float64)
    values[0, 1, -5:] += 40.0  # the row's max in the last tile
    x = make_logits(values, dtype, layout)
    ids = torch.tensor([targets], device=DEVICE)
    exact_lp, exact_h, _ = exact_rows(x, ids, 0.8)
    logp, entropy, state = triton_logits.row_stats(x, ids, 0.8)
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    check_state(state, logp, entropy, x, 0.8)
    got = triton_logits.shard_partials(x, ids, 0, 0.8)
    want = torch_rows.shard_partials(x.double(), ids, 0, 0.8)
    torch.testing.assert_close(got.double(), want, rtol=SHARD_PARTIALS_RTOL, atol=0.0)
    cfg = LossConfig(loss_type="grpo", temperature=0.8, beta=0.04, entropy_coef=0.01)
    run_fused(x, ids, cfg, token_inputs(1, 2, gen))


@pytest.mark.parametrize("vocab", [16400, 16401])  # aligned (overlapping last tile) and realigned (masked tail)
def test_grouped_accumulators_fp32(vocab):
    """fp32 rows in tiles of 8192 over 8 warps: 2048 slots over 256 threads, so each thread's running statistics
    combine its 8 slots (`_group`: GROUP 8; the 16-bit plans, GROUP 4: `test_16bit_plan_rows`), against the oracle
    and the torch partials, for the statistics, shard-partials and fused kernels; the row's max in its last tile."""
    assert triton_logits._block_config(vocab) == (8192, 8)
    x = torch.empty(0, dtype=torch.float32)
    assert triton_logits._group({"BLOCK_V": 8192, "x_ptr": x, "num_warps": 8}) == 8
    assert triton_logits._group({"BLOCK_V": 32, "x_ptr": x, "num_warps": 1}) == 1  # fewer slots than threads
    check_scans_and_fused(vocab, torch.float32, "contiguous", [vocab - 1, 8200])


@pytest.mark.parametrize(("arch", "plans"), [(90, ((8192, 8), (8192, 8))), (100, ((4096, 4), (8192, 8)))])
def test_fused_plan_per_arch(arch, plans, monkeypatch):
    """The fused launcher's plan at V = 50257 (realigned rows) and 50304 (aligned) for the device it launches on:
    sm_100 keeps the realigned 16-bit rows on 4 warps (`_fused_block_config`), Hopper gives both 8."""
    monkeypatch.setattr(triton_logits, "REFERENCE_ARCH", arch)  # the device a plan off CUDA is made for
    for vocab, plan in zip((50257, 50304), plans, strict=True):
        x = torch.zeros(1, 2, vocab, dtype=torch.bfloat16)
        assert triton_logits._fused_plan(x, x)[1:3] == plan
        assert triton_logits._fused_plan(x.float(), x.float())[1:3] == (8192, 8)  # fp32 rows: one plan


def test_wide_fused_plan_on_sm100_runs_one_program_per_sm(monkeypatch):
    """With the narrow 16-bit plans off, the fused kernel's realigned bf16 rows at V = 50257 keep the 8-warp plan;
    sm_100's ptxas spills it at the 128 registers of two programs per SM, so there its registers and its grid both
    count one program per SM (the grid does not launch a second program per SM that would wait for the first);
    aligned rows and Hopper keep two."""
    monkeypatch.setattr(triton_logits, "NARROW_16BIT", False)
    sms, l2 = triton_logits.REFERENCE_SMS, triton_logits.REFERENCE_L2_BYTES
    gen = torch.Generator().manual_seed(0)
    calls = []

    def stop(*args, **kwargs):  # the launcher's grid call, before any launch
        calls.append(args)
        raise InterruptedError

    for arch, head, per_sm in ((90, True, 2), (100, False, 2), (100, True, 1)):
        monkeypatch.setattr(triton_logits, "REFERENCE_ARCH", arch)
        vocab = 50257 if head else 50304
        x = torch.zeros(1, 2, vocab, dtype=torch.bfloat16)
        assert triton_logits._fused_plan(x, x)[1:3] == (8192, 8)
        assert triton_logits._programs_per_sm(8, True, 2, arch=arch, head=head) == per_sm
        args = {"x_ptr": x, "BLOCK_V": 8192, "V": vocab, "num_warps": 8, "ALIGNED": not head, "HEAD": head}
        assert triton_logits._launch_plan(args, two_pass=True)[1] == triton_logits._max_registers(8, per_sm)
        grid = triton_logits._grid_size(1 << 20, vocab, 2, True, sms, l2, 8, "sms", arch=arch, head=head)
        assert grid == per_sm * sms, (arch, head, grid)
        # and the launcher sizes its grid for the realigned rows it launches (`_num_programs` gets `head`)
        monkeypatch.setattr(triton_logits, "_num_programs", stop)
        with pytest.raises(InterruptedError):
            run_fused(x, torch.zeros(1, 2, dtype=torch.long), LossConfig(loss_type="grpo"), token_inputs(1, 2, gen))
        assert calls[-1][-1] is head, calls[-1]


@pytest.mark.parametrize(
    ("vocab", "forced", "plan"),
    [(32784, None, (8192, 8, 1)), (32785, None, (8192, 8, 1)), (65552, None, (16384, 16, 1)),
     (65552, 2, (8192, 8, 2)), (65553, None, (16384, 16, 1))],
)  # fmt: skip  # aligned (overlapping last tile) and realigned (masked tail)
def test_wide_fused_plan_rows(vocab, forced, plan, monkeypatch):
    """The fused kernel's 16-bit plans past V = 32768, 5 tiles of 8192 over 8 warps (two programs per SM) and past
    65536 16384 over 16 (one: its 132 rows in flight fit L2), or with a split forced the split plan (`_split_plan`:
    tiles of 8192 over 8 warps, two programs per SM, each row split in 2), the last tile overlapping the one
    before or masked (realigned rows, never split), against the oracle, the target in the last tile and the row's
    max in the first."""
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", forced)
    assert triton_logits._block_config(vocab, False, "fused") == (plan[:2] if vocab < 65536 else (16384, 16))
    assert triton_logits._programs_per_sm(plan[1], True, 2) == 16 // plan[1]
    gen = torch.Generator().manual_seed(vocab)
    values = 3 * torch.randn(1, 2, vocab, generator=gen, dtype=torch.float64)
    values[0, 0, 7] += 40.0
    x = make_logits(values, torch.bfloat16, "contiguous")  # V odd: HEAD rows, realigned to 16 elements; else ALIGNED
    assert not triton_logits._scalar_rows(x)
    fused = triton_logits._fused_plan(x, torch.empty_like(x))
    assert (*fused[1:3], fused[5]) == plan
    ids = torch.tensor([[vocab - 2, 16390]], device=DEVICE)
    cfg = LossConfig(loss_type="grpo", temperature=0.8, beta=0.04, entropy_coef=0.01)
    run_fused(x, ids, cfg, token_inputs(1, 2, gen))


@pytest.mark.parametrize("share", [0.01, 0.45, 1.0])  # pass 2 from the row's last tile, from mid-row, in row order
@pytest.mark.parametrize(("vocab", "layout"), [(336, "contiguous"), (331, "contiguous"), (300, "vocab_offset")])
def test_fused_pass2_window(share, vocab, layout, monkeypatch):
    """Pass 2 in each order `pass2_window` can give, written over the logits themselves and into a fresh buffer: 11
    tiles of 32, the last overlapping the one before (V = 336), ending in a masked tail (331, HEAD rows) or read
    logit by logit (vocab_offset: rows 2 or 4 bytes past 16). The targets sit in the row's first and last tiles."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    monkeypatch.setattr(triton_logits, "PASS2_WINDOW", share)
    gen = torch.Generator().manual_seed(vocab)
    values = 3 * torch.randn(1, 2, vocab, generator=gen, dtype=torch.float64)
    values[0, 1, 40] += 20.0  # the row's max in the second tile
    ids = torch.tensor([[vocab - 1, 3]], device=DEVICE)
    cfg = LossConfig(loss_type="grpo", temperature=0.8, beta=0.04, entropy_coef=0.01)
    for dtype in DTYPES:
        x = make_logits(values, dtype, layout)
        assert triton_logits._scalar_rows(x) == (layout == "vocab_offset")
        run_fused(x.clone(), ids, cfg, token_inputs(1, 2, gen))
        run_fused(x, ids, cfg, token_inputs(1, 2, gen), out=x)


@pytest.mark.parametrize(
    ("vocab", "share", "fresh"), [(256, 3 / 8, {0, 5}), (256, 1.0, {0}), (255, 3 / 8, {0, 4, 7}), (255, 1.0, {0, 7})]
)
def test_fused_pass2_order(vocab, share, fresh, monkeypatch):
    """The order pass 2 takes its tiles in, seen through an output that aliases the logits one tile further on
    (out tile i is the storage of logits tile i + 1), under the interpreter, which runs each tile's read and
    write in program order. A tile read after the tile before it was written reads gradients (about 0) where the
    logits were (about 50), so its own gradient is 0. With 8 tiles and a window of 3, pass 2 takes 5, 6, 7, 0,
    ..., 4: only tiles 5 and 0 read their logits (tile 0's storage is never written); in row order only tile 0.
    V = 255 (a masked tail, HEAD rows): 7 full tiles, so 4, 5, 6, 0, ..., 3, and the tail tile (7), read before
    them."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    monkeypatch.setattr(triton_logits, "PASS2_WINDOW", share)
    tile = 32
    gen = torch.Generator().manual_seed(5)
    buf = torch.zeros(1, 1, vocab + tile, device=DEVICE)
    x, out = buf[..., :vocab], buf[..., tile:]
    x.copy_(50.0 + torch.rand(1, 1, vocab, generator=gen).to(DEVICE))
    ids = torch.tensor([[3]], device=DEVICE)  # the target in tile 0
    ones = torch.ones(1, 1, device=DEVICE)
    triton_logits.fused_token_grad(
        x, ids, 1.0, advantages=ones, old_logp=None, ref_logp=None, rho=None, weight=ones, entropy_weight=None,
        cfg=LossConfig(loss_type="grpo", beta=0.0), out=out,
    )  # fmt: skip
    read = {i for i in range(-(-vocab // tile)) if out[0, 0, i * tile : (i + 1) * tile].abs().max() > 1e-6}
    assert read == fresh, read


def test_pass2_window_switch(monkeypatch):
    """GRPO_KERNELS_PASS2_WINDOW (or triton_logits.PASS2_WINDOW) sets the share of the row pass 2 takes first;
    by default 1 (row order) while the rows in flight fit L2, else the share of them 2·L2_FRACTION of L2 holds;
    anything outside (0, 1] is refused, naming the variable."""
    monkeypatch.delenv(triton_logits.PASS2_WINDOW_VARIABLE, raising=False)
    l2 = 50 << 20
    assert triton_logits.pass2_window(132, 300_000, l2) == 1.0  # 37.8 MiB in flight
    assert triton_logits.pass2_window(132, 600_000, l2) == pytest.approx(2 * triton_logits.L2_FRACTION * l2 / 79.2e6)
    monkeypatch.setenv(triton_logits.PASS2_WINDOW_VARIABLE, "0.25")
    assert triton_logits.pass2_window(132, 300_000, l2) == 0.25
    monkeypatch.setattr(triton_logits, "PASS2_WINDOW", 1)  # the attribute wins over the variable
    assert triton_logits.pass2_window(132, 600_000, l2) == 1.0
    for bad in (0, 1.5, "half", float("nan")):
        monkeypatch.setattr(triton_logits, "PASS2_WINDOW", bad)
        with pytest.raises(ValueError, match="GRPO_KERNELS_PASS2_WINDOW"):
            triton_logits.pass2_window(132, 300_000, l2)


def test_narrow_16bit_switch(monkeypatch):
    """GRPO_KERNELS_NARROW_16BIT (or triton_logits.NARROW_16BIT) turns the narrow 16-bit plans off ("0") or on;
    fp32 rows never take them; anything else is refused, naming the variable."""
    bf16, fp32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float32)
    monkeypatch.delenv(triton_logits.NARROW_16BIT_VARIABLE, raising=False)
    assert triton_logits._narrow_plan(bf16, "scan") == "scan" and triton_logits._narrow_plan(fp32, "scan") == ""
    monkeypatch.setenv(triton_logits.NARROW_16BIT_VARIABLE, "0")
    assert triton_logits._narrow_plan(bf16, "fused") == ""
    monkeypatch.setattr(triton_logits, "NARROW_16BIT", True)  # the attribute wins over the variable
    assert triton_logits._narrow_plan(bf16, "fused") == "fused"
    for bad in ("yes", 2):
        monkeypatch.setattr(triton_logits, "NARROW_16BIT", bad)
        with pytest.raises(ValueError, match="GRPO_KERNELS_NARROW_16BIT"):
            triton_logits.narrow_16bit()


# ------------------------------------------------------------------------------------------------------------------
# The fused kernel's row split (`_split_row_scan`)


@pytest.mark.parametrize(("dtype", "split"), [(torch.float32, 2), (torch.bfloat16, 3)])
def test_row_split_matches_oracle(dtype, split, monkeypatch):
    """Rows split across `split` programs, each a slice of the tiles (7 tiles of 32, the last overlapping: slices
    of 3 + 4 or 2 + 2 + 3; other splits, dtypes and vocabularies: `test_property_row_split`), against the oracle:
    ℓ, H and the gradient of every slice, targets in the first and the overlapping last tile, masked tokens
    included. Under the interpreter the programs run one after another:
    the first of a row finds no other slice published and scans them all itself, the later ones read them. The
    in-place gradient is never split (`test_row_split_switch`): a later program would read its target's logit,
    or scan a slice, after an earlier one wrote its gradient there."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", split)
    vocab, batch, length = 208, 2, 3
    gen = torch.Generator().manual_seed(split)
    x = make_logits(3 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64), dtype, "contiguous")
    ids = make_ids(batch, length, vocab, gen)
    ids[0, 0], ids[1, 2] = 0, vocab - 1
    assert triton_logits._fused_split(x, torch.empty_like(x), 32, 1, False) == split
    for cfg in (LossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.8),
                LossConfig(loss_type="cispo", beta=0.0)):  # fmt: skip
        run_fused(x, ids, cfg, token_inputs(batch, length, gen))


@st.composite
def split_problems(draw):
    """A split launch: the split, the vocabulary (a multiple of 16, tiles of 32: 1 to 13 tiles, slices empty to
    several tiles, the last tile overlapping or not), dtype, scale, temperature and the token-level options."""
    return {
        "split": draw(st.integers(1, 4)),
        "vocab": draw(st.sampled_from([32, 48, 96, 208, 400])),
        "dtype": draw(st.sampled_from(DTYPES)),
        "scale": draw(st.sampled_from([0.1, 3.0, 30.0])),
        "tau": draw(st.sampled_from([0.7, 1.0, 1.6])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "loss_type": draw(st.sampled_from(TOKEN_LOSSES)),
        "beta": draw(st.sampled_from([0.0, 0.04])),
        "entropy_coef": draw(st.sampled_from([0.0, 0.01])),
        "inplace": draw(st.booleans()),
    }


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=split_problems())
def test_property_row_split(problem, monkeypatch):
    """Any split of any row that ends in an overlapping tile against the oracle (`run_fused`), the output a fresh
    buffer or the logits themselves (then unsplit)."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", problem["split"])
    gen = torch.Generator().manual_seed(problem["seed"])
    shape = (2, 2, problem["vocab"])
    x = make_logits(problem["scale"] * torch.randn(*shape, generator=gen, dtype=torch.float64), problem["dtype"],
                    "contiguous")  # fmt: skip
    ids = make_ids(2, 2, problem["vocab"], gen)
    out = x if problem["inplace"] else torch.empty_like(x)
    assert triton_logits._fused_split(x, out, 32, 1, False) == (1 if problem["inplace"] else problem["split"])
    beta = problem["beta"] if exact_rows(x, ids, problem["tau"])[0].abs().max() <= 8.0 else 0.0  # as above
    cfg = LossConfig(loss_type=problem["loss_type"], beta=beta, entropy_coef=problem["entropy_coef"],
                     temperature=problem["tau"])  # fmt: skip
    inputs = token_inputs(2, 2, gen, ref=beta != 0, old=beta != 0)
    run_fused(x, ids, cfg, inputs, out=out)


def test_row_split_takes_a_published_slice_as_is(monkeypatch):
    """A slice whose statistics are published in the exchange is read, not scanned: with slice 1 of row 0
    published before the launch as holding nothing (max −inf, Σe 0), row 0's ℓ is that of the row without slice 1's
    mass (higher than the oracle's), while row 1, published by the kernel itself, matches the oracle. So the read
    path runs, and the statistics do not depend on which program scanned a slice (tests above)."""
    monkeypatch.setattr(triton_logits, "_block_config", lambda vocab, *plan: (32, 1))
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", 2)
    real = triton_logits._split_workspace

    def published(rows, split, device):
        ws = real(rows, split, device)
        words = torch.tensor([float("-inf"), 0.0, 0.0]).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        ws[0, 1] = words | (1 << 32)
        return ws

    monkeypatch.setattr(triton_logits, "_split_workspace", published)
    vocab = 256  # 8 tiles of 32: slices of 4 + 4
    gen = torch.Generator().manual_seed(1)
    x = make_logits(torch.randn(1, 2, vocab, generator=gen, dtype=torch.float64), torch.float32, "contiguous")
    ids = torch.tensor([[3, 3]], device=DEVICE)  # targets in slice 0
    exact_lp, _, _ = exact_rows(x, ids, 1.0)
    ones = torch.ones(1, 2, device=DEVICE)
    logp, _ = triton_logits.fused_token_grad(
        x, ids, 1.0, advantages=ones, old_logp=None, ref_logp=None, rho=None, weight=ones, entropy_weight=None,
        cfg=LossConfig(loss_type="grpo", beta=0.0), out=torch.empty_like(x),
    )  # fmt: skip
    half = x[0, 0, :128].double()
    assert logp[0, 1].item() == pytest.approx(exact_lp[0, 1].item(), abs=1e-6)
    assert logp[0, 0].item() == pytest.approx((half[3] - torch.logsumexp(half, 0)).item(), abs=1e-6)
    assert logp[0, 0].item() > exact_lp[0, 0].item() + 0.1


def test_row_split_switch(monkeypatch):
    """GRPO_KERNELS_ROW_SPLIT (or triton_logits.ROW_SPLIT) forces the fused kernel's row split, 1 for none; unset,
    the launcher's default (`_default_split`); anything but an integer from 1 to MAX_ROW_SPLIT is refused, naming
    the variable. Rows that do not end in an overlapping full tile (unaligned strides, V not a multiple of 16, a
    row shorter than a tile) are never split."""
    monkeypatch.delenv(triton_logits.ROW_SPLIT_VARIABLE, raising=False)
    assert triton_logits.row_split() is None
    monkeypatch.setenv(triton_logits.ROW_SPLIT_VARIABLE, "3")
    assert triton_logits.row_split() == 3
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", 1)  # the attribute wins over the variable
    assert triton_logits.row_split() == 1
    for bad in (0, triton_logits.MAX_ROW_SPLIT + 1, "two", "2.5", -1):
        monkeypatch.setattr(triton_logits, "ROW_SPLIT", bad)
        with pytest.raises(ValueError, match="GRPO_KERNELS_ROW_SPLIT"):
            triton_logits.row_split()
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", 2)
    x, out = torch.empty(1, 2, 208), torch.empty(1, 2, 208)
    assert triton_logits._fused_split(x, out, 32, 1, False) == 2
    assert triton_logits._fused_split(x, x, 32, 1, False) == 1  # the gradient in place
    assert triton_logits._fused_split(x[:, :1], x[:, 1:], 32, 1, False) == 1  # another view of the same storage
    assert triton_logits._fused_split(x[..., :200], out[..., :200], 32, 1, False) == 1  # V = 200: realigned rows
    assert triton_logits._fused_split(x, out, 256, 1, False) == 1  # shorter than a tile
    assert triton_logits._fused_split(x, out, 32, 1, True) == 1  # scalar rows
    padded = torch.empty(1, 2, 213)[..., :208]  # a row stride of 213 elements: not 16-byte aligned
    assert triton_logits._fused_split(padded, out, 32, 1, False) == 1


@pytest.mark.parametrize(("l2", "expected"), [
    (50 << 20, {(4, 81920): 4, (4, 128256): 6, (4, 151936): 7, (4, 262144): 11,
                (2, 81920): None, (2, 128256): 3, (2, 151936): 4, (2, 262144): 6}),
    (60 << 20, {(4, 81920): 3, (4, 128256): 5, (4, 151936): 6, (4, 262144): 9,
                (2, 81920): None, (2, 128256): 3, (2, 151936): 3, (2, 262144): 5}),
])  # fmt: skip  # None: the one-program plan, its pass-2 misses within SPLIT_PLAN_MISS
def test_default_split(l2, expected, monkeypatch):
    """The default split of the fused kernel's split plan (`_split_plan`: two 8-warp programs per SM, 132 SMs,
    V > 65536, where the one-program plan would miss more than SPLIT_PLAN_MISS of pass 2 in L2, or a split is
    forced): the least that keeps the rows in flight within the L2 budget (SPLIT_MISS: no pass-2 miss), no more
    than leaves each slice MIN_SLICE_TILES tiles; none in any other plan (V <= 65536, sm_100, a forced grid).
    docs/performance.md, section 4, prices these."""
    for name in (triton_logits.FUSED_GRID_VARIABLE, triton_logits.ROW_SPLIT_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    got = {}
    for elem, vocab in expected:
        plan = triton_logits._split_plan(vocab, elem, 132, l2)
        wide = triton_logits.SPLIT_BLOCK_CONFIG[elem]
        got[elem, vocab] = None if plan is None else triton_logits._default_split(vocab, elem, *plan, 132, l2)
        assert plan in (None, wide)
        if plan is None:
            assert triton_logits._default_split(vocab, elem, *wide, 132, l2) == 1
        else:
            assert triton_logits._split_grid(1 << 20, got[elem, vocab], elem, *plan, 132) > 132 * 3 // 2  # 2 per SM
    assert got == expected
    assert triton_logits._split_plan(65536, 4, 132, l2) is None  # the one-program plans up to V = 65536
    assert triton_logits._split_plan(262144, 4, 148, l2, arch=100) is None  # sm_100: none
    assert triton_logits._default_split(262144, 4, 4096, 8, 148, l2, arch=100) == 1
    assert triton_logits._default_split(262144, 4, 8192, 16, 132, l2) == 1  # the one-program plan
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", 2)  # a forced split takes the split plan, misses or not
    assert triton_logits._split_plan(81920, 2, 132, l2) == triton_logits.SPLIT_BLOCK_CONFIG[2]
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", 1)
    assert triton_logits._split_plan(262144, 4, 132, l2) is None
    monkeypatch.setattr(triton_logits, "ROW_SPLIT", None)
    monkeypatch.setattr(triton_logits, "FUSED_GRID", "sms")
    assert triton_logits._split_plan(262144, 4, 132, l2) is None
    assert triton_logits._default_split(262144, 4, 4096, 8, 132, l2) == 1
