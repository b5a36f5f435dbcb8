"""The row kernels as torch.library custom ops, so a compiled step with grpo_loss in it is one graph.

Eager calls go through the autograd.Function in api.py (the one-read fused path). Under torch.compile, dynamo
cannot trace the kernels' host code, so grpo_loss calls `compiled_grpo_loss`: two opaque ops, `row_stats`
(forward) and `row_grad` (its backward), with the O(B·T) objective traced between them; AOT autograd
differentiates that objective to get g and h. This is the two-read schedule of the sequence-level options, for
every option. The value checks are eager's: on the device in the traced code (`value_guard`), and with
check_inputs=True `check_values` in an op of its own, which reads its findings back and raises by name. Imports
api's helpers, never api itself (api imports this module).
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import torch

from .config import NUMERIC_OPTIONS, OPTION_DEFAULTS, LossConfig, check_option_names, config_from_flat
from .dispatch import pick_backend
from .loss_math import TokenInputs, grpo_objective
from .ops.backend import RowBackend, empty_row_state, stats_dtype
from .validation import check_ids, check_logits, check_values, token_inputs, value_guard


def _rows(backend: str, logits: torch.Tensor) -> RowBackend:
    return pick_backend(logits.device, backend, logits.dtype)


@torch.library.custom_op("grpo_kernels::row_stats", mutates_args=())
def row_stats_op(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, row_state) from one read of the logits; logp float64 (ops/backend.py, "ℓ in float64"). `ids` lie
    in [0, V) (the traced code's `value_guard` put them there)."""
    return _rows(backend, logits).row_stats(logits, ids, temperature)


@row_stats_op.register_fake
def _(logits, ids, temperature, backend):
    batch, length, _ = logits.shape
    entropy = logits.new_empty((batch, length), dtype=stats_dtype(logits.dtype))
    logp = logits.new_empty((batch, length), dtype=torch.float64)
    return logp, entropy, empty_row_state(batch, length, logits.device, logits.dtype)


@torch.library.custom_op("grpo_kernels::row_grad", mutates_args=())
def row_grad_op(
    logits: torch.Tensor,
    ids: torch.Tensor,
    row_state: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    backend: str,
) -> torch.Tensor:
    """∂/∂logits of Σ g·ℓ + Σ h·H, in the logits' dtype."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    dtype = stats_dtype(logits.dtype)
    h = None if h is None else h.to(dtype).contiguous()
    _rows(backend, logits).row_grad(logits, ids, row_state, g.to(dtype).contiguous(), h, temperature, out)
    return out


@row_grad_op.register_fake
def _(logits, ids, row_state, g, h, temperature, backend):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output) -> None:
    logits, ids, temperature, backend = inputs
    ctx.save_for_backward(logits, ids, output[2])
    ctx.temperature, ctx.backend = temperature, backend


def _backward(ctx, grad_logp, grad_entropy, _grad_state):
    logits, ids, row_state = ctx.saved_tensors
    g = row_state.new_zeros(ids.shape) if grad_logp is None else grad_logp
    grad = row_grad_op(logits, ids, row_state, g, grad_entropy, ctx.temperature, ctx.backend)
    return grad, None, None, None


row_stats_op.register_autograd(_backward, setup_context=_setup_context)


# The options as a namedtuple: dynamo traces its construction and attribute reads (not a validating dataclass's).
TracedConfig = namedtuple("TracedConfig", list(OPTION_DEFAULTS))


def traced_config(options: dict[str, Any], config: LossConfig | None = None) -> TracedConfig:
    """The options (over `config`'s fields, or the defaults) as dynamo can trace them (plain attributes);
    validated by `validate_config` in the graph."""
    check_option_names(options)
    values = dict(OPTION_DEFAULTS) if config is None else {name: getattr(config, name) for name in OPTION_DEFAULTS}
    values.update(options)
    if values["epsilon_high"] is None:
        values["epsilon_high"] = values["epsilon_low"]
    return TracedConfig(**values)


@torch.library.custom_op("grpo_kernels::validate_config", mutates_args=())
def validate_config(x: torch.Tensor, loss_type: str, level: str, numbers: list[float]) -> torch.Tensor:
    """Runs LossConfig's checks at trace time (through the fake) and at run time; returns a copy of `x`'s sum."""
    config_from_flat([loss_type, level], numbers)
    return x.new_zeros(())


@validate_config.register_fake
def _(x, loss_type, level, numbers):
    config_from_flat([loss_type, level], numbers)
    return x.new_empty(())


@torch.library.custom_op("grpo_kernels::check_values", mutates_args=())
def check_values_op(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    is_ratio: torch.Tensor | None,
    beta: float,
) -> torch.Tensor:
    """check_inputs=True: eager's `check_values` at run time (one host read; a ValueError naming the argument).
    Returns a 0-d zero, added to the loss's factor by the caller so that the op is never dropped as unused."""
    inp = TokenInputs(advantages, mask, old_logp, ref_logp, is_ratio, None)
    check_values(ids, logits.shape[-1], inp, beta=beta, logits=logits)
    return mask.new_zeros((), dtype=torch.float32)


@check_values_op.register_fake
def _(logits, ids, advantages, mask, old_logp, ref_logp, is_ratio, beta):
    return mask.new_empty((), dtype=torch.float32)


def flat_numbers(cfg: TracedConfig) -> list[float]:
    numbers = []
    for name in NUMERIC_OPTIONS:
        value = getattr(cfg, name)
        numbers.append(math.nan if value is None else float(value))
    return numbers


def compiled_grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    tensors: tuple[Any, ...],
    backend: str,
    config: LossConfig | None,
    options: dict[str, Any],
    data_group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """grpo_loss as traced by torch.compile: (loss, logp, entropy, metrics), opaque row ops around a traced
    O(B·T) objective. Validation is the same as eager (`validate_config` runs LossConfig's checks)."""
    cfg = traced_config(options, config)
    validate_config(logits, cfg.loss_type, cfg.importance_sampling_level, flat_numbers(cfg))
    logits = check_logits(logits)
    batch, length, _ = logits.shape
    ids = check_ids(completion_ids, batch, length, logits.device)
    inp = token_inputs(batch, length, logits.device, *tensors, beta=cfg.beta, data_group=data_group)
    guard = value_guard(ids, logits.shape[-1], inp)
    call = guard.call
    if cfg.check_inputs:  # its zero joins the loss's factor: an op whose result is used is never dropped
        call = call + check_values_op(
            logits.detach(), ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, inp.is_ratio, cfg.beta
        )
    logp, entropy, _ = row_stats_op(logits, guard.ids, cfg.temperature, backend)  # ℓ float64 (ops/backend.py)
    loss, metrics = grpo_objective(logp, entropy.double(), inp, cfg)
    loss = loss.to(entropy.dtype) * call
    logp, entropy = guard.tokens(logp.detach().to(entropy.dtype)), guard.tokens(entropy.detach())
    return loss, logp, entropy, guard.scalars(metrics)
