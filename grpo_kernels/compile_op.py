"""The row kernels as torch.library custom ops, so a compiled step with grpo_loss in it is one graph.

Eager calls go through the autograd.Function in api.py (the one-read fused path). Under torch.compile, dynamo
cannot trace the kernels' host code, so grpo_loss calls `compiled_grpo_loss`: two opaque ops, `row_stats`
(forward) and `row_grad` (its backward), with the O(B·T) objective traced between them; AOT autograd
differentiates that objective to get g and h. This is the two-read schedule of the sequence-level options, for
every option. The call is prepared by eager's boundary (`boundary.py`): the value checks on the device in the
traced code (`value_guard`), and with check_inputs=True `check_values` in an op of its own, which reads its
findings back and raises by name.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch

from .config import OPTION_DEFAULTS, LossConfig, check_option_names, config_from_encoded, trl_names
from .dispatch import pick_backend
from .loss_math import TokenInputs, grpo_objective
from .ops.backend import RowBackend, empty_row_state, stats_dtype
from .validation import TokenCall, check_values


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
    check_option_names(options, hint=False)
    options = trl_names(options)
    values = dict(OPTION_DEFAULTS) if config is None else {name: getattr(config, name) for name in OPTION_DEFAULTS}
    values.update(options)
    if values["epsilon_high"] is None:
        values["epsilon_high"] = values["epsilon_low"]
    return TracedConfig(**values)


@torch.library.custom_op("grpo_kernels::validate_config", mutates_args=())
def validate_config(x: torch.Tensor, options: str) -> torch.Tensor:
    """Runs LossConfig's checks on the options (`config.encode_options`: each value with its type) at trace time
    (through the fake) and at run time; returns a 0-d zero."""
    config_from_encoded(options)
    return x.new_zeros(())


@validate_config.register_fake
def _(x, options):
    config_from_encoded(options)
    return x.new_empty(())


@torch.library.custom_op("grpo_kernels::check_values", mutates_args=())
def check_values_op(
    logits: torch.Tensor | None,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    is_ratio: torch.Tensor | None,
    beta: float,
    vocab: int,
) -> torch.Tensor:
    """check_inputs=True: eager's `check_values` at run time (one host read; a ValueError naming the argument).
    Returns a 0-d zero, added to the loss's factor by the caller so that the op is never dropped as unused."""
    inp = TokenInputs(advantages, mask, old_logp, ref_logp, is_ratio, None)
    check_values(ids, vocab, inp, beta=beta, logits=logits)
    return mask.new_zeros((), dtype=torch.float32)


@check_values_op.register_fake
def _(logits, ids, advantages, mask, old_logp, ref_logp, is_ratio, beta, vocab):
    return mask.new_empty((), dtype=torch.float32)


def compiled_grpo_loss(
    logits: torch.Tensor, cfg: TracedConfig, call: TokenCall, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """grpo_loss as traced by torch.compile: (loss, logp, entropy, metrics), opaque row ops around a traced
    O(B·T) objective. `call` comes from the same boundary as eager's (`boundary.prepare_tokens`)."""
    guard = call.guard
    logp, entropy, _ = row_stats_op(logits, call.ids, cfg.temperature, backend)  # ℓ float64 (ops/backend.py)
    loss, metrics = grpo_objective(logp, entropy.double(), call.inp, cfg, call.weights)
    loss = loss.to(entropy.dtype) * call.factor
    logp, entropy = guard.tokens(logp.detach().to(entropy.dtype)), guard.tokens(entropy.detach())
    return loss, logp, entropy, guard.scalars(metrics)
