"""The per-token layer against the float64 oracle: `grpo_loss(..., reduction="none")` with random upstream gradients
[B, T] (every loss type, token and sequence level, torch rows and Triton rows, interpreted without a GPU), float64
logits, and `top_entropy_quantile=0.0` (TRL's "only the highest-entropy tokens", ties kept by H >= threshold)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from grpo_kernels import GRPOLoss, fused_linear_grpo_loss, grpo_loss, selective_log_softmax
from grpo_kernels.config import LOSS_TYPES
from reference import reference_grpo_loss, reference_selective_log_softmax

from .conftest import needs_triton_cpu
from .oracle_check import TOLERANCES, assert_close, assert_grad_close, cases

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton_cpu)]  # CPU tensors: Triton under its interpreter
B, T, V = 3, 5, 48  # rows of 192 bytes: equal rows are equally aligned, so their fp32 entropies tie exactly
AGGREGATE_ONLY = {"entropy_coef", "num_items_in_batch", "max_completion_length"}


def make_problem(seed: int = 0, per_token: bool = False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=gen)
    logp = torch.log_softmax(logits[:, :T].double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    tensors = dict(
        advantages=torch.randn(B, T, generator=gen) if per_token else torch.randn(B, generator=gen),
        completion_mask=(torch.rand(B, T, generator=gen) > 0.25).float(),
        old_logp=(logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float(),
        ref_logp=(logp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float(),
        importance_sampling_ratio=0.5 + torch.rand((B, T) if per_token else (B, 1), generator=gen),
        sampling_logp=(logp + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float(),
    )
    tensors["completion_mask"][1, -2:] = 0.0
    upstream = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return logits, ids, tensors, upstream


def robust_quantile(logits, mask, temperature):
    """A top_entropy_quantile whose threshold falls mid-way into the widest gap between two active entropies, so that
    fp32 and float64 entropies make the same keep/drop decision for every token."""
    h = reference_selective_log_softmax(logits.double(), torch.zeros(mask.shape, dtype=torch.long), temperature)[1]
    active = h[mask.bool()].sort().values
    k = int((active[1:] - active[:-1]).argmax())
    return 1.0 - (k + 0.5) / (active.numel() - 1)


def run_both(logits, ids, tensors, upstream, options, backend, view=True):
    """(ours: loss [B, T], ∂logits; oracle: per-token loss, ∂logits), the logits a strided view of a larger buffer."""
    if options.get("top_entropy_quantile") == "robust":
        x = logits[:, :T] if view else logits
        q = robust_quantile(x, tensors["completion_mask"], options.get("temperature", 1.0))
        options = dict(options, top_entropy_quantile=q)
    leaf = logits.clone().requires_grad_(True)
    x = leaf[:, :T] if view else leaf
    out = grpo_loss(x, ids, backend=backend, reduction="none", **tensors, **options)
    (out.loss.double() * upstream).sum().backward()
    full64 = logits.double().requires_grad_(True)
    ref = reference_grpo_loss(full64[:, :T] if view else full64, ids, **tensors, **options)
    (ref.per_token_loss * upstream).sum().backward()
    return out, leaf.grad, ref, full64.grad


def check(out, grad, ref, grad64, dtype=torch.float32):
    tol = TOLERANCES[dtype]
    assert out.loss.shape == (B, T) and out.loss.dtype == torch.float32
    assert_close("per-token loss", out.loss, ref.per_token_loss.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("logp", out.logp, ref.logp.detach(), tol["loss_rtol"], tol["loss_atol"])
    for name, value in out.metrics.items():
        assert_close(name, value, torch.as_tensor(ref.metrics[name]), tol["loss_rtol"], tol["loss_atol"])
    assert grad64.abs().max() > 0, "a test whose gradient is all zero proves nothing"
    assert_grad_close(grad, grad64, dtype, upstream_is_one=False)


ALL_OPTIONS = dict(
    beta=0.05, use_bias_correction_kl=True, epsilon_high=0.28, off_policy_mask_threshold=0.05,
    top_entropy_quantile="robust", temperature=0.8,
)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_per_token_loss_every_loss_type(loss_type, level, backend):
    options = dict(ALL_OPTIONS, loss_type=loss_type, importance_sampling_level=level)
    if loss_type in ("grpo", "dapo"):
        options["delta"] = 1.1
    logits, ids, tensors, upstream = make_problem(seed=LOSS_TYPES.index(loss_type), per_token=level == "token")
    check(*run_both(logits, ids, tensors, upstream, options, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_loss_plain_grpo_bf16(backend):
    # no option at all (ratio 1 with old_logp None: the gradient is −A/... per token), bf16 logits, contiguous
    logits, ids, tensors, upstream = make_problem(seed=5, dtype=torch.bfloat16)
    tensors = {"advantages": tensors["advantages"], "completion_mask": tensors["completion_mask"]}
    out, grad, ref, grad64 = run_both(logits[:, :T].contiguous(), ids, tensors, upstream, {}, backend, view=False)
    check(out, grad, ref, grad64, torch.bfloat16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(dtypes=(torch.float32,)))
def test_property_per_token_loss_torch(case):
    options = {k: v for k, v in case.options.items() if k not in AGGREGATE_ONLY}
    gen = torch.Generator().manual_seed(int(case.ids.sum()))
    upstream = torch.randn(case.ids.shape, generator=gen, dtype=torch.float64)
    tensors = dict(
        advantages=case.advantages, completion_mask=case.mask, old_logp=case.old_logp, ref_logp=case.ref_logp,
        **case.tensors,
    )  # fmt: skip
    leaf = case.full.clone().requires_grad_(True)
    out = grpo_loss(case.view(leaf), case.ids, backend="torch", reduction="none", **tensors, **options)
    (out.loss.double() * upstream).sum().backward()
    full64 = case.full.double().requires_grad_(True)
    ref = reference_grpo_loss(case.view(full64), case.ids, **tensors, **options)
    (ref.per_token_loss * upstream).sum().backward()
    tol = TOLERANCES[torch.float32]
    # extreme logits make ℓ ~ −1e4, whose fp32 rounding the per-token loss sees directly (the aggregate averages it)
    scale = 1.0 + case.full.abs().nan_to_num(0.0, 0.0, 0.0).amax().item() * 1e-3
    assert_close("per-token loss", out.loss, ref.per_token_loss.detach(), tol["loss_rtol"] * scale, tol["loss_atol"])
    finite = torch.isfinite(full64.grad)
    assert (torch.isfinite(leaf.grad) == finite).all()
    err = (leaf.grad.double() - full64.grad)[finite].abs().max() if finite.any() else torch.tensor(0.0)
    assert err <= 1e-5 * full64.grad[finite].abs().max().clamp(min=1e-30) * scale + 1e-30


def test_masked_tokens_are_exactly_zero_and_inplace_matches():
    logits, ids, tensors, upstream = make_problem(seed=3)
    tensors["completion_mask"][0] = 0.0
    grads = []
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_(True)
        out = grpo_loss((leaf * 1)[:, :T], ids, reduction="none", inplace_backward=inplace, beta=0.1, **tensors)
        assert (out.loss[tensors["completion_mask"] == 0] == 0).all()
        (out.loss * upstream.float()).sum().backward()
        grads.append(leaf.grad)
    assert (grads[0][0] == 0).all() and grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_trainer_aggregations_are_one_line_each():
    # verl's agg_loss modes and TRL's aggregations on top of the per-token loss equal our aggregated loss types
    logits, ids, tensors, _ = make_problem(seed=4)
    tensors = {k: tensors[k] for k in ("advantages", "completion_mask", "old_logp")}
    m = tensors["completion_mask"]
    L = grpo_loss(logits[:, :T], ids, reduction="none", **tensors).loss.double()
    token_mean = (L * m).sum() / m.sum()  # verl "token-mean" = TRL bnpo (and dapo with one rank)
    seq_mean_token_mean = ((L * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()  # verl "seq-mean-token-mean" = TRL grpo
    seq_mean_token_sum = (L * m).sum(-1).mean()  # verl "seq-mean-token-sum" = luspo
    dr_grpo = (L * m).sum() / (B * T)  # TRL dr_grpo, max_completion_length = T
    for loss_type, value in [
        ("bnpo", token_mean), ("dapo", token_mean), ("grpo", seq_mean_token_mean), ("luspo", seq_mean_token_sum),
        ("dr_grpo", dr_grpo),
    ]:  # fmt: skip
        aggregated = grpo_loss(logits[:, :T], ids, loss_type=loss_type, **tensors).loss
        assert abs(float(aggregated) - float(value)) <= 1e-6 * abs(float(value)), loss_type


@pytest.mark.parametrize("option", [{"entropy_coef": 0.1}, {"num_items_in_batch": 7.0}, {"max_completion_length": 9}])
def test_aggregate_only_options_are_refused_by_name(option):
    logits, ids, tensors, _ = make_problem()
    (name,) = option
    with pytest.raises(ValueError, match=f"{name}=.*reduction='none'"):
        grpo_loss(logits[:, :T], ids, tensors["advantages"], reduction="none", **option)
    with pytest.raises(ValueError, match=f"{name}=.*reduction='none'"):
        GRPOLoss(reduction="none", **option)


def test_bad_reduction_and_second_backward():
    logits, ids, tensors, _ = make_problem()
    with pytest.raises(ValueError, match="reduction must be one of"):
        grpo_loss(logits[:, :T], ids, tensors["advantages"], reduction="mean")
    module = GRPOLoss(reduction="none", loss_type="sapo")
    x = logits[:, :T].clone().requires_grad_(True)
    assert module(x, ids, tensors["advantages"]).loss.shape == (B, T)
    out = grpo_loss(x, ids, tensors["advantages"], reduction="none")
    out.loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called a second time"):
        out.loss.sum().backward()


# ----------------------------------------------------------------------------------------------------------------
# float64 logits: computed in float64 on the torch path, refused by name on Triton

F64 = dict(rtol=1e-12, atol=1e-13)


def test_float64_grpo_loss_every_option():
    logits, ids, tensors, upstream = make_problem(seed=7, dtype=torch.float64)
    options = dict(ALL_OPTIONS, loss_type="dapo", entropy_coef=0.05, delta=1.2, top_entropy_quantile=0.6)
    for reduction in ("loss_type", "none"):
        opts = {k: v for k, v in options.items() if reduction == "loss_type" or k != "entropy_coef"}
        leaf = logits.clone().requires_grad_(True)
        out = grpo_loss(leaf[:, :T], ids, reduction=reduction, **tensors, **opts)
        ref_leaf = logits.clone().requires_grad_(True)
        ref = reference_grpo_loss(ref_leaf[:, :T], ids, **tensors, **opts)
        ours, exact = (out.loss, ref.loss) if reduction == "loss_type" else (out.loss, ref.per_token_loss)
        weight = 1.0 if reduction == "loss_type" else upstream
        (ours * weight).sum().backward()
        (exact * weight).sum().backward()
        assert out.loss.dtype == out.logp.dtype == out.entropy.dtype == torch.float64
        torch.testing.assert_close(ours, exact.detach(), **F64)
        torch.testing.assert_close(out.entropy, ref.entropy.detach(), **F64)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=1e-12 * ref_leaf.grad.abs().max().item())


def test_float64_selective_log_softmax_and_fused_linear():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 5
    ids = torch.randint(0, V, (B, T), generator=gen)
    u, v = torch.randn(2, B, T, generator=gen, dtype=torch.float64)
    x, x64 = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    logp, entropy = selective_log_softmax(x, ids, temperature=0.9)
    ref_logp, ref_entropy = reference_selective_log_softmax(x64, ids, temperature=0.9)
    ((logp * u).sum() + (entropy * v).sum()).backward()
    ((ref_logp * u).sum() + (ref_entropy * v).sum()).backward()
    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp, ref_logp.detach(), **F64)
    torch.testing.assert_close(entropy, ref_entropy.detach(), **F64)
    torch.testing.assert_close(x.grad, x64.grad, rtol=0, atol=1e-13 * x64.grad.abs().max().item())

    hidden = torch.randn(B, T, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, 16, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen)
    grads = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            out = fused_linear_grpo_loss(h, w, ids, adv, beta=0.1, ref_logp=ref_logp.detach() - 0.1)
            assert out.loss.dtype == out.logp.dtype == torch.float64
        else:
            out = reference_grpo_loss(h @ w.T, ids, adv, beta=0.1, ref_logp=ref_logp.detach() - 0.1)
        out.loss.backward()
        grads.append((out.loss.detach(), h.grad, w.grad))
    for ours, exact in zip(*grads):
        torch.testing.assert_close(ours, exact, rtol=1e-12, atol=1e-12 * exact.abs().max().item())


@needs_triton_cpu
def test_float64_is_refused_by_name_on_triton():
    logits, ids, tensors, _ = make_problem(dtype=torch.float64)
    with pytest.raises(TypeError, match="backend='triton' does not take float64 logits"):
        grpo_loss(logits[:, :T], ids, tensors["advantages"], backend="triton")
    with pytest.raises(TypeError, match="backend='triton' does not take float64 logits"):
        selective_log_softmax(logits[:, :T], ids, backend="triton")
    with pytest.raises(TypeError, match="float64 hidden and weight"):
        fused_linear_grpo_loss(logits[:, :T], torch.randn(4, V, dtype=torch.float64), ids % 4, tensors["advantages"],
                               backend="triton")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# top_entropy_quantile = 0.0: only the highest-entropy tokens, ties (H == max H) all kept


def tied_problem():
    """Two active tokens share the highest entropy exactly (the same logits and target); a masked token's is higher.

    TRL takes the threshold as a float32 quantile of the entropies and compares the entropies themselves with it;
    the oracle's are float64, so its maximum survives only where float32 rounds it down. The flat-ish row is
    chosen so that it does (ours compares its fp32 entropies with their own maximum: always kept)."""
    logits, ids, tensors, upstream = make_problem(seed=9)
    x = logits[:, :T]
    for scale in torch.linspace(0.05, 0.2, 64):
        row = torch.linspace(-1, 1, V) * scale
        h64 = reference_selective_log_softmax(row.double().view(1, 1, V), torch.zeros(1, 1, dtype=torch.long))[1]
        if torch.tensor(h64.item(), dtype=torch.float32).double() <= h64:
            break
    x[0, 1] = x[2, 3] = row  # nearly flat: the highest entropy of the active tokens, twice
    ids[2, 3] = ids[0, 1]  # (the fp32 entropy's rounding depends on the target, which is summed apart)
    x[1, 4] = 0.0  # flat: higher still, but masked
    tensors["completion_mask"][1, 4] = 0.0
    tensors["completion_mask"][0, 1] = tensors["completion_mask"][2, 3] = 1.0
    return logits, ids, tensors, upstream


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantile_zero_keeps_the_tied_highest_entropy_tokens(backend):
    logits, ids, tensors, upstream = tied_problem()
    tensors.pop("ref_logp")
    options = dict(top_entropy_quantile=0.0, loss_type="dapo")
    out, grad, ref, grad64 = run_both(logits, ids, tensors, upstream, options, backend)
    check(out, grad, ref, grad64)
    assert (out.loss != 0).nonzero().tolist() == [[0, 1], [2, 3]]
    agg = grpo_loss(logits[:, :T], ids, backend=backend, **tensors, **options)
    exact = reference_grpo_loss(logits[:, :T].double(), ids, **tensors, **options)
    assert_close("loss", agg.loss, exact.loss, 1e-5, 1e-6)
    assert abs(float(agg.loss)) > 0


def test_quantile_zero_fused_linear_matches_the_oracle():
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(B, T, 12, generator=gen)
    weight = torch.randn(V, 12, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_linear_grpo_loss(h, w, ids, adv, top_entropy_quantile=0.0, backend="torch")
    out.loss.backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = reference_grpo_loss(h64 @ w64.T, ids, adv, top_entropy_quantile=0.0)
    ref.loss.backward()
    assert ref.loss.abs() > 0
    assert_close("loss", out.loss, ref.loss.detach(), 1e-5, 1e-6)
    for ours, exact in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert math.isfinite(float(out.metrics["entropy"]))
