"""The GRPO objective on per-token quantities: (B, T) log-probs and entropies in, loss and metrics out.

The one definition of the per-token loss outside the float64 oracle (reference/); docs/loss.md states the math.
The vocabulary-wide work (ℓ, H, ∂logits) lives in the row backends; everything here is O(B·T) and runs in float64,
so it is exact next to the fp32 row statistics. The loss calls `grpo_objective` with ℓ and H as autograd leaves and
reads g = ∂loss/∂ℓ and h = ∂loss/∂H off their gradients; that is what makes every option (sequence-level ratios,
entropy and off-policy masks, vespo) available to every backend. The one-read fused kernels recompute the
token-level coefficient g in registers, with `aggregation_weights` from here: `triton_logits._token_coef` and
`token_coef` in csrc/cpu_rows.c, the two other copies of `per_token_terms`' token-level math (ops/coef.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CLIPPED_LOSS_TYPES, TOKEN_COUNT_LOSS_TYPES, LossConfig
from .distributed import all_gather_varlen, all_reduce_sum, world_size


@dataclass(frozen=True)
class TokenInputs:
    """The per-token constants of the loss, validated and broadcast-ready (float64 unless noted)."""

    advantages: torch.Tensor  # [B, 1] or [B, T]
    mask: torch.Tensor  # [B, T], 0/1
    old_logp: torch.Tensor | None  # [B, T]; None: the detached current ℓ
    ref_logp: torch.Tensor | None  # [B, T]
    is_ratio: torch.Tensor | None  # [B, 1] or [B, T]
    sampling_logp: torch.Tensor | None  # [B, T]
    data_group: object = None  # the data-parallel process group the defaults span (None: this process alone)


def absent(mask: torch.Tensor, x: torch.Tensor, fill) -> torch.Tensor:
    """`x` where the token counts, `fill` where it is masked: a selection, never a product with the mask (0·NaN is
    NaN). A per-sequence [B, 1] `x` keeps its value on rows with at least one active token."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.where(mask.bool().any(-1, keepdim=True), x, fill)
    return torch.where(mask.bool(), x, fill)


def dapo_normalizer(mask: torch.Tensor, cfg: LossConfig, group=None) -> torch.Tensor:
    """max(N, 1) / P, N = num_items_in_batch (default: active tokens on all ranks), P = world size."""
    if cfg.num_items_in_batch is not None:
        n = mask.new_full((), cfg.num_items_in_batch, dtype=torch.float64)  # a fill, not a copy from the host
    else:
        n = all_reduce_sum(mask.sum(), group)
    return n.clamp(min=1.0) / world_size(group)


def aggregation_weights(mask: torch.Tensor, cfg: LossConfig, group=None) -> torch.Tensor:
    """w[b, t] such that the aggregated loss is Σ w·L (docs/loss.md, "Aggregation"). Computed once per call: pass it
    to `grpo_objective` as `weights` (under data parallelism the token-count losses all-reduce here)."""
    batch, length = mask.shape
    if cfg.loss_type in TOKEN_COUNT_LOSS_TYPES:
        return mask / dapo_normalizer(mask, cfg, group)
    if cfg.loss_type in ("grpo", "sapo"):
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / batch
    if cfg.loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if cfg.loss_type == "dr_grpo":
        return mask / (batch * (cfg.max_completion_length or length))
    return mask / batch  # luspo


def entropy_bonus_weights(effective_mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """∂loss/∂H of the entropy bonus −c · mean of H over the micro-batch's effective tokens (local, as TRL)."""
    return -cfg.entropy_coef * effective_mask / effective_mask.sum().clamp(min=1.0)


def _high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, group=None) -> torch.Tensor:
    """Keep active tokens with H >= the (1 − q) quantile of the active entropies of all ranks (TRL's threshold,
    in float32 as TRL takes it). Sort-based, without data-dependent shapes, so torch.compile can trace it."""
    active = mask.bool()
    if group is not None:
        values = all_gather_varlen(entropy[active].float(), group)
        count = torch.tensor(values.numel(), device=entropy.device)
    else:
        values = entropy.float().masked_fill(~active, math.inf).flatten()  # inactive tokens sort last
        count = active.sum()
    ranked = values.sort().values
    position = (1.0 - quantile) * (count - 1).clamp(min=0).double()
    lower = position.floor().long().reshape(1)
    upper = position.ceil().long().reshape(1)
    weight = (position - lower.double()).float()
    threshold = torch.lerp(ranked.index_select(0, lower), ranked.index_select(0, upper), weight)  # [1]
    return ((entropy * mask >= threshold) & active & (count > 0)).to(mask.dtype)


