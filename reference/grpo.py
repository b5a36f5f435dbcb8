"""The float64 oracle of the GRPO loss family: docs/loss.md written out as plain PyTorch, one line per rule.

Tests and benchmarks compare every backend with this file; tests/reference checks it against TRL 1.16's own
`GRPOTrainer._compute_loss` to 1e-10. It is written to be read, not to be fast.

Where docs/loss.md and TRL 1.16 (`trl/trainer/grpo_trainer.py`) disagree, this file follows TRL (TRL wins):

1. sapo's temperatures and vespo's (k, λ) are built by TRL with `torch.where(cond, python_float, python_float)`,
   which yields float32: TRL's τ_neg is float32(1.05) = 1.0499999523..., not 1.05. We round the same way
   (`_as_float32`). The spec names the values, not their precision.
2. The entropy-mask threshold: TRL casts the active entropies to float32 (`.float()`) before `torch.quantile`, so the
   threshold is a float32 quantile of float32-rounded H, compared with the float64 H. We do the same. A token whose
   H sits exactly on the quantile can be dropped where a float64 quantile would keep it.
3. The metrics of TRL (`masked_seq_mean`, `global_masked_mean`) treat ANY tensor whose second dim is 1 as "one value
   per sequence" and average it over all B rows, ignoring the mask. So (a) at importance_sampling_level="sequence"
   the clip ratios (and vespo's φ mean) are sequence-weighted over every row, fully masked ones included, not
   "token-weighted over active tokens" as the spec's Metrics section says; (b) when T == 1 even `entropy` and `kl`
   are plain means over all B rows, masked tokens included; (c) the clip indicators are float32 (`.float()`), so
   those per-sequence means are float32 divisions (1 of 3 rows clipped logs 0.3333333432674408).
4. The off-policy mask uses `torch.nan_to_num(ℓ_s − sg(ℓ), nan=0.0)`, which also maps ±inf to ±float64 max (the spec
   says only "NaN counts as 0"). With (B, T) advantages its `A ≥ 0` test is per token, so it keeps tokens, not
   whole sequences.
5. vespo folds ρ in by summing log ρ over the LAST dim of ρ as given, without the completion mask: a (B, T) ρ counts
   padded positions too (here they hold ρ = 1, disagreement 10), a (B, 1) ρ counts once (not T times). The spec's
   Σ_t log ρ is silent on both.
6. Active tokens: TRL selects them with `mask.bool()` (any nonzero mask value), the spec says "m = 1". Same thing for
   0/1 masks.
7. `clip_ratio/low_min` and `clip_ratio/high_max` (not in the spec): per-sequence means of the clip indicators
   divided by Σ_t m WITHOUT the max(·, 1) guard, so fully masked rows give NaN and are skipped by nanmin/nanmax;
   NaN when every row is fully masked.
8. Entropy of a row with −inf logits: TRL's CPU helper `entropy_from_logits` computes −Σ exp(ℓ_v) ℓ_v, which is NaN
   (0 · −inf). Here, as the spec demands, a token with p_v = 0 contributes 0. (This one follows the spec: the
   parity test therefore uses finite logits.)
9. dapo/cispo/vespo: the spec's default N is Σ m over all ranks; this single-process oracle only sees its own mask,
   so with world_size > 1 pass `num_items_in_batch` (as TRL always does).
10. Masked means absent (stricter than TRL, as the spec demands): a token with m = 0 contributes nothing whatever
   its logits, ℓ_old, ℓ_ref, ℓ_s, A or ρ hold (NaN, ±inf, −1e4 sentinels). Its values are replaced, before any use,
   by neutral ones: ℓ_old = ℓ_ref = ℓ_s = sg(ℓ) (ratio 1, KL 0), A = 0, ρ = 1 (a per-sequence ρ on a fully masked
   row too), ℓ = H = 0. TRL gives NaN there (0 · NaN), sums vespo's log ρ over padded positions too (disagreement
   5), and at T = 1 averages its metrics over masked tokens too (3b): on ordinary padding (finite values, ρ = 1
   where nothing was sampled) the loss and gradient agree, and the metrics wherever T > 1. The metrics read the raw
   A, only through its sign: TRL's per-sequence metric means (3a) count a fully masked row with its A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # L = -min(r A, clip(r) A)
IS_LEVELS = ("token", "sequence")
ADVANTAGE_SCALES = ("group", "batch", "none")
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of the sequence log-weight (and of each log ρ)
VESPO_LOG_W_MAX = 20.0


@dataclass
class ReferenceOutput:
    loss: torch.Tensor  # 0-d float64, differentiable w.r.t. the logits
    logp: torch.Tensor  # (B, T) float64, attached to the graph
    entropy: torch.Tensor  # (B, T) float64, attached to the graph
    metrics: dict[str, float] = field(default_factory=dict)  # TRL's names
    # (B, T) float64 per-token loss L before aggregation (0 at masked tokens), attached to the graph
    per_token_loss: torch.Tensor | None = None


def reference_selective_log_softmax(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = log softmax(z)_{t,y_t} and H_t = −Σ_v p_{t,v} log p_{t,v}, with z = logits / τ, all in float64.

    (H = lse − Σ p z in exact arithmetic; formed that way in float64 it loses ~eps64·|z|² to cancellation, which
    for logits of size 1e4 is a negative "entropy" of −3e-9. log_softmax is shifted by the row max, so ℓ and
    −Σ p log p stay exact to float64 rounding even there.)

    Args:
        logits: (B, T, V) any float dtype.
        ids: (B, T) integer token ids in [0, V).
        temperature: τ > 0.
    Returns:
        (logp, entropy), both (B, T) float64 and differentiable w.r.t. `logits`.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.double() / temperature  # (B, T, V)
    log_p = torch.log_softmax(z, dim=-1)  # (B, T, V)
    logp = log_p.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    p = torch.exp(log_p)
    # A −inf logit (padded vocabulary) has p = 0 and contributes 0 to Σ p log p; p * log p would be 0 · −inf = NaN,
    # and so would its gradient, so log p is replaced by 0 there before the product (the gradient through `where`
    # is then 0).
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return logp, entropy


def reference_group_advantages(
    rewards: torch.Tensor, num_generations: int | None = None, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """A = r − mean of its group; unless scale == "none", A /= (std + eps), std unbiased (Bessel).

    Args:
        rewards: (B·G,) with `num_generations=G` (groups are consecutive), or (B, G).
        scale: "group" (std over each group), "batch" (std over all rewards) or "none".
    Returns:
        float64 advantages of the shape of `rewards`. A group whose rewards are all equal gets exactly 0 (also for
        G = 1, where the std of one sample is defined as 0).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if rewards.dim() == 1:
        if num_generations is None or num_generations <= 0 or rewards.numel() % num_generations:
            raise ValueError(
                f"num_generations must divide len(rewards)={rewards.numel()} for 1-D rewards, got {num_generations}"
            )
        grouped = rewards.double().reshape(-1, num_generations)  # (B, G)
    elif rewards.dim() == 2:
        if num_generations not in (None, rewards.shape[1]):
            raise ValueError(
                f"num_generations={num_generations} disagrees with rewards of shape {tuple(rewards.shape)}"
            )
        grouped = rewards.double()
    else:
        raise ValueError(f"rewards must be (B*G,) or (B, G), got shape {tuple(rewards.shape)}")

    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (_bessel_std(grouped, dim=1) + eps)
    elif scale == "batch":
        advantages = advantages / (_bessel_std(grouped.reshape(1, -1), dim=1) + eps)
    # r − mean(r) of equal floats can be a rounding error away from 0 (mean of three 0.1 is 0.10000000000000002).
    all_equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    advantages = torch.where(all_equal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(rewards.shape)


def _bessel_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std along `dim` (keepdim), defined as 0 for a single sample instead of NaN."""
    if x.shape[dim] < 2:
        return torch.zeros_like(x.sum(dim=dim, keepdim=True))
    return x.std(dim=dim, keepdim=True, unbiased=True)


def reference_grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    *,
    loss_type: str = "grpo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    temperature: float = 1.0,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: float | None = None,
    sampling_logp: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    world_size: int = 1,
) -> ReferenceOutput:
    """The GRPO loss family of docs/loss.md (TRL 1.16 `GRPOTrainer._compute_loss`), in float64.

    Args: as `grpo_kernels.grpo_loss` (see docs/loss.md, Inputs), plus `world_size` P, which only divides the
    dapo/cispo/vespo normalizer. Gradients flow only into `logits`; every other tensor is a constant.
    Returns:
        ReferenceOutput(loss 0-d, logp (B, T), entropy (B, T), metrics named as TRL logs them).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {importance_sampling_level!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={beta})")
    if logits.dim() != 3 or completion_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and completion_ids (B, T), got {tuple(logits.shape)} and "
            f"{tuple(completion_ids.shape)}"
        )
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high  # as TRL's GRPOConfig

    # ---- Per token: ℓ, H (differentiable), and the constants, all float64.
    batch, length = completion_ids.shape
    mask = torch.ones(batch, length, dtype=torch.float64)
    if completion_mask is not None:
        mask = completion_mask.detach().double()
    # Masked means absent (disagreement 10): a masked row's logits reach the graph only as a constant, so that a
    # NaN there cannot enter the gradient, and every masked value is selected away (`_absent`) before any use.
    active = mask.bool()
    logits = torch.where(active.unsqueeze(-1), logits, logits.detach())
    logp, entropy = reference_selective_log_softmax(logits, completion_ids, temperature)  # (B, T) each
    logp_all, entropy_all = logp, entropy  # returned as computed, masked positions included
    logp, entropy = _absent(mask, logp, 0.0), _absent(mask, entropy, 0.0)
    adv_raw = advantages.detach().double()
    adv_raw = adv_raw.unsqueeze(1) if adv_raw.dim() == 1 else adv_raw  # (B, 1) or (B, T); the metrics read it
    adv = _absent(mask, adv_raw, 0.0)
    old = logp.detach() if old_logp is None else _absent(mask, old_logp.detach().double(), logp.detach())
    sampling = old if sampling_logp is None else _absent(mask, sampling_logp.detach().double(), logp.detach())
    rho = None
    if importance_sampling_ratio is not None:
        rho = importance_sampling_ratio.detach().double()
        rho = _absent(mask, rho.unsqueeze(1) if rho.dim() == 1 else rho, 1.0)  # (B, 1) or (B, T)

    # ---- Entropy mask (step 2 of the spec, computed first as TRL does; H is no-grad here).
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = _high_entropy_mask(entropy.detach(), mask, 1.0 - top_entropy_quantile)

    # ---- Off-policy mask (step 1): keep b iff A ≥ 0 or mean_t m (ℓ_s − sg(ℓ)) ≤ δ_op.
    off_policy_keep = None
    if off_policy_mask_threshold is not None:
        seq_kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)  # disagreement 4: ±inf -> ±max too
        avg_seq_kl = (seq_kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        off_policy_keep = ((adv >= 0) | (avg_seq_kl <= off_policy_mask_threshold)).to(mask.dtype)

    # ---- Importance weight r = exp(log w).
    log_ratio = logp - old  # d_t
    if importance_sampling_level == "token":
        log_w = log_ratio  # (B, T)
    else:  # GSPO: one masked-mean log-ratio per sequence
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    ratio = torch.exp(log_w)

    # ---- KL, the k3 estimator (optionally importance-weighted by r before any delta clamp).
    kl = None
    if beta != 0.0:
        ref = _absent(mask, ref_logp.detach().double(), logp.detach())
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if use_bias_correction_kl:
            kl = kl * ratio

    # ---- Per-token loss L by loss_type.
    phi = None
    if loss_type == "cispo":
        capped = torch.clamp(ratio, max=epsilon_high).detach()  # ε_high is an absolute cap here
        per_token_loss = -capped * adv * logp
    elif loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # r̂, taken before the delta cap
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)  # two-sided clipping; the clip metrics below see this r
        per_token_loss = -torch.min(ratio * adv, clipped * adv)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, _as_float32(sapo_temperature_pos), _as_float32(sapo_temperature_neg))
        per_token_loss = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv
    else:  # vespo
        # φ reads the raw A (its sign only: a fully masked row's φ enters the φ metric, TRL's mean over every row)
        phi = _vespo_phi(
            adv_raw, log_ratio.detach(), mask, rho, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg
        )
        per_token_loss = -_absent(mask, phi, 0.0) * adv * logp

    # ---- Then, in this order: off-policy mask, entropy mask, ρ (vespo folded it into φ), KL.
    if off_policy_keep is not None:
        per_token_loss = per_token_loss * off_policy_keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if rho is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * rho
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl

    # ---- The per-token loss before aggregation (reduction="none"): masked tokens are 0, selected, not multiplied.
    per_token_out = torch.where(mask != 0, per_token_loss.expand(batch, length), 0.0)

    # ---- Aggregation (gradient-accumulation factors are 1).
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        max_len = length if max_completion_length is None else max_completion_length
        loss = (per_token_loss * mask).sum() / (batch * max_len)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:  # dapo, cispo, vespo
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=torch.float64)
        loss = (per_token_loss * mask).sum() / (items.clamp(min=1.0) / world_size)

    # ---- Entropy bonus: mean H over the tokens the policy term acts on; the gradient flows through H.
    metrics: dict[str, float] = {}
    if entropy_coef != 0.0:
        metrics["policy_loss"] = loss.item()
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        mean_entropy = (entropy * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
        loss = loss - entropy_coef * mean_entropy

    # ---- Metrics, exactly as TRL logs them (disagreement 3 for (B, 1) tensors).
    with torch.no_grad():
        if kl is not None:
            metrics["kl"] = _trl_global_masked_mean(kl, mask)
        metrics["entropy"] = _trl_global_masked_mean(entropy, mask)
        if loss_type in CLIPPED_LOSS_TYPES:
            # float32 indicators, as TRL: at sequence level, (B, 1), their means are then float32 divisions.
            is_low = ((ratio < 1 - epsilon_low) & (adv_raw < 0)).float()
            is_high = ((ratio > 1 + epsilon_high) & (adv_raw > 0)).float()
            is_region = ((is_low > 0) | (is_high > 0)).float()
            per_seq = importance_sampling_level == "sequence" if length == 1 else None  # None: by shape
            one_per_seq = is_low.shape[1] == 1 if per_seq is None else per_seq
            metrics["clip_ratio/low_mean"] = _trl_global_masked_mean(is_low, mask, per_seq)
            metrics["clip_ratio/high_mean"] = _trl_global_masked_mean(is_high, mask, per_seq)
            metrics["clip_ratio/region_mean"] = _trl_global_masked_mean(is_region, mask, per_seq)
            metrics["clip_ratio/low_min"] = _nan_ignoring(torch.min, _trl_masked_seq_mean(is_low, mask, one_per_seq))
            metrics["clip_ratio/high_max"] = _nan_ignoring(torch.max, _trl_masked_seq_mean(is_high, mask, one_per_seq))
        elif loss_type == "cispo":
            is_capped = ((ratio > epsilon_high) & (adv_raw > 0)).float()
            per_seq = importance_sampling_level == "sequence" if length == 1 else None
            metrics["cispo_clip_ratio"] = _trl_global_masked_mean(is_capped, mask, per_seq)
        elif loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = _trl_global_masked_mean(phi, mask, True if length == 1 else None)

    return ReferenceOutput(
        loss=loss, logp=logp_all, entropy=entropy_all, metrics=metrics, per_token_loss=per_token_out
    )


def _absent(mask: torch.Tensor, x: torch.Tensor, fill) -> torch.Tensor:
    """x where m != 0, `fill` where m == 0 (a selection: 0 · NaN would be NaN). A (B, 1) x is per sequence: it
    keeps its value on rows with an active token."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.where(mask.bool().any(-1, keepdim=True), x, fill)
    return torch.where(mask.bool(), x, fill)


def _as_float32(value: float) -> float:
    """The float32 rounding TRL's `torch.where(cond, python_float, python_float)` applies (disagreement 1)."""
    return torch.tensor(value, dtype=torch.float32).item()


def _high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Tokens with H ≥ the `quantile`-quantile of H over the active tokens, and m != 0 (bool (B, T))."""
    active = entropy[mask.bool()].float()  # float32, as TRL (disagreement 2)
    if active.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(active, quantile)  # linear interpolation
    return (entropy * mask >= threshold) & mask.bool()


def _vespo_phi(
    adv: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    rho: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """φ = exp(λ + k log w − λ w) per sequence, w the clamped sequence importance weight; NaN/inf -> 0 (constant)."""
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1)
    if rho is not None:
        # log w = log(π/π_old) + log(π_old/π_sampler); ρ is summed over its own last dim (disagreement 5; masked
        # positions hold ρ = 1 here, disagreement 10)
        log_rho = torch.clamp(torch.log(rho), VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        seq_log_ratio = seq_log_ratio + log_rho.sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = adv >= 0
    k = torch.where(nonneg, _as_float32(k_pos), _as_float32(k_neg))
    lam = torch.where(nonneg, _as_float32(lambda_pos), _as_float32(lambda_neg)).clamp(min=_as_float32(1e-4))
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def _trl_global_masked_mean(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool | None = None) -> float:
    """Σ m x / max(Σ m, 1), TRL's `global_masked_mean` verbatim, dtypes included (see the metrics above).

    A tensor whose dim 1 is 1 counts as one value per sequence: a plain mean over all B rows (disagreement 3). At
    T = 1 TRL does the same for per-token values, masked tokens included; here (disagreement 10) only a value that
    is per sequence (`per_sequence`, default: dim 1 is 1 while T > 1) is averaged so.
    """
    if per_sequence is None:
        per_sequence = x.shape[1] == 1 and mask.shape[1] != 1
    if per_sequence:
        local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]))  # float32 count, as TRL
    else:
        local_sum, local_count = (x * mask).sum(), mask.sum().float()
    totals = torch.stack([local_sum, local_count])  # promoted to the wider dtype
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _trl_masked_seq_mean(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """Per-sequence Σ_t m x / Σ_t m (NaN for a fully masked row, as TRL); per-sequence values pass through."""
    if per_sequence:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def _nan_ignoring(reduce, values: torch.Tensor) -> float:
    """min/max over the non-NaN values; NaN when there are none (TRL's nanmin/nanmax)."""
    finite_or_inf = values[~torch.isnan(values)]
    return float("nan") if finite_or_inf.numel() == 0 else reduce(finite_or_inf).item()
