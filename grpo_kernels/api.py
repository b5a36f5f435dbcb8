"""The public entry points: `grpo_loss`, `GRPOLoss`, `selective_log_softmax`.

A call flows (docs/architecture.md draws it): validate once (`boundary.py`: `LossConfig`, `TokenInputs`, value
checks, aggregation weights) -> `_GRPOLossFunction` -> a `RowBackend` from `dispatch.pick_backend` (Triton on CUDA,
chunked torch elsewhere). The gradient is computed in the forward, while the row is hot; backward only scales it, on the
device. With check_inputs=False nothing is read back to the host between entry and return, nor in the backward (the
value checks stay on the device: `validation.value_guard`), so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from . import boundary
from .boundary import loss_options, prepare_tokens
from .compile_op import compiled_grpo_loss
from .config import LossConfig
from .dispatch import pick_backend, scale_
from .distributed import resolve_data_group
from .loss_math import TokenInputs, coefficients, entropy_bonus_weights, objective_coefficients, per_token_objective
from .ops.backend import RowBackend
from .validation import check_ids, check_logits, layer_guard, masked_tokens
from .vocab_parallel import ShardBackend, shard_offset


@dataclass
class GRPOOutput:
    """What `grpo_loss` returns. `metrics` holds detached 0-d tensors under TRL's names (no host sync). Dtypes are
    float32, float64 for float64 inputs."""

    loss: torch.Tensor  # 0-d (reduction="none": [B, T] per token), differentiable w.r.t. logits
    logp: torch.Tensor  # [B, T] float32, detached
    entropy: torch.Tensor  # [B, T] float32, detached
    metrics: dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# Autograd: everything below trusts its inputs (validated by the public functions)


def forward_rows(
    logits: torch.Tensor,
    ids: torch.Tensor,
    cfg: LossConfig,
    backend: RowBackend,
    inp: TokenInputs,
    weights: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (float64, detached), ℓ, H and metrics; when `out` is given, ∂loss/∂logits is written into it.

    `weights`: the aggregation weights of `loss_math.aggregation_weights`, computed once per call by the caller."""
    fused = backend.fused_token_grad
    if out is not None and cfg.is_fused and fused is not None:
        # One read of each row: ℓ, H, g and ∂logits in the same pass (token-level options only).
        batch, length = inp.mask.shape
        logp, entropy = fused(
            logits,
            ids,
            cfg.temperature,
            advantages=inp.advantages.float().expand(batch, length),
            old_logp=None if inp.old_logp is None else inp.old_logp.float(),
            # β = 0: no ref, so that an inf there cannot turn into 0·inf in the kernel
            ref_logp=None if cfg.beta == 0.0 else inp.ref_logp.float(),
            rho=None if inp.is_ratio is None else inp.is_ratio.float().expand(batch, length),
            weight=weights.float(),
            entropy_weight=entropy_bonus_weights(inp.mask, cfg).float() if cfg.entropy_coef != 0.0 else None,
            cfg=cfg,
            out=out,
        )
        # logp is float64 here (exact, see ops/backend.py); the gradient is written already
        loss, metrics, _, _ = objective_coefficients(logp, entropy, inp, cfg, weights, False)
        return loss, logp.float(), entropy, metrics

    # Sequence-level options (or no gradient): statistics first, the O(B·T) objective, then one gradient pass.
    # ℓ comes in float64 (ops/backend.py, "ℓ in float64"): exp(ℓ − ℓ_old) and the KL are exact for any |ℓ|.
    logp64, entropy, row_state = backend.row_stats(logits, ids, cfg.temperature)
    logp = logp64.to(entropy.dtype)  # float32 (float64 for float64 logits)
    loss, metrics, g, h = objective_coefficients(logp64, entropy, inp, cfg, weights, out is not None)
    if out is not None:
        h = None if h is None else h.to(logp.dtype)
        backend.row_grad(logits, ids, row_state, g.to(logp.dtype), h, cfg.temperature, out)
    return loss, logp, entropy, metrics


