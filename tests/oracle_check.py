"""One harness to hold any backend against the float64 oracle, with the tolerances of docs/loss.md in one table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from grpo_kernels import grpo_loss
from grpo_kernels.config import CLIPPED_LOSS_TYPES, FUSED_LOSS_TYPES, LOSS_TYPES, TOKEN_COUNT_LOSS_TYPES
from reference import reference_grpo_loss

# docs/loss.md "Tolerances", per logits dtype.
#   loss_rtol/loss_atol: loss, logp, entropy and metrics against the oracle.
#   grad_rtol_of_max (fp32): every ∂logits element within this fraction of max|∂logits|.
#   grad_ulps (bf16/fp16): every element within this many ulps of the storage dtype of the exact value (two when
#   the upstream gradient is not 1: the stored gradient is rounded once, then scaled and rounded again).
#   grad_fp32_floor: the row math runs in fp32, so an element that is tiny only because two fp32 terms of size
#   ~max|∂logits| cancel (e.g. g ≈ −h·(z − Σpz)) cannot be resolved below fp32's eps times that max; 8 eps32.
TOLERANCES = {
    torch.float32: dict(loss_rtol=1e-5, loss_atol=1e-6, grad_rtol_of_max=1e-5),
    torch.bfloat16: dict(loss_rtol=1e-4, loss_atol=1e-6, grad_ulps=1, grad_fp32_floor=8 * 2.0**-23),
    torch.float16: dict(loss_rtol=1e-4, loss_atol=1e-6, grad_ulps=1, grad_fp32_floor=8 * 2.0**-23),
}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_NORMAL_EXP = {torch.bfloat16: -126, torch.float16: -14}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each |x| (float64), subnormals included."""
    _, exp = torch.frexp(x.abs().double())  # |x| = m · 2^exp, m in [0.5, 1)
    exp = torch.clamp(exp - 1, min=MIN_NORMAL_EXP[dtype])
    return torch.pow(2.0, (exp - MANTISSA_BITS[dtype]).double())


def assert_close(name: str, ours: torch.Tensor, exact: torch.Tensor, rtol: float, atol: float) -> None:
    ours, exact = ours.double(), exact.double()
    same_nan = torch.isnan(ours) == torch.isnan(exact)
    assert same_nan.all(), f"{name}: NaN pattern differs"
    finite = torch.isfinite(exact)
    assert torch.equal(ours[~finite & ~torch.isnan(exact)], exact[~finite & ~torch.isnan(exact)]), (
        f"{name}: inf differs"
    )
    err = (ours[finite] - exact[finite]).abs()
    bound = atol + rtol * exact[finite].abs()
    assert (err <= bound).all(), (
        f"{name}: max err {(err - bound).max().item():.3e} over bound; ours={ours} exact={exact}"
    )


def assert_grad_close(
    ours: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, upstream_is_one: bool, oracle_error=0.0
) -> None:
    """`oracle_error`: the float64 oracle's own rounding, per element (see `oracle_rounding`)."""
    tol = TOLERANCES[dtype]
    ours, exact = ours.double(), exact.double()
    oracle_error = torch.as_tensor(oracle_error, dtype=torch.float64).expand_as(exact)[torch.isfinite(exact)]
    assert (torch.isnan(ours) == torch.isnan(exact)).all(), "grad: NaN pattern differs"
    finite = torch.isfinite(exact)
    err = (ours - exact).abs()[finite]
    scale = exact[finite].abs().max() if finite.any() else torch.tensor(0.0)
    if dtype == torch.float32:
        # (plus fp32's smallest normal: a gradient that is all ~1e-190 in float64 is all 0 in any fp32 kernel)
        bound = tol["grad_rtol_of_max"] * scale + torch.finfo(torch.float32).tiny
    else:
        ulps = tol["grad_ulps"] * (1 if upstream_is_one else 2)
        bound = ulps * ulp(exact[finite], dtype) + tol["grad_fp32_floor"] * scale
    bound = bound + oracle_error
    worst = (err - bound).argmax() if err.numel() else None
    assert (err <= bound).all(), (
        f"grad ({dtype}): element err {err[worst].item():.3e} > bound "
        + format(
            bound
            if isinstance(bound, float)
            else bound.flatten()[worst].item()
            if torch.is_tensor(bound) and bound.dim()
            else float(bound),
            ".3e",
        )
        + f" (exact {exact[finite][worst].item():.6e}, ours {ours[finite][worst].item():.6e})"
    )


