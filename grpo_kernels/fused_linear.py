"""`fused_linear_grpo_loss`: the GRPO loss straight from hidden states and the lm_head weight, logits never stored;
`fused_linear_log_softmax`: the same tiles as a differentiable layer, (ℓ, H) per token for trainers that build their
own loss.

A call flows: validate once (the same checks as `grpo_loss`, validation.py) -> pass 1 over vocabulary tiles gives
ℓ, H, lse per token -> the float64 objective gives g = ∂loss/∂ℓ, h = ∂loss/∂H -> pass 2 recomputes the tiles and
accumulates ∂hidden, ∂weight, ∂bias in fp32. Both passes run in the forward; backward only scales the stored gradients,
on the device. `fused_linear_log_softmax` runs pass 1 in its forward and pass 2 in its backward, with the upstream
gradients of ℓ and H as g and h. As in api.py, with check_inputs=False nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any

import torch

from .api import GRPOOutput
from .boundary import loss_options, prepare_tokens
from .config import LossConfig
from .dispatch import pick_linear_backend, scale_
from .distributed import check_group, gather_sharded, resolve_data_group
from .loss_math import objective_coefficients
from .ops.backend import LinearBackend, LinearInputs, RowCoefficients
from .validation import check_ids, check_rows_tensor, layer_guard, masked_tokens
from .vocab_parallel import LinearShard, shard_offset


def _check_zero3(name: str, x: Any) -> None:
    if getattr(x, "ds_id", None) is not None and x.numel() == 0:
        raise ValueError(
            f"{name} is a DeepSpeed ZeRO-3 partitioned parameter (ds_id={x.ds_id}), which the fused-linear functions "
            "do not gather; use FSDP2 (fully_shard: DTensor weights are gathered) or grpo_loss on the model's logits"
        )


def _check_linear(hidden: Any, weight: Any, bias: Any) -> None:
    if isinstance(hidden, torch.Tensor) and type(hidden).__name__ == "DTensor":
        raise TypeError("hidden must be a plain (local) tensor, got a DTensor; pass hidden.to_local() or full_tensor()")
    _check_zero3("weight", weight)
    _check_zero3("bias", bias)
    check_rows_tensor("hidden", hidden, "H")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2] or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape (V, {hidden.shape[2]}) with V >= 1, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight and hidden must have the same dtype, got {weight.dtype} and {hidden.dtype} "
            "(cast one; autocast is not applied inside the fused loss)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight must be on hidden's device {hidden.device}, got {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias must be on hidden's device {hidden.device}, got {bias.device}")


def _prepare(
    hidden: Any, weight: Any, bias: Any, completion_ids: Any, backend: str, vocab_parallel_group: Any
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, LinearBackend | LinearShard, int | torch.Tensor
]:
    """The checks and the backend shared by the fused-linear entry points: (hidden, weight and bias gathered when
    they are DTensors, ids, the tile backend or its vocabulary shard, the full vocabulary size: an int, or the 0-d
    tensor of `shard_offset`). The ids' range is the caller's to check, against that full vocabulary."""
    check_group("vocab_parallel_group", vocab_parallel_group)
    weight, bias = gather_sharded(weight), gather_sharded(bias)
    _check_linear(hidden, weight, bias)
    batch, length, _ = hidden.shape
    ids = check_ids(completion_ids, batch, length, hidden.device, rows="hidden")
    tile_backend: LinearBackend | LinearShard = pick_linear_backend(hidden.device, backend, hidden.dtype)
    vocab = weight.shape[0]
    if vocab_parallel_group is not None:
        offset, vocab = shard_offset(vocab, vocab_parallel_group, hidden.device)
        tile_backend = LinearShard(tile_backend, vocab_parallel_group, offset)
    return hidden, weight, bias, ids, tile_backend, vocab


class _FusedLinearLogSoftmax(torch.autograd.Function):
    """Pass 1 (ℓ, H, lse) in the forward; pass 2 in the backward with g, h the upstream gradients of ℓ and H."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, backend):  # type: ignore[override]
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy, lse = backend.stats(LinearInputs(hidden, weight, bias, ids, temperature))
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.temperature, ctx.backend = temperature, backend
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        g = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype)
        h = None if grad_entropy is None else grad_entropy.to(lse.dtype)
        inp = LinearInputs(hidden, weight, bias, ids, ctx.temperature)
        with torch.autocast(hidden.device.type, enabled=False):
            grads = ctx.backend.grads(inp, RowCoefficients(lse, entropy, g, h), needs)
        return (*grads, None, None, None)


