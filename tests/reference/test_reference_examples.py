"""The oracle against arithmetic done by hand: advantages, V = 2 losses and gradients, −inf logits, the errors.

The V = 2 examples use logits [0, ln 3]: p = [1/4, 3/4], so token 1 has ℓ = ln(3/4) and ∂ℓ/∂z = [−1/4, 1/4].
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import ReferenceOutput, reference_group_advantages, reference_grpo_loss, reference_selective_log_softmax

LN3 = math.log(3.0)
LOGP = math.log(0.75)  # ℓ of token 1 under logits [0, ln 3]
DLOGP = torch.tensor([-0.25, 0.25], dtype=torch.float64)  # ∂ℓ/∂z for that token
FLOAT32_1_05 = 1.0499999523162842  # TRL builds sapo's temperatures in float32


def v2_logits(rows: int, temperature: float = 1.0) -> torch.Tensor:
    """(rows, 1, 2) logits [0, τ ln 3] (z = [0, ln 3] after the temperature), a leaf that requires grad."""
    return torch.tensor([[[0.0, temperature * LN3]]] * rows, dtype=torch.float64, requires_grad=True)


def token_one(rows: int) -> torch.Tensor:
    return torch.ones(rows, 1, dtype=torch.long)


def old_for_ratio(*ratios: float) -> torch.Tensor:
    """ℓ_old per row so that r = exp(ℓ − ℓ_old) takes the given values."""
    return torch.tensor([[LOGP - math.log(r)] for r in ratios], dtype=torch.float64)


def grad_of(out: ReferenceOutput, logits: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(out.loss, logits)
    return grad


# ---- Advantages


def test_one_group_of_two_right_two_wrong():
    # mean 0.5, deviations ±0.5, Bessel std sqrt(1/3) = 0.57735: A = ±0.5 / (0.57735 + 1e-4) = ±0.8659
    adv = reference_group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), num_generations=4)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(
        adv, torch.tensor([0.866, -0.866, -0.866, 0.866], dtype=torch.float64), atol=1e-3, rtol=0
    )
    assert adv[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), abs=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])  # each scaling must leave an all-equal group at 0
def test_all_equal_group_is_exactly_zero(scale):
    # The mean of three 0.1 is 0.10000000000000002: r − mean is not 0 without the explicit rule.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 2.0]], dtype=torch.float64)
    adv = reference_group_advantages(rewards, scale=scale)
    assert torch.equal(adv[0], torch.zeros(3, dtype=torch.float64))
    assert not torch.isnan(adv).any()


def test_batch_and_none_scaling():
    rewards = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    # group means 0.5 and 3: deviations [0.5, −0.5, 0, 0]; batch std of [1, 0, 3, 3]: Σ(r − 1.75)² / 3 = 2.25 -> 1.5
    none = reference_group_advantages(rewards, scale="none")
    batch = reference_group_advantages(rewards, scale="batch")
    group = reference_group_advantages(rewards, scale="group")
    assert none.tolist() == [[0.5, -0.5], [0.0, 0.0]]
    torch.testing.assert_close(batch, torch.tensor([[0.5, -0.5], [0.0, 0.0]], dtype=torch.float64) / 1.5001)
    std = math.sqrt(0.5)  # Bessel std of {1, 0}
    torch.testing.assert_close(group, torch.tensor([[0.5, -0.5], [0.0, 0.0]], dtype=torch.float64) / (std + 1e-4))


def test_flat_and_grouped_shapes_agree():
    flat = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    grouped = reference_group_advantages(flat.view(2, 3))
    assert grouped.shape == (2, 3)
    assert reference_group_advantages(flat, num_generations=3).shape == (6,)
    assert torch.equal(reference_group_advantages(flat, num_generations=3), grouped.view(-1))
    assert torch.equal(reference_group_advantages(flat, num_generations=1), torch.zeros(6, dtype=torch.float64))


def test_advantage_argument_errors():
    with pytest.raises(ValueError, match="num_generations"):
        reference_group_advantages(torch.zeros(6), num_generations=4)
    with pytest.raises(ValueError, match="num_generations"):
        reference_group_advantages(torch.zeros(2, 3), num_generations=2)
    with pytest.raises(ValueError, match="scale"):
        reference_group_advantages(torch.zeros(2, 3), scale="token")


# ---- Log-probs and entropy


def test_logp_and_entropy_of_a_two_token_vocabulary():
    logp, entropy = reference_selective_log_softmax(v2_logits(1), token_one(1))
    assert logp.item() == pytest.approx(LOGP, abs=1e-15)
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-15)


def test_minus_inf_logits_are_valid():
    # A padded vocabulary: p = [0, 1/2, 1/2], ℓ = −ln 2, H = ln 2, and a finite gradient that is 0 at the padded entry.
    logits = torch.tensor([[[-math.inf, 0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    logp, entropy = reference_selective_log_softmax(logits, token_one(1))
    assert logp.item() == pytest.approx(-math.log(2), abs=1e-15)
    assert entropy.item() == pytest.approx(math.log(2), abs=1e-15)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 0, 0] == 0
    torch.testing.assert_close(grad[0, 0], torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64))  # ∂H/∂z = 0 here


def test_vocabulary_of_one():
    logp, entropy = reference_selective_log_softmax(torch.randn(2, 3, 1), torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(logp, torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(entropy, torch.zeros(2, 3, dtype=torch.float64))


# ---- Losses


def test_grpo_high_clip_and_unclipped_negative_advantage():
    # Row 0: A = +1, r = 1.5 > 1 + ε: L = −min(1.5, 1.2) = −1.2, the clipped branch: no gradient.
    # Row 1: A = −1, r = 1.5: L = −min(−1.5, −1.2) = 1.5 through r: ∂L/∂ℓ = −A r = 1.5.
    # grpo with T = 1: loss = mean(−1.2, 1.5) = 0.15; ∂loss/∂z of row 1 = ½ · 1.5 · [−¼, ¼].
    logits = v2_logits(2)
    out = reference_grpo_loss(logits, token_one(2), torch.tensor([1.0, -1.0]), old_logp=old_for_ratio(1.5, 1.5))
    assert out.loss.item() == pytest.approx(0.15, abs=1e-14)
    grad = grad_of(out, logits)
    assert torch.equal(grad[0], torch.zeros(1, 2, dtype=torch.float64))
    torch.testing.assert_close(grad[1, 0], 0.5 * 1.5 * DLOGP, rtol=0, atol=1e-15)
    # T = 1, so TRL's metric helpers read the (B, 1) indicators as one value per sequence: mean over the 2 rows.
    assert out.metrics["clip_ratio/high_mean"] == 0.5
    assert out.metrics["clip_ratio/low_mean"] == 0.0
    assert out.metrics["clip_ratio/region_mean"] == 0.5


def test_grpo_low_clip_and_delta():
    # Row 0: A = −1, r = 0.5 < 1 − ε: L = −min(−0.5, −0.8) = 0.8 (clipped: no gradient, counted as low-clipped).
    # Row 1: A = −1, r = 3, delta = 2: r̂ = 1.2 but r -> 2: L = −min(−2, −1.2) = 2, and the cap has no gradient.
    logits = v2_logits(2)
    adv = torch.tensor([-1.0, -1.0])
    out = reference_grpo_loss(logits, token_one(2), adv, old_logp=old_for_ratio(0.5, 3.0), delta=2.0)
    assert out.loss.item() == pytest.approx((0.8 + 2.0) / 2, abs=1e-14)
    assert torch.equal(grad_of(out, logits), torch.zeros(2, 1, 2, dtype=torch.float64))
    assert out.metrics["clip_ratio/low_mean"] == 0.5


def test_temperature_scales_the_gradient():
    # τ = 2 and logits [0, 2 ln 3] give the same p; row 1 of the first example, ∂/∂logits carries 1/τ.
    logits = v2_logits(1, temperature=2.0)
    out = reference_grpo_loss(logits, token_one(1), torch.tensor([-1.0]), old_logp=old_for_ratio(1.5), temperature=2.0)
    assert out.loss.item() == pytest.approx(1.5, abs=1e-14)
    torch.testing.assert_close(grad_of(out, logits)[0, 0], 1.5 * DLOGP / 2.0, rtol=0, atol=1e-15)


def test_bnpo_and_dr_grpo_and_dapo_normalizers():
    # Two sequences of T = 2, the second token of row 1 masked; old = None so r = 1 and L = −A on every token.
    logits = torch.tensor([[[0.0, LN3]] * 2] * 2, dtype=torch.float64, requires_grad=True)
    ids, adv = torch.ones(2, 2, dtype=torch.long), torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    # Σ m L = −2 −2 +1 = −3 over 3 tokens.
    assert reference_grpo_loss(logits, ids, adv, mask, loss_type="bnpo").loss.item() == pytest.approx(-1.0)
    assert reference_grpo_loss(logits, ids, adv, mask, loss_type="grpo").loss.item() == pytest.approx((-2 + 1) / 2)
    assert reference_grpo_loss(logits, ids, adv, mask, loss_type="luspo").loss.item() == pytest.approx((-4 + 1) / 2)
    dr = reference_grpo_loss(logits, ids, adv, mask, loss_type="dr_grpo", max_completion_length=6)
    assert dr.loss.item() == pytest.approx(-3 / (2 * 6))
    dapo = reference_grpo_loss(logits, ids, adv, mask, loss_type="dapo", num_items_in_batch=12, world_size=2)
    assert dapo.loss.item() == pytest.approx(-3 / (12 / 2))
    assert reference_grpo_loss(logits, ids, adv, mask, loss_type="dapo").loss.item() == pytest.approx(-1.0)


def test_cispo_caps_the_ratio_as_a_constant():
    # r = 1.5 capped at ε_high = 1.2: L = −1.2 · A · ℓ with A = 2; ∂L/∂z = −2.4 · [−¼, ¼].
    logits = v2_logits(1)
    out = reference_grpo_loss(
        logits, token_one(1), torch.tensor([2.0]), old_logp=old_for_ratio(1.5), loss_type="cispo", epsilon_high=1.2
    )
    assert out.loss.item() == pytest.approx(-2.4 * LOGP, abs=1e-14)  # N = 1 token
    torch.testing.assert_close(grad_of(out, logits)[0, 0], -2.4 * DLOGP, rtol=0, atol=1e-15)
    assert out.metrics["cispo_clip_ratio"] == 1.0


def test_sapo_at_ratio_one():
    # r = 1: σ(0) = ½ so L = −(4/τ) · ½ · A = −2A/τ; ∂L/∂ℓ = −(4/τ) · τ σ'(0) · A · r = −A.
    logits = v2_logits(2)
    out = reference_grpo_loss(logits, token_one(2), torch.tensor([1.0, -1.0]), loss_type="sapo")
    assert out.loss.item() == pytest.approx((-2.0 + 2.0 / FLOAT32_1_05) / 2, abs=1e-15)
    grad = grad_of(out, logits)
    torch.testing.assert_close(grad[:, 0], torch.stack([-0.5 * DLOGP, 0.5 * DLOGP]), rtol=0, atol=1e-15)


def test_vespo_weight_is_one_on_policy():
    # log w = 0: φ = exp(λ + 0 − λ · 1) = 1 for either sign, so L = −A ℓ and the loss is −Σ A ℓ / N.
    logits = v2_logits(2)
    out = reference_grpo_loss(logits, token_one(2), torch.tensor([3.0, -1.0]), loss_type="vespo")
    assert out.loss.item() == pytest.approx(-(3.0 - 1.0) * LOGP / 2, abs=1e-14)
    assert out.metrics["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-15)


def test_k3_kl_term():
    # ℓ_ref − ℓ = ln 2: kl = 2 − ln 2 − 1; with A = 0 the loss is β · kl, ∂/∂ℓ = β (1 − e^{ℓ_ref − ℓ}) = −β.
    logits = v2_logits(1)
    ref = torch.tensor([[LOGP + math.log(2.0)]], dtype=torch.float64)
    out = reference_grpo_loss(logits, token_one(1), torch.tensor([0.0]), ref_logp=ref, beta=0.1)
    kl = 2 - math.log(2) - 1
    assert out.loss.item() == pytest.approx(0.1 * kl, abs=1e-15)
    assert out.metrics["kl"] == pytest.approx(kl, abs=1e-15)
    torch.testing.assert_close(grad_of(out, logits)[0, 0], -0.1 * DLOGP, rtol=0, atol=1e-15)


def test_entropy_bonus_and_policy_loss_metric():
    logits = v2_logits(1)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    out = reference_grpo_loss(logits, token_one(1), torch.tensor([0.0]), entropy_coef=0.5)
    assert out.metrics["policy_loss"] == 0.0
    assert out.loss.item() == pytest.approx(-0.5 * h, abs=1e-15)
    # ∂H/∂z_v = −p_v (z_v − Σ p z): Σ p z = ¾ ln 3, so [−¼ (0 − ¾ ln 3), −¾ (ln 3 − ¾ ln 3)] = [3/16, −3/16] ln 3.
    want = -0.5 * torch.tensor([3 / 16 * LN3, -3 / 16 * LN3], dtype=torch.float64)
    torch.testing.assert_close(grad_of(out, logits)[0, 0], want, rtol=0, atol=1e-15)


def test_argument_errors():
    logits, ids, adv = v2_logits(1), token_one(1), torch.tensor([1.0])
    with pytest.raises(ValueError, match="loss_type"):
        reference_grpo_loss(logits, ids, adv, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        reference_grpo_loss(logits, ids, adv, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="ref_logp"):
        reference_grpo_loss(logits, ids, adv, beta=0.1)
    with pytest.raises(ValueError, match="temperature"):
        reference_grpo_loss(logits, ids, adv, temperature=0.0)
