"""The tensor checks of the public functions: run once, at the boundary, so that nothing below re-checks.

`grpo_loss`, `selective_log_softmax` and `fused_linear_grpo_loss` call these; each raises a TypeError/ValueError
that names the argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any

import torch

from .loss_math import TokenInputs

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the torch path only


def check_tensor(name: str, x: Any, shapes: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}, got {x.device}")
    return x


def check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().double()


def check_rows_tensor(name: str, x: Any, last: str) -> torch.Tensor:
    """A non-empty (B, T, `last`) float32/bfloat16/float16/float64 tensor: the logits, or fused-linear's hidden
    states (float64 runs on the torch path, in float64; `dispatch` refuses it on Triton)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D (B, T, {last}), got {x.dim()}-D with shape {tuple(x.shape)}")
    if x.dtype not in LOGITS_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if min(x.shape) == 0:
        raise ValueError(f"{name} must have B, T, {last} >= 1, got shape {tuple(x.shape)}")
    return x


def check_logits(logits: Any) -> torch.Tensor:
    logits = check_rows_tensor("logits", logits, "V")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits must have a unit stride along the vocabulary (got strides {logits.stride()}); "
            "batch and time strides may be anything, so slice the time axis rather than transposing the vocabulary"
        )
    return logits


def check_ids(ids: Any, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Shape and dtype; the value range is `check_ids_range`, run where the vocabulary size is known."""
    ids = check_tensor("completion_ids", ids, ((batch, length),), device)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"completion_ids must be int32/int64, got {ids.dtype}")
    return ids


def token_inputs(
    batch: int,
    length: int,
    dev: torch.device,
    advantages: Any,
    completion_mask: Any,
    old_logp: Any,
    ref_logp: Any,
    importance_sampling_ratio: Any,
    sampling_logp: Any,
    *,
    beta: float,
    data_group: Any = None,
) -> TokenInputs:
    """The per-token tensors of a (batch, length) call on `dev`, checked and in float64, as one `TokenInputs`."""
    bt = ((batch, length),)
    adv = check_float("advantages", check_tensor("advantages", advantages, ((batch,), (batch, 1), (batch, length)), dev))
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    if completion_mask is None:
        mask = torch.ones(batch, length, dtype=torch.float64, device=dev)
    else:
        mask = check_tensor("completion_mask", completion_mask, bt, dev).detach().double()
    optional = {}
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp)):
        optional[name] = None if x is None else check_float(name, check_tensor(name, x, bt, dev))
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={beta})")
    is_ratio = importance_sampling_ratio
    if is_ratio is not None:
        shapes = ((batch,), (batch, 1), (batch, length))
        is_ratio = check_float("importance_sampling_ratio", check_tensor("importance_sampling_ratio", is_ratio, shapes, dev))
        if is_ratio.dim() == 1:
            is_ratio = is_ratio.unsqueeze(1)
    return TokenInputs(
        adv, mask, optional["old_logp"], optional["ref_logp"], is_ratio, optional["sampling_logp"], data_group
    )


def check_ids_range(ids: torch.Tensor, vocab: int) -> None:
    """O(B·T) range check of the ids, no pass over the logits; run eagerly (inside the op under torch.compile)."""
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"completion_ids must lie in [0, {vocab}) (the logits' vocabulary), got values in [{lo}, {hi}]")