class _GRPOLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, cfg, backend, inp, weights, inplace, metrics_out):  # type: ignore[override]
        out = None
        if ctx.needs_input_grad[0]:
            out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        loss, logp, entropy, metrics = forward_rows(logits, ids, cfg, backend, inp, weights, out)
        metrics_out.update(metrics)
        ctx.grad_logits = out
        ctx.mark_non_differentiable(logp, entropy)
        return loss.to(logp.dtype), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):  # type: ignore[override]
        grad = ctx.grad_logits
        if grad is None:
            raise RuntimeError(
                "grpo_loss: backward called a second time; the gradient buffer is consumed by the first backward "
                "(use retain_graph only with a fresh grpo_loss call)"
            )
        ctx.grad_logits = None
        scale_(grad, grad_loss)  # on the device, in fp32 (opmath); no pass when it is exactly 1 (on CUDA)
        return grad, None, None, None, None, None, None, None


class _PerTokenLossFunction(torch.autograd.Function):
    """reduction="none": the row statistics and the float64 per-token objective in the forward; in the backward,
    the objective's vector-Jacobian product with the upstream [B, T] gradient gives g = ∂(Σ u·L)/∂ℓ, then one
    gradient pass of the row backend (the loss does not depend on H but through the detached entropy mask: h = 0)."""

    @staticmethod
    def forward(ctx, logits, ids, cfg, backend, inp, inplace, metrics_out):  # type: ignore[override]
        logp64, entropy, row_state = backend.row_stats(logits, ids, cfg.temperature)  # ℓ float64, see forward_rows
        logp = logp64.to(entropy.dtype)
        with torch.enable_grad():
            lp = logp64.detach().requires_grad_(ctx.needs_input_grad[0])  # a tensor of its own, also for float64
            per_token, metrics = per_token_objective(lp, entropy.detach().double(), inp, cfg)
        metrics_out.update(metrics)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, ids, row_state)
            ctx.graph = (lp, per_token)  # the O(B·T) float64 graph, differentiated in the backward
        ctx.cfg, ctx.backend, ctx.inplace = cfg, backend, inplace
        ctx.mark_non_differentiable(logp, entropy)
        return per_token.detach().to(logp.dtype), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):  # type: ignore[override]
        if getattr(ctx, "graph", None) is None:
            raise RuntimeError(
                "grpo_loss(reduction='none'): backward called a second time (retain_graph is not supported)"
            )
        logits, ids, row_state = ctx.saved_tensors
        lp, per_token = ctx.graph
        ctx.graph = None
        g, _ = coefficients(per_token, lp, None, grad_loss.to(per_token.dtype))  # zeros where L is constant
        g = g.to(row_state.dtype).contiguous()
        out = logits if ctx.inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        ctx.backend.row_grad(logits, ids, row_state, g, None, ctx.cfg.temperature, out)
        return out, None, None, None, None, None, None


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, backend):  # type: ignore[override]
        logp, entropy, row_state = backend.row_stats(logits, ids, temperature)
        ctx.save_for_backward(logits, ids, row_state)
        ctx.temperature, ctx.backend = temperature, backend
        return logp.to(entropy.dtype), entropy  # ℓ rounded once, from its float64 value

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        logits, ids, row_state = ctx.saved_tensors
        dtype = row_state.dtype
        g = torch.zeros(ids.shape, dtype=dtype, device=ids.device) if grad_logp is None else grad_logp.to(dtype)
        h = None if grad_entropy is None else grad_entropy.to(dtype)
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        ctx.backend.row_grad(logits, ids, row_state, g, h, ctx.temperature, out)
        return out, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Public API: validation happens here, once


