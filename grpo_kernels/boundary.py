"""The one boundary of every loss call: `grpo_loss`, `GRPOLoss`, `fused_linear_grpo_loss` and the torch.compile
path cross it, and nothing below it re-checks.

Two steps, both here:
- `loss_options`: the call's options (reduction, inplace_backward, the process groups, the loss options) into one
  checked config: a `LossConfig` eagerly, its traced stand-in under torch.compile (dynamo cannot trace a
  validating dataclass, so the same checks run in an op of the graph, `compile_op.validate_config`);
- `prepare_tokens`: the per-token tensors (`TokenInputs`), the value checks (read back with check_inputs=True,
  else kept on the device: `ValueGuard`), the aggregation weights.

Eager and compiled calls take the same two steps, so they refuse and accept the same inputs
(tests/test_validation.py holds them to it over its whole table of bad inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from .compile_op import check_values_op, traced_config, validate_config
from .config import LossConfig, encode_options, make_config
from .distributed import check_group
from .loss_math import aggregation_weights
from .validation import TokenCall, check_values, token_inputs, value_guard

REDUCTIONS = ("loss_type", "none")
AGGREGATE_ONLY_OPTIONS = ("entropy_coef", "num_items_in_batch", "max_completion_length")


def compiling() -> bool:
    """True while torch.compile traces the call (one place to ask, so that a test can run the traced Python)."""
    return torch.compiler.is_compiling()


def check_per_token_config(cfg: LossConfig) -> None:
    """reduction="none" refuses, by name, the options that only have a meaning for the aggregated loss."""
    for name in AGGREGATE_ONLY_OPTIONS:
        value = getattr(cfg, name)
        if value not in (None, 0.0):
            raise ValueError(
                f"{name}={value!r} only applies to the aggregated loss and cannot be used with reduction='none' "
                "(aggregate the per-token loss yourself, or use the default reduction)"
            )


def loss_options(
    config: LossConfig | None,
    options: dict[str, Any],
    caller: str,
    *,
    reduction: str = "loss_type",
    inplace_backward: bool = False,
    vocab_parallel_group: Any = None,
    data_parallel_group: Any = None,
) -> Any:
    """The call's options, checked by name: a `LossConfig`, or under torch.compile its traced stand-in (the same
    fields; `validate_config` runs LossConfig's checks in the graph, at trace time and at run time)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    check_group("vocab_parallel_group", vocab_parallel_group)
    check_group("data_parallel_group", data_parallel_group)
    if not compiling():
        cfg = make_config(config, options, caller)
        if reduction == "none":
            check_per_token_config(cfg)
        return cfg
    for name, unsupported in (
        ("reduction='none'", reduction != "loss_type"),
        ("vocab_parallel_group", vocab_parallel_group is not None),
        ("inplace_backward=True", inplace_backward),
    ):
        if unsupported:  # what the compiled op cannot do (it may not mutate its input nor call collectives)
            raise ValueError(f"{name} is not supported under torch.compile; call {caller} eagerly")
    if config is not None and not isinstance(config, LossConfig):
        make_config(config, {}, caller)  # its TypeError, by name
    cfg = traced_config(options, config)
    validate_config(torch.zeros(()), encode_options(cfg._asdict()))
    return cfg


def prepare_tokens(
    cfg: Any,
    ids: torch.Tensor,
    vocab: int | torch.Tensor,
    tensors: tuple[Any, ...],
    data_group: Any,
    *,
    logits: torch.Tensor | None = None,
    logits_are_shard: bool = False,
    aggregate: bool = True,
) -> TokenCall:
    """The per-token tensors of a call (`tensors`: advantages, completion_mask, old_logp, ref_logp,
    importance_sampling_ratio, sampling_logp) checked into `TokenInputs`, the value checks, the weights.

    `ids` are checked for shape and dtype (`validation.check_ids`); here, their range against `vocab` (an int, or the
    0-d tensor of a sharded vocabulary). check_inputs=True reads every value check back once and raises by name
    (`logits`, when given, are checked too); otherwise nothing is read back and an invalid value gives NaN results."""
    batch, length = ids.shape
    inp = token_inputs(batch, length, ids.device, *tensors, beta=cfg.beta, data_group=data_group)
    guard = value_guard(ids, vocab, inp)  # on the device: in-range ids, NaN results for invalid values
    factor = guard.call
    if cfg.check_inputs and compiling():
        check = logits.detach() if logits is not None else None
        factor = factor + check_values_op(
            check, ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, inp.is_ratio, cfg.beta, int(vocab)
        )
    elif cfg.check_inputs:  # the call's one host sync
        check_values(ids, vocab, inp, beta=cfg.beta, logits=logits, logits_are_shard=logits_are_shard)
    weights = aggregation_weights(inp.mask, cfg, data_group) if aggregate else None
    return TokenCall(inp, guard, factor, weights)