def _gamma_weights(
    adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, rho: torch.Tensor | None, cfg: LossConfig
) -> torch.Tensor:
    """vespo's φ(w) per sequence, [B, 1], no grad (TRL's get_gamma_weights). `log_ratio` is 0 and ρ is 1 at masked
    tokens (TRL sums log ρ over every position, padded ones included; here they add log 1 = 0)."""
    lower = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if rho is not None:
        seq = seq + rho.log().clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class PerTokenTerms:
    """The per-token loss L of docs/loss.md and what the metrics read off it (float64)."""

    loss: torch.Tensor  # [B, T], or [B, 1] at sequence level without KL (broadcasts); before the completion mask
    ratio: torch.Tensor  # [B, T] or [B, 1]: the importance weight r (after the delta cap of the clipped types)
    kl: torch.Tensor | None  # [B, T] the k3 estimator (β != 0)
    phi: torch.Tensor | None  # [B, 1] vespo's φ
    entropy_mask: torch.Tensor | None  # [B, T] 0/1 (top_entropy_quantile < 1)


def per_token_terms(logp: torch.Tensor, entropy: torch.Tensor, inp: TokenInputs, cfg: LossConfig) -> PerTokenTerms:
    """L per token: the objective after the clip, the off-policy and entropy masks and ρ, plus β·KL, before the
    completion mask and the aggregation. Differentiable in `logp` ([B, T] float64); `entropy` enters only through
    the (detached) entropy mask. Follows TRL 1.16 `GRPOTrainer._compute_loss` line by line."""
    mask = inp.mask
    # Masked means absent: whatever a masked position holds (NaN, ±inf, a −1e4 sentinel, in ℓ, H or any input),
    # it is selected away here, before any arithmetic, so it reaches neither the loss, the gradient nor a metric.
    # The metrics keep the raw A: they only compare its sign (never NaN), and TRL's per-sequence metric means count
    # fully masked rows too (at sequence level), with their A.
    adv_raw = inp.advantages
    adv, logp, entropy = absent(mask, adv_raw, 0.0), absent(mask, logp, 0.0), absent(mask, entropy, 0.0)
    rho = None if inp.is_ratio is None else absent(mask, inp.is_ratio, 1.0)
    old = logp.detach() if inp.old_logp is None else absent(mask, inp.old_logp, logp.detach())
    log_ratio = logp - old
    if cfg.importance_sampling_level == "token":
        log_w = log_ratio
    else:  # GSPO: one ratio per sequence, [B, 1]
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_w)

    kl = None
    if cfg.beta != 0.0:
        ref = absent(mask, inp.ref_logp, logp.detach())  # kl = 0 at a masked token
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * ratio

    phi = None
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        if cfg.delta is not None:
            ratio = torch.clamp(ratio, max=cfg.delta)  # the clip metrics see this, as in TRL
        per_token = -torch.min(ratio * adv, clipped * adv)
    elif cfg.loss_type == "sapo":
        temps = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token = -torch.sigmoid(temps * (ratio - 1)) * 4 / temps * adv
    else:  # vespo
        with torch.no_grad():
            phi = _gamma_weights(adv_raw, log_ratio.detach(), mask, rho, cfg)
        per_token = -absent(mask, phi, 0.0) * adv * logp

    if cfg.off_policy_mask_threshold is not None:
        sampling = old if inp.sampling_logp is None else absent(mask, inp.sampling_logp, logp.detach())
        seq_kl = ((sampling - logp.detach()).nan_to_num(nan=0.0) * mask).sum(-1, keepdim=True)
        seq_kl = seq_kl / mask.sum(-1, keepdim=True).clamp(min=1.0)
        per_token = per_token * ((adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)).to(mask.dtype)

    entropy_mask = None
    if cfg.top_entropy_quantile < 1.0:
        entropy_mask = _high_entropy_mask(entropy.detach(), mask, cfg.top_entropy_quantile, inp.data_group)
        per_token = per_token * entropy_mask

    if rho is not None and cfg.loss_type != "vespo":
        per_token = per_token * rho
    if kl is not None:
        per_token = per_token + cfg.beta * kl
    return PerTokenTerms(per_token, ratio, kl, phi, entropy_mask)