@dataclass
class Case:
    """One randomly drawn problem: the strided logits view, every tensor input and the options."""

    full: torch.Tensor  # [B, T + 1 + pad, V]; the loss reads a strided view of it
    ids: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    tensors: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    upstream: float = 1.0

    def view(self, full: torch.Tensor) -> torch.Tensor:
        length = self.ids.shape[1]
        return full[:, 1 : length + 1]  # a strided view, as trainers slice full[:, -T-1:-1]


@st.composite
def cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16), max_vocab=300, token_level_only=False):
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 5))
    # V = 1 (degenerate), 2, odd sizes like a scaled-down 151936 / 32001, and something above one chunk of rows.
    vocab = draw(st.sampled_from([1, 2, 7, 33, 151, max_vocab]))
    dtype = draw(st.sampled_from(dtypes))
    scale_kind = draw(st.sampled_from(["normal", "normal", "extreme", "large", "padded"]))
    logits = torch.randn(batch, length + 2, vocab, generator=gen, dtype=torch.float64) * 3
    if scale_kind == "large":  # |ℓ| in the hundreds, up to about 1e3: unlikely tokens under large logits
        logits = logits * 100.0
    elif scale_kind == "extreme":
        big = 1e4 if dtype == torch.float32 else 300.0
        logits = logits.sign() * big * torch.rand(logits.shape, generator=gen, dtype=torch.float64)
    elif scale_kind == "padded" and vocab > 2:
        logits[..., vocab - vocab // 3 :] = -math.inf  # padded vocabulary columns
    full = logits.to(dtype)
    usable = vocab - vocab // 3 if scale_kind == "padded" and vocab > 2 else vocab
    ids = torch.randint(0, usable, (batch, length), generator=gen)

    options: dict = {}
    loss_type = draw(st.sampled_from(FUSED_LOSS_TYPES if token_level_only else LOSS_TYPES))
    options["loss_type"] = loss_type
    if not token_level_only and draw(st.booleans()):
        options["importance_sampling_level"] = "sequence"
    options["temperature"] = draw(st.sampled_from([1.0, 1.0, 0.7, 1.3]))
    eps_edge = draw(st.booleans())
    if eps_edge:  # ratios exactly at the clip edges: with ε = 0 and r = 1 exactly, r sits on both edges
        options["epsilon_low"] = 0.0
        options["epsilon_high"] = 0.0
        if draw(st.booleans()):
            options["delta"] = 1.5  # (δ > 1: r = 1 = 1 ± ε stays under the cap)
    else:
        options["epsilon_low"] = draw(st.sampled_from([0.2, 0.1]))
        options["epsilon_high"] = draw(st.sampled_from([None, 0.28, 5.0] if loss_type == "cispo" else [None, 0.28]))
        if loss_type in CLIPPED_LOSS_TYPES and draw(st.booleans()):
            options["delta"] = 1.5

    z64 = full.double() / options["temperature"]
    true_logp = z64.log_softmax(-1)[:, 1 : length + 1].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    true_logp = torch.where(torch.isfinite(true_logp), true_logp, torch.full_like(true_logp, -30.0))
    # ℓ is formed in float64 from the row statistics, so exp(ℓ − ℓ_old) and exp(ℓ_ref − ℓ) are exact even where ℓ
    # itself is ~ −1e4 (whose fp32 ulp is 1e-3): large and extreme logits get off-policy ratios and a KL too.
    old_logp = None
    if not eps_edge and draw(st.booleans()):
        old_logp = (true_logp + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).float()
    ref_logp = None
    if draw(st.booleans()):
        options["beta"] = draw(st.sampled_from([0.04, 0.5]))
        options["use_bias_correction_kl"] = draw(st.booleans())
        ref_logp = (true_logp + 0.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).float()

    adv_kind = draw(st.sampled_from(["seq", "seq", "token", "zero"]))
    if adv_kind == "token":
        advantages = torch.randn(batch, length, generator=gen)
    elif adv_kind == "zero":
        advantages = torch.zeros(batch)
    else:
        advantages = torch.randn(batch, generator=gen)

    mask_kind = draw(st.sampled_from(["none", "random", "row_empty"]))
    mask = None
    if mask_kind != "none":
        mask = (torch.rand(batch, length, generator=gen) > 0.3).float()
        if mask_kind == "row_empty":
            mask[0] = 0.0  # a fully masked row
    tensors: dict = {}
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(batch,), (batch, 1), (batch, length)]))
        tensors["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=gen)
    if not token_level_only and draw(st.booleans()):
        options["off_policy_mask_threshold"] = draw(st.sampled_from([0.0, 0.05, 1.0]))
        if draw(st.booleans()):
            tensors["sampling_logp"] = (
                true_logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
            ).float()
    active = int((mask if mask is not None else torch.ones(batch, length)).sum())
    if not token_level_only and active > 1 and draw(st.booleans()):
        # A quantile whose position falls between two order statistics, so no token sits on the threshold and
        # fp32 and float64 entropies make the same keep/drop decision.
        # (With one active token the threshold is that token's own entropy, which TRL's float32 cast of a float64
        # entropy can round past; that corner is left out.)
        # The two entropies around that position must also be apart by more than fp32 resolves (1e-4), or the
        # decision hinges on rounding (e.g. two rows with entropies 1e-80 and 1e-35, both 0 in fp32).
        k = draw(st.integers(0, active - 2))
        p64 = z64[:, 1 : length + 1].softmax(-1)
        h64 = -torch.where(p64 > 0, p64 * z64[:, 1 : length + 1].log_softmax(-1), 0.0).sum(-1)
        h_active = h64[(mask if mask is not None else torch.ones(batch, length)).bool()].sort().values
        if h_active[k + 1] - h_active[k] > 1e-4:
            options["top_entropy_quantile"] = 1.0 - (k + 0.5) / (active - 1)
    if draw(st.booleans()):
        options["entropy_coef"] = draw(st.sampled_from([0.01, 0.3]))
    if loss_type in TOKEN_COUNT_LOSS_TYPES and draw(st.booleans()):
        options["num_items_in_batch"] = float(draw(st.integers(1, 20)))
    if loss_type == "dr_grpo" and draw(st.booleans()):
        options["max_completion_length"] = length + 3
    upstream = draw(st.sampled_from([1.0, 1.0, -0.37, 2.5]))
    return Case(full, ids, advantages, mask, old_logp, ref_logp, tensors, options, upstream)


def oracle_rounding(case: Case, full64: torch.Tensor, ref) -> torch.Tensor:
    """The oracle's float64 rounding per ∂logits element: its autograd forms ∂H/∂z = −p(z − Σpz) from terms of size
    |z|, so elements far below eps64·|z|·(|g| + |h|) (peaked rows in extreme tests) are rounding noise there."""
    wrt = [ref.logp] + ([ref.entropy] if ref.entropy.requires_grad else [])
    grads = torch.autograd.grad(ref.loss * case.upstream, wrt, retain_graph=True, allow_unused=True)
    coef = sum(g.abs() for g in grads if g is not None)  # [B, T]
    z_max = case.view(full64.detach()).abs().nan_to_num(0.0, 0.0, 0.0).amax(-1) / case.options["temperature"]
    floor = torch.zeros(full64.shape, dtype=torch.float64)
    case.view(floor).copy_(
        (32 * torch.finfo(torch.float64).eps * coef * (1 + z_max)).unsqueeze(-1).expand_as(case.view(floor))
    )
    return floor


def check_case(case: Case, backend: str, inplace: bool = False) -> None:
    """Run `grpo_loss` and the oracle on the same values; compare loss, ℓ, H, metrics and every ∂logits element."""
    dtype = case.full.dtype
    tol = TOLERANCES[dtype]
    leaf = case.full.clone().requires_grad_(True)
    source = leaf * 1 if inplace else leaf  # in-place needs a non-leaf buffer to overwrite
    out = grpo_loss(
        case.view(source), case.ids, case.advantages, case.mask, case.old_logp, case.ref_logp,
        inplace_backward=inplace, backend=backend, **case.tensors, **case.options,
    )
    (out.loss * case.upstream).backward()

    full64 = case.full.double().requires_grad_(True)
    ref = reference_grpo_loss(
        case.view(full64), case.ids, case.advantages, case.mask, case.old_logp, case.ref_logp,
        **case.tensors, **case.options,
    )
    floor = oracle_rounding(case, full64, ref)
    (ref.loss * case.upstream).backward()

    assert out.logp.dtype == torch.float32 and out.entropy.dtype == torch.float32
    assert_close("loss", out.loss, ref.loss.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("logp", out.logp, ref.logp.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("entropy", out.entropy, ref.entropy.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert set(out.metrics) >= set(ref.metrics) - {"clip_ratio/low_min", "clip_ratio/high_max"}, (
        f"metrics missing: {set(ref.metrics) - set(out.metrics)}"
    )
    for name, value in out.metrics.items():
        assert name in ref.metrics, f"metric {name} not in the oracle's"
        assert_close(
            f"metric {name}",
            torch.as_tensor(value),
            torch.as_tensor(ref.metrics[name]),
            tol["loss_rtol"],
            tol["loss_atol"],
        )
    assert leaf.grad.dtype == dtype
    assert_grad_close(leaf.grad, full64.grad, dtype, upstream_is_one=case.upstream == 1.0, oracle_error=floor)


SENTINELS = (math.nan, math.inf, -math.inf, -1e4)  # what masked positions hold in practice: padding and garbage


@st.composite
def masked_sentinel_cases(draw, **kwargs) -> tuple[Case, Case]:
    """(clean, poisoned): a drawn case with at least one masked token, and the same case with every masked input
    overwritten by sentinels (NaN, ±inf, −1e4): the logits row (whole, or one column), ℓ_old, ℓ_ref, ℓ_s, a (B, T)
    ρ or advantage at masked tokens, and a per-sequence ρ of a fully masked row."""
    case = draw(cases(**kwargs))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    batch, length = case.ids.shape
    mask = case.mask
    if mask is None or bool(mask.all()):
        mask = (torch.rand(batch, length, generator=gen) > 0.4).float()
        mask[0, 0] = 0.0
    clean = Case(
        case.full,
        case.ids,
        case.advantages,
        mask,
        case.old_logp,
        case.ref_logp,
        case.tensors,
        case.options,
        case.upstream,
    )
    masked = ~mask.bool()

    def sentinels(shape) -> torch.Tensor:
        return torch.tensor(SENTINELS, dtype=torch.float64)[torch.randint(0, len(SENTINELS), shape, generator=gen)]

    def poison(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        x = x.clone()
        if x.shape == (batch, length):
            x[masked] = sentinels((int(masked.sum()),)).to(x.dtype)
        else:  # per sequence: only a fully masked row's value is a masked input
            rows = masked.all(-1)
            x.view(batch, -1)[rows] = sentinels((int(rows.sum()), 1)).to(x.dtype)
        return x

    full = case.full.clone()
    view = clean.view(full)
    whole_row = torch.rand(batch, length, generator=gen) > 0.5
    column = torch.randint(0, view.shape[-1], (batch, length), generator=gen)
    for b, t in masked.nonzero().tolist():
        value = SENTINELS[int(torch.randint(0, len(SENTINELS), (1,), generator=gen))]
        if whole_row[b, t]:
            view[b, t] = value
        else:
            view[b, t, column[b, t]] = value
    tensors = dict(case.tensors)
    for name in ("importance_sampling_ratio", "sampling_logp"):
        if name in tensors:
            tensors[name] = poison(tensors[name])
    # (B, T) advantages at masked tokens; at T = 1 a (B, 1) advantage is the sequence's, which TRL's per-sequence
    # clip metrics read (its sign) even for a fully masked row, so it is no masked input there.
    per_token = case.advantages.shape == (batch, length) and length > 1
    advantages = poison(case.advantages) if per_token else case.advantages
    poisoned = Case(
        full,
        case.ids,
        advantages,
        mask,
        poison(case.old_logp),
        poison(case.ref_logp),
        tensors,
        case.options,
        case.upstream,
    )
    return clean, poisoned


def run_case(case: Case, backend: str, inplace: bool = False):
    """(loss, ∂ of the full logits, metrics) of `grpo_loss` on the case."""
    leaf = case.full.clone().requires_grad_(True)
    source = leaf * 1 if inplace else leaf
    out = grpo_loss(
        case.view(source), case.ids, case.advantages, case.mask, case.old_logp, case.ref_logp,
        inplace_backward=inplace, backend=backend, **case.tensors, **case.options,
    )
    (out.loss * case.upstream).backward()
    return out.loss.detach(), leaf.grad, out.metrics


def check_masked_inputs_are_absent(clean: Case, poisoned: Case, backend: str, inplace: bool = False) -> None:
    """The loss, every ∂logits element and every metric are those of the clean batch, bit for bit; the gradient of
    a masked token's row is exactly 0 (a NaN row included)."""
    loss, grad, metrics = run_case(clean, backend, inplace)
    p_loss, p_grad, p_metrics = run_case(poisoned, backend, inplace)
    assert torch.isfinite(p_loss) or not torch.isfinite(loss), f"poisoned loss {p_loss} (clean {loss})"
    assert torch.equal(p_loss, loss), f"loss {p_loss.item()!r} vs clean {loss.item()!r}"
    assert torch.equal(p_grad, grad), f"∂logits differs by {(p_grad - grad).abs().nan_to_num(1e300).max().item():.3e}"
    assert (clean.view(p_grad)[~clean.mask.bool()] == 0).all(), "a masked token's gradient row is not 0"
    assert p_metrics.keys() == metrics.keys()
    for name in metrics:
        assert torch.equal(p_metrics[name], metrics[name]), f"metric {name}: {p_metrics[name]} vs {metrics[name]}"


def check_large_log_ratios(backend: str, options: dict) -> None:
    """One token per call, so the loss's error is that token's: |ℓ| of 1e3 to 1e4 (an fp32 ℓ there is off by up to
    2.4e-4), off-policy by a few tenths, with a KL. Loss and ∂logits at the fp32 tolerances of `TOLERANCES`."""
    tol = TOLERANCES[torch.float32]
    gen = torch.Generator().manual_seed(7)
    for scale in (300.0, 1000.0, 3000.0):
        logits = (torch.randn(1, 1, 64, generator=gen, dtype=torch.float64) * scale).float()
        ids = logits.argmin(-1)  # the least likely token: |ℓ| ≈ 2·scale
        z = logits.double() / options.get("temperature", 1.0)
        true = (z.log_softmax(-1).gather(-1, ids.unsqueeze(-1))).squeeze(-1)
        assert true.abs().min() > 500
        for shift in (-0.3, 0.15):
            old = (true + shift).float()
            ref = (true - 0.4).float()
            case = Case(logits, ids, torch.ones(1), None, old, ref, {}, {"beta": 0.1, "temperature": 1.0, **options})
            case.view = lambda full: full  # the logits are the view
            check_case(case, backend)
    assert tol["loss_rtol"] == 1e-5


def check_cancelling_coefficient(backend: str, options: dict) -> None:
    """g = ∂loss/∂ℓ far smaller than its terms: one active token whose policy-gradient term −A·ρ·r and KL term
    β·(1 − exp(ℓ_ref − ℓ)) cancel to 1/25 of their size, with |ℓ| ≈ 10 (an fp32 ℓ or log Σe there carries
    5e-7, which g would carry at 25 times its relative weight). ∂logits at the fp32 tolerance of `TOLERANCES`:
    reached only if ℓ is exact to a few 1e-8 (ops/backend.py, "ℓ in float64")."""
    gen = torch.Generator().manual_seed(11)
    tau = options.get("temperature", 1.0)
    adv, rho, beta = -0.26, 0.93, 0.5
    for trial in range(4):
        logits = (torch.randn(1, 1, 151, generator=gen, dtype=torch.float64) * 3).float()
        z = logits.double() / tau
        lsm = z.log_softmax(-1)[0, 0]
        ids = (lsm - (-10.3)).abs().argmin().view(1, 1)  # the token with ℓ nearest −10.3
        true = lsm[ids[0, 0]].item()
        old = torch.tensor([[true - 0.03 * (trial + 1)]]).float()
        r = math.exp(true - old.item())
        pg = adv * rho * r  # −g's policy-gradient term is −pg (cispo below the cap, and the clipped form inside)
        ref = torch.tensor([[true + math.log(1.0 - (pg - 0.04 * pg) / beta)]]).float()
        case = Case(
            logits, ids, torch.tensor([adv]), None, old, ref, {"importance_sampling_ratio": torch.tensor([rho])},
            {"beta": beta, "epsilon_high": 5.0, "loss_type": "cispo", "temperature": 1.0, **options}, upstream=2.5,
        )
        case.view = lambda full: full  # the logits are the view
        check_case(case, backend)