def selective_log_softmax(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_inputs: bool = False,
    completion_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token and the entropy of each row, without a full log_softmax.

    Args:
        logits: [B, T, V] float32/bfloat16/float16/float64 (float64: the torch path, computed in float64); any batch
            and time strides, unit vocabulary stride.
        completion_ids: [B, T] int32/int64 in [0, V). An id outside that range is never read out of bounds: its
            token's ℓ and H are NaN, and so is its row of the gradient.
        temperature: τ > 0; the distribution is softmax(logits / τ).
        check_inputs: raise a ValueError for an id outside [0, V) instead (one host sync).
        completion_mask: [B, T] bool/int/float, 0 = a padding token: its id is ignored (-100, Hugging Face's
            label padding, or any other value; never read, never checked) and its ℓ and H are 0. Default: every
            token counts.
    Returns:
        (logp, entropy), each [B, T] float32 (float64 for float64 logits), differentiable w.r.t. `logits` through
        both.
    """
    logits = check_logits(logits)
    batch, length, vocab = logits.shape
    ids = check_ids(completion_ids, batch, length, logits.device)
    temperature = LossConfig(temperature=temperature).temperature
    check_inputs = LossConfig(check_inputs=check_inputs).check_inputs
    row_backend = pick_backend(logits.device, backend, logits.dtype)
    guard, active = layer_guard(ids, vocab, completion_mask, check_inputs)
    logp, entropy = _SelectiveLogSoftmax.apply(logits, guard.ids, temperature, row_backend)
    return masked_tokens(guard.tokens(logp), active), masked_tokens(guard.tokens(entropy), active)


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    *,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
    inplace_backward: bool = False,
    reduction: str = "loss_type",
    backend: str = "auto",
    vocab_parallel_group: Any = None,
    data_parallel_group: Any = None,
    config: LossConfig | None = None,
    **options: Any,
) -> GRPOOutput:
    """The GRPO loss family (TRL 1.16 semantics; the math, every option and the tolerances: docs/loss.md) from
    logits, with its gradient.

    Args:
        logits: [B, T, V] float32/bfloat16/float16/float64 (float64: the torch path, computed in float64; the
            outputs are then float64), `logits[b, t]` scores `completion_ids[b, t]` (already shifted);
            strided views such as `full_logits[:, -T-1:-1]` are read in place, never copied.
        completion_ids: [B, T] int32/int64 in [0, V). A masked token's id is ignored, whatever it holds (-100,
            Hugging Face's label padding, included). An active id outside that range is never read out of bounds:
            its token's ℓ and H are NaN, and so are the loss, the metrics and the gradient (docs/loss.md, "Value
            checks"; check_inputs=True raises instead). So are they for a mask value other than 0/1 or ρ < 0.
        advantages: [B], [B, 1] or [B, T].
        completion_mask: [B, T] bool/int/float of 0/1, 1 = a token that counts; default all ones. A masked token is
            absent: whatever its logits row and per-token inputs hold (NaN, ±inf), it changes nothing.
        old_logp: [B, T] log-probs of the policy that sampled; None = the detached current ones (ratio 1).
        ref_logp: [B, T] reference log-probs; required when beta != 0.
        importance_sampling_ratio: [B], [B, 1] or [B, T] rollout-engine correction ρ (a constant factor).
        sampling_logp: [B, T] sampler log-probs for the off-policy mask (default old_logp).
        inplace_backward: write ∂loss/∂logits into the logits buffer itself (zero extra V-wide memory). The logits
            are overwritten during the forward and autograd's version counter is bypassed: use it only when nothing
            else reads these logits afterwards. With reduction="none" the gradient is written there in the backward.
        reduction: "loss_type" (default) aggregates as the loss type prescribes (docs/loss.md, "Aggregation") into a
            0-d loss; "none" returns the per-token loss L [B, T] (after the clip, the masks and ρ, plus β·KL; 0 at
            masked tokens), differentiable with any upstream gradient [B, T], for trainers that aggregate it
            themselves. entropy_coef, num_items_in_batch and max_completion_length exist only aggregated and are
            refused with "none".
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        vocab_parallel_group: a torch.distributed group over which the vocabulary is sharded (Megatron-style
            tensor-parallel lm_head): `logits` is this rank's contiguous shard [B, T, V_rank], shards in rank order,
            global `completion_ids`; the results are the full vocabulary's, each rank gets its shard's gradient.
        data_parallel_group: the group the cross-rank defaults span (dapo-family token count, entropy quantile,
            metrics); default: the default process group when torch.distributed is initialized and no
            vocab_parallel_group is given.
        config: a `LossConfig` holding the options (default: TRL's defaults); `**options` override its fields.
        **options: any `LossConfig` field: loss_type ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo",
            "vespo"), beta, epsilon_low/high, delta, temperature, importance_sampling_level, ... (docs/loss.md).
            check_inputs=True checks the values on the host (one host sync) and raises, naming the argument, on ids
            outside [0, V), a mask other than 0/1, ρ < 0 and NaN/inf at unmasked tokens, logits included.
    Returns:
        GRPOOutput(loss, logp, entropy, metrics); `loss` is [B, T] with reduction="none".

    Example:
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> ids = torch.randint(0, 11, (2, 5))
        >>> out = grpo_loss(logits, ids, advantages=torch.tensor([1.0, -1.0]))
        >>> out.loss.backward()
    """
    cfg = loss_options(
        config, options, "grpo_loss", reduction=reduction, inplace_backward=inplace_backward,
        vocab_parallel_group=vocab_parallel_group, data_parallel_group=data_parallel_group,
    )  # fmt: skip
    logits = check_logits(logits)
    batch, length, vocab = logits.shape
    ids = check_ids(completion_ids, batch, length, logits.device)
    tensors = (advantages, completion_mask, old_logp, ref_logp, importance_sampling_ratio, sampling_logp)
    if boundary.compiling():  # two opaque row ops around the traced objective (compile_op.py)
        call = prepare_tokens(cfg, ids, vocab, tensors, resolve_data_group(data_parallel_group, None), logits=logits)
        return GRPOOutput(*compiled_grpo_loss(logits, cfg, call, backend))
    return _eager_loss(
        logits, ids, tensors, cfg, reduction, inplace_backward, backend, vocab_parallel_group, data_parallel_group
    )


def _eager_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    tensors: tuple[Any, ...],
    cfg: LossConfig,
    reduction: str,
    inplace_backward: bool,
    backend: str,
    vocab_parallel_group: Any,
    data_parallel_group: Any,
) -> GRPOOutput:
    """`grpo_loss` outside torch.compile, its options checked: the row backend (a vocabulary shard of it), the
    per-token side of the boundary, then the autograd function of the reduction."""
    vocab = logits.shape[-1]
    row_backend = pick_backend(logits.device, backend, logits.dtype)
    if vocab_parallel_group is not None:
        offset, vocab = shard_offset(vocab, vocab_parallel_group, logits.device)
        row_backend = ShardBackend(vocab_parallel_group, offset, row_backend)
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True would overwrite a leaf tensor that requires grad; pass a non-leaf view")
    call = prepare_tokens(
        cfg, ids, vocab, tensors, resolve_data_group(data_parallel_group, vocab_parallel_group),
        logits=logits, logits_are_shard=vocab_parallel_group is not None, aggregate=reduction != "none",
    )  # fmt: skip
    metrics: dict[str, torch.Tensor] = {}
    if reduction == "none":
        loss, logp, entropy = _PerTokenLossFunction.apply(
            logits, call.ids, cfg, row_backend, call.inp, inplace_backward, metrics
        )
    else:
        loss, logp, entropy = _GRPOLossFunction.apply(
            logits, call.ids, cfg, row_backend, call.inp, call.weights, inplace_backward, metrics
        )
    guard = call.guard
    return GRPOOutput(
        loss=loss * call.factor, logp=guard.tokens(logp), entropy=guard.tokens(entropy), metrics=guard.scalars(metrics)
    )


class GRPOLoss(torch.nn.Module):
    """`grpo_loss` as a module: options fixed (and validated) at construction, tensors per call.

    >>> loss_fn = GRPOLoss(loss_type="dapo", beta=0.04)      # or GRPOLoss(config=LossConfig(...))
    >>> out = loss_fn(logits, ids, advantages, mask, old_logp, ref_logp)
    """

    def __init__(
        self,
        config: LossConfig | None = None,
        *,
        inplace_backward: bool = False,
        reduction: str = "loss_type",
        backend: str = "auto",
        **options: Any,
    ) -> None:
        super().__init__()
        # Validated now, not at the first step (and again, by the same function, at each call).
        self.config = loss_options(config, options, "GRPOLoss", reduction=reduction, inplace_backward=inplace_backward)
        self.inplace_backward, self.reduction = inplace_backward, reduction
        self.backend = backend

    def forward(
        self,
        logits: torch.Tensor,
        completion_ids: torch.Tensor,
        advantages: torch.Tensor,
        completion_mask: torch.Tensor | None = None,
        old_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        **tensors: torch.Tensor | None,
    ) -> GRPOOutput:
        return grpo_loss(
            logits,
            completion_ids,
            advantages,
            completion_mask,
            old_logp,
            ref_logp,
            inplace_backward=self.inplace_backward,
            reduction=self.reduction,
            backend=self.backend,
            config=self.config,
            **tensors,
        )

    def extra_repr(self) -> str:
        default = LossConfig()
        changed = [f.name for f in fields(LossConfig) if getattr(self.config, f.name) != getattr(default, f.name)]
        return ", ".join(f"{k}={getattr(self.config, k)!r}" for k in changed)