def per_token_objective(
    logp: torch.Tensor, entropy: torch.Tensor, inp: TokenInputs, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`grpo_loss(..., reduction="none")`: the [B, T] per-token loss L of `per_token_terms`, exactly 0 at masked
    tokens (selected, so a non-finite L there stays out), differentiable in `logp`; and TRL's metrics. The options
    that only exist aggregated (entropy_coef, num_items_in_batch, max_completion_length) are refused by the caller."""
    terms = per_token_terms(logp, entropy, inp, cfg)
    loss = torch.where(inp.mask != 0, terms.loss.expand(inp.mask.shape), 0.0)
    with torch.no_grad():
        metrics = _objective_metrics(terms, entropy, inp, cfg)
    return loss, metrics


def grpo_objective(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    inp: TokenInputs,
    cfg: LossConfig,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (0-d, differentiable in `logp` and `entropy`) and TRL's metrics (detached 0-d tensors).

    `logp`, `entropy`: [B, T] float64. `weights`: `aggregation_weights(inp.mask, cfg, inp.data_group)` when the
    caller has it already (None: computed here). The loss is Σ w·L over `per_token_terms`, plus the entropy bonus.
    """
    mask = inp.mask
    terms = per_token_terms(logp, entropy, inp, cfg)
    if weights is None:
        weights = aggregation_weights(mask, cfg, inp.data_group)
    loss = (terms.loss * weights).sum()
    policy_loss = loss.detach()
    if cfg.entropy_coef != 0.0:
        effective = mask if terms.entropy_mask is None else mask * terms.entropy_mask
        loss = loss + (absent(mask, entropy, 0.0) * entropy_bonus_weights(effective, cfg)).sum()

    with torch.no_grad():
        metrics = _objective_metrics(terms, entropy, inp, cfg)
        if cfg.entropy_coef != 0.0:
            metrics["policy_loss"] = policy_loss
    return loss, metrics


def objective_coefficients(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    inp: TokenInputs,
    cfg: LossConfig,
    weights: torch.Tensor | None,
    need_grad: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """The step from the objective to the row kernels' gradient coefficients, for every backend: (loss, detached;
    metrics; g = ∂loss/∂ℓ; h = ∂loss/∂H, None where the loss does not depend on H). ℓ (float64) and H are made
    autograd leaves of `grpo_objective`; g and h are float64, None both without `need_grad`."""
    with torch.enable_grad():
        lp = logp.detach().double().requires_grad_(need_grad)
        ent = entropy.detach().double().requires_grad_(need_grad and cfg.entropy_coef != 0.0)
        loss, metrics = grpo_objective(lp, ent, inp, cfg, weights)
    if not need_grad:
        return loss.detach(), metrics, None, None
    g, h = coefficients(loss, lp, ent if ent.requires_grad else None)
    return loss.detach(), metrics, g, h


def coefficients(
    output: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor | None, grad_output: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g, h) = the vector-Jacobian product of `output` (the loss, or reduction="none"'s per-token loss with its
    upstream gradient `grad_output`) with the leaves ℓ and H (None: not differentiated); g is zeros where the output
    does not depend on ℓ (every token masked)."""
    wrt = [logp] if entropy is None else [logp, entropy]
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(wrt)
    if output.requires_grad:
        grads = torch.autograd.grad(output, wrt, grad_output, allow_unused=True)
    g = torch.zeros_like(logp) if grads[0] is None else grads[0]
    h = grads[1] if entropy is not None else None
    return g, h


def _objective_metrics(
    terms: PerTokenTerms, entropy: torch.Tensor, inp: TokenInputs, cfg: LossConfig
) -> dict[str, torch.Tensor]:
    kl_value = None if terms.kl is None else terms.kl.detach()
    entropy = absent(inp.mask, entropy.detach(), 0.0)  # masked means absent, in the metrics too
    metrics = _metrics(entropy, kl_value, terms.ratio.detach(), inp.advantages, inp.mask, cfg, inp.data_group)
    if terms.phi is not None:
        phi_metric = {"vespo/phi_seq_mean": terms.phi}
        per_seq = _per_sequence(phi_metric, inp.mask, True)
        metrics.update(_global_means(phi_metric, inp.mask, inp.data_group, per_seq))
    return metrics


def _global_means(
    values: dict[str, torch.Tensor], mask: torch.Tensor, group=None, per_sequence: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Token-weighted means over all ranks in one all-reduce; the values named in `per_sequence` ([B, 1]) average
    over sequences, every row counted (as TRL)."""
    sums = []
    for name, x in values.items():
        if name in per_sequence:
            sums += [x.sum(), x.new_full((), float(x.shape[0]))]
        else:
            sums += [(x * mask).sum(), mask.sum()]
    totals = all_reduce_sum(torch.stack(sums).double(), group)
    return {name: totals[2 * i] / totals[2 * i + 1].clamp(min=1.0) for i, name in enumerate(values)}


def _metrics(
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    group=None,
) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    if kl is not None:
        values["kl"] = kl
    values["entropy"] = entropy
    if cfg.loss_type in CLIPPED_LOSS_TYPES:
        low = ((ratio < 1 - cfg.epsilon_low) & (adv < 0)).double()
        high = ((ratio > 1 + cfg.epsilon_high) & (adv > 0)).double()
        values["clip_ratio/low_mean"] = low
        values["clip_ratio/high_mean"] = high
        values["clip_ratio/region_mean"] = torch.maximum(low, high)
    elif cfg.loss_type == "cispo":
        values["cispo_clip_ratio"] = ((ratio > cfg.epsilon_high) & (adv > 0)).double()
    return _global_means(values, mask, group, _per_sequence(values, mask, cfg.importance_sampling_level == "sequence"))


def _per_sequence(values: dict[str, torch.Tensor], mask: torch.Tensor, sequence_level: bool) -> tuple[str, ...]:
    """The metric values that are one per sequence ([B, 1] while T > 1; at T = 1, the ratio's when it is
    sequence-level), which TRL averages over every row; the others are token means over active tokens."""
    if mask.shape[-1] > 1:
        return tuple(name for name, x in values.items() if x.shape[-1] == 1)
    return tuple(name for name in values if sequence_level and name not in ("kl", "entropy"))