def fused_linear_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    vocab_parallel_group: Any = None,
    backend: str = "auto",
    check_inputs: bool = False,
    completion_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token and the entropy of each row of logits = (hidden @ weight.T + bias) / τ,
    without a (B·T, V) tensor: the per-token layer for trainers that build their own loss from ℓ and H.

    The vocabulary is streamed in tiles exactly as in `fused_linear_grpo_loss`: pass 1 (the forward) folds fp32
    logit tiles into online statistics; pass 2 (the backward) recomputes each tile and accumulates ∂hidden,
    ∂weight and ∂bias in fp32 from the upstream gradients of ℓ and H. Rows whose two upstream gradients are both
    exactly 0 add exactly 0, whatever their hidden states hold. Extra memory: O(B·T·H + one tile); hidden, weight and
    bias are kept for the backward (not copied).

    Args:
        hidden: [B, T, H] float32/bfloat16/float16/float64 (float64: the torch tiles, in float64).
        weight: [V, H] the lm_head (or tied embedding) weight, same dtype and device as hidden; a DTensor (FSDP2
            `fully_shard`) is gathered and its gradient reduce-scattered back, as in `fused_linear_grpo_loss`; the
            gathered weight is held until the backward.
        completion_ids: [B, T] int32/int64 in [0, V) (already shifted: hidden[b, t] scores completion_ids[b, t]). An
            id outside that range is never read out of bounds: its token's ℓ and H are NaN, and so is the gradient
            its upstream gradients reach (all of ∂weight and ∂bias, its row of ∂hidden).
        temperature: τ > 0.
        bias: [V] or None.
        vocab_parallel_group: the lm_head rows are sharded over this group (weight and bias are this rank's
            contiguous rows, shards in rank order; hidden and the global ids replicated). ℓ and H are those of the
            full vocabulary; the backward all-reduces the fp32 ∂hidden over the group, so every rank must call it
            with the same upstream gradients.
        backend: "auto" (Triton folds on CUDA, torch tiles elsewhere), "triton" or "torch".
        check_inputs: raise a ValueError for an id outside [0, V) instead (one host sync).
        completion_mask: [B, T] bool/int/float, 0 = a padding token: its id is ignored (-100, Hugging Face's
            label padding, or any other value; never read, never checked) and its ℓ and H are 0. Default: every
            token counts.
    Returns:
        (logp, entropy), each [B, T] float32 (float64 for float64 inputs), both differentiable w.r.t. hidden,
        weight and bias.

    Example:
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> logp, entropy = fused_linear_log_softmax(hidden, lm_head.weight, torch.randint(0, 50, (2, 5)))
        >>> (logp.sum() + 0.01 * entropy.sum()).backward()
    """
    checked = LossConfig(temperature=temperature, check_inputs=check_inputs)
    hidden, weight, bias, ids, tile_backend, vocab = _prepare(
        hidden, weight, bias, completion_ids, backend, vocab_parallel_group
    )
    guard, active = layer_guard(ids, vocab, completion_mask, checked.check_inputs)
    logp, entropy = _FusedLinearLogSoftmax.apply(hidden, weight, bias, guard.ids, checked.temperature, tile_backend)
    return masked_tokens(guard.tokens(logp), active), masked_tokens(guard.tokens(entropy), active)


class _FusedLinearGRPOFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, cfg, backend, inp, weights, ids, metrics_out):  # type: ignore[override]
        needs = tuple(ctx.needs_input_grad[:3])
        # The tiles' precision is fixed here (fp32 logits, fp32 accumulation), not by an enclosing autocast.
        tiles = LinearInputs(hidden, weight, bias, ids, cfg.temperature)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy, lse = backend.stats(tiles)
            loss, metrics, g, h = objective_coefficients(logp, entropy, inp, cfg, weights, any(needs))
            grads: tuple[torch.Tensor | None, ...] = (None, None, None)
            if g is not None:
                h = None if h is None else h.to(logp.dtype)
                grads = backend.grads(tiles, RowCoefficients(lse, entropy, g.to(logp.dtype), h), needs)
        metrics_out.update(metrics)
        ctx.grads = grads
        ctx.mark_non_differentiable(logp, entropy)
        return loss.to(logp.dtype), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):  # type: ignore[override]
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss: backward called a second time; the stored gradients are consumed by the "
                "first backward (use retain_graph only with a fresh call)"
            )
        ctx.grads = None
        for x in grads:
            if x is not None:
                scale_(x, grad_loss)  # on the device, in fp32 (opmath): not rounded to the gradients' dtype first
        return (*grads, None, None, None, None, None, None)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
    backend: str = "auto",
    vocab_parallel_group: Any = None,
    data_parallel_group: Any = None,
    config: LossConfig | None = None,
    **options: Any,
) -> GRPOOutput:
    """The GRPO loss family of `grpo_loss` (docs/loss.md) on logits = hidden @ weight.T + bias, without a (B·T, V)
    tensor.

    The vocabulary is streamed in tiles twice: once for the log-probabilities and entropies (fp32 logits, online
    logsumexp), once, after the float64 objective gives each token's gradient coefficients, to accumulate the
    gradients of hidden, weight and bias in fp32. Extra memory is O(B·T·H + one tile); both passes run in the
    forward and the backward only scales. Exact: every token and vocabulary entry contributes, nothing is filtered
    (tokens whose gradient coefficients are exactly 0, such as padding, add exactly 0, whatever their hidden
    states hold).
    The logits are formed in fp32 (more exact than materialized bf16 logits); on CUDA their gradient is rounded to
    the inputs' dtype before the two gradient GEMMs. An enclosing autocast is not applied: hidden and weight must
    share a dtype.

    Args:
        hidden: [B, T, H] float32/bfloat16/float16/float64 (float64: the torch tiles, computed in float64; the
            outputs are then float64), the final hidden states that score `completion_ids` (already
            shifted); strided views such as `last_hidden_state[:, -T-1:-1]` are read in place, never copied.
        weight: [V, H] the lm_head (or tied embedding) weight, same dtype and device as hidden.
        completion_ids: [B, T] int32/int64 in [0, V) (outside it: as in `grpo_loss`, NaN results, no read out of
            bounds).
        advantages, completion_mask, old_logp, ref_logp, importance_sampling_ratio, sampling_logp, config,
            **options: exactly as in `grpo_loss` (all eight loss types and every option).
        bias: [V] or None, the lm_head bias.
        backend: "auto" (Triton folds on CUDA, torch tiles elsewhere), "triton" or "torch".
        vocab_parallel_group: a torch.distributed group over which the lm_head is sharded by vocabulary rows
            (Megatron-style): `weight` (and `bias`) are this rank's contiguous rows [V_rank, H], shards in rank order;
            hidden, completion_ids (global ids) and the other inputs are the same on every rank of the group. One
            all-gather of [B·T, 4] statistics and one all-reduce of the fp32 ∂hidden per call, both in the forward;
            each rank gets its rows' ∂weight, and ∂hidden is the full one (so hidden must not pass through a region
            whose backward all-reduces it again, such as Megatron's copy_to_tensor_model_parallel_region).
        data_parallel_group: as in `grpo_loss`.

    Sharded weights: a DTensor weight or bias (an FSDP2 `fully_shard` parameter, read after the model's forward
    has resharded it) is all-gathered for the call and its gradient reduce-scattered back, averaged over the mesh as
    FSDP averages data-parallel gradients. A DeepSpeed ZeRO-3 partitioned weight is refused with an error.
    Returns:
        GRPOOutput(loss, logp, entropy, metrics); `loss` is differentiable w.r.t. hidden, weight and bias.

    Example:
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> ids = torch.randint(0, 50, (2, 5))
        >>> out = fused_linear_grpo_loss(hidden, lm_head.weight, ids, advantages=torch.tensor([1.0, -1.0]))
        >>> out.loss.backward()  # hidden.grad, lm_head.weight.grad
    """
    cfg = loss_options(
        config, options, "fused_linear_grpo_loss",
        vocab_parallel_group=vocab_parallel_group, data_parallel_group=data_parallel_group,
    )  # fmt: skip
    hidden, weight, bias, ids, tile_backend, vocab = _prepare(
        hidden, weight, bias, completion_ids, backend, vocab_parallel_group
    )
    tensors = (advantages, completion_mask, old_logp, ref_logp, importance_sampling_ratio, sampling_logp)
    call = prepare_tokens(cfg, ids, vocab, tensors, resolve_data_group(data_parallel_group, vocab_parallel_group))
    metrics: dict[str, torch.Tensor] = {}
    loss, logp, entropy = _FusedLinearGRPOFunction.apply(
        hidden, weight, bias, cfg, tile_backend, call.inp, call.weights, call.ids, metrics
    )
    guard = call.guard
    return GRPOOutput(
        loss=loss * call.factor, logp=guard.tokens(logp), entropy=guard.tokens(entropy), metrics=guard.scalars(metrics)
    )
