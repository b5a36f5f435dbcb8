"""Group-relative advantages on the rollout side: each completion's reward against its group's."""

from __future__ import annotations

import math

import torch

SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor, num_generations: int | None = None, *, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """A = r − mean of its group, divided by (std + eps) unless scale == "none".

    Args:
        rewards: [B·G] with `num_generations=G` (groups are consecutive), or [B, G].
        scale: "group" (Bessel std over each group), "batch" (Bessel std over all rewards) or "none".
    Returns:
        Advantages of the same shape as `rewards`, float32 (float64 for float64 input). A group whose rewards are
        all equal gets exactly 0, never NaN.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), num_generations=4)
    tensor([ 0.8659, -0.8659, -0.8659,  0.8659])
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if num_generations is not None and (isinstance(num_generations, bool) or not isinstance(num_generations, int)):
        raise TypeError(f"num_generations must be an int or None, got {type(num_generations).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0 (it keeps a group of equal rewards from 0/0), got {eps}")
    if rewards.dim() == 1:
        if num_generations is None or num_generations <= 0 or rewards.numel() % num_generations:
            raise ValueError(
                f"num_generations must be a positive divisor of len(rewards)={rewards.numel()} for 1-D rewards, "
                f"got {num_generations}"
            )
        grouped = rewards.view(-1, num_generations)
    elif rewards.dim() == 2:
        if num_generations not in (None, rewards.shape[1]):
            raise ValueError(
                f"num_generations={num_generations} disagrees with rewards of shape {tuple(rewards.shape)}"
            )
        grouped = rewards
    else:
        raise ValueError(f"rewards must be [B*G] or [B, G], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (a reward function returned NaN or inf)")
    grouped = grouped.double() if rewards.dtype == torch.float64 else grouped.float()
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale != "none":
        std = _bessel_std(grouped, dim=1) if scale == "group" else _bessel_std(grouped.reshape(1, -1), dim=1)
        adv = adv / (std + eps)
    return adv.reshape(rewards.shape)


def _bessel_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std, defined as 0 for a single sample (so a one-completion group gets A = 0, not NaN)."""
    if x.shape[dim] < 2:
        return torch.zeros_like(x.sum(dim=dim, keepdim=True))
    return x.std(dim=dim, keepdim=True, unbiased=True)
