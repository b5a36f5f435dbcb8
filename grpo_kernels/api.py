"""The public entry points: `grpo_loss`, `GRPOLoss`, `selective_log_softmax`, with validation at the boundary.

A call flows: validate -> `LossConfig` + `TokenInputs` -> `_GRPOLossFunction` -> a row backend (Triton on CUDA,
chunked torch elsewhere). The gradient is computed in the forward, while the row is hot; backward only scales it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .config import BACKENDS, OPTION_DEFAULTS, LossConfig
from .distributed import check_group, resolve_data_group
from .vocab_parallel import ShardBackend, shard_offset
from .compile_op import flat_numbers, row_stats_op, traced_config, validate_config
from .loss_math import TokenInputs, aggregation_weights, entropy_bonus_weights, grpo_objective

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class GRPOOutput:
    """What `grpo_loss` returns. `metrics` holds detached 0-d tensors under TRL's names (no host sync)."""

    loss: torch.Tensor  # 0-d, differentiable w.r.t. logits
    logp: torch.Tensor  # [B, T] float32, detached
    entropy: torch.Tensor  # [B, T] float32, detached
    metrics: dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _check_tensor(name: str, x: Any, shapes: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}, got {x.device}")
    return x


def _check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().double()


def _check_logits(logits: Any) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D (B, T, V), got {logits.dim()}-D with shape {tuple(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if min(logits.shape) == 0:
        raise ValueError(f"logits must have B, T, V >= 1, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits must have a unit stride along the vocabulary (got strides {logits.stride()}); "
            "batch and time strides may be anything, so slice the time axis rather than transposing the vocabulary"
        )
    return logits


def _check_ids(ids: Any, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Shape and dtype; the value range is `check_ids_range`, run where the vocabulary size is known."""
    ids = _check_tensor("completion_ids", ids, ((batch, length),), device)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"completion_ids must be int32/int64, got {ids.dtype}")
    return ids


def _token_inputs(
    logits: torch.Tensor,
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
    batch, length, _ = logits.shape
    dev = logits.device
    bt = ((batch, length),)
    adv = _check_float("advantages", _check_tensor("advantages", advantages, ((batch,), (batch, 1), (batch, length)), dev))
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    if completion_mask is None:
        mask = torch.ones(batch, length, dtype=torch.float64, device=dev)
    else:
        mask = _check_tensor("completion_mask", completion_mask, bt, dev).detach().double()
    optional = {}
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp)):
        optional[name] = None if x is None else _check_float(name, _check_tensor(name, x, bt, dev))
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={beta})")
    is_ratio = importance_sampling_ratio
    if is_ratio is not None:
        shapes = ((batch,), (batch, 1), (batch, length))
        is_ratio = _check_float("importance_sampling_ratio", _check_tensor("importance_sampling_ratio", is_ratio, shapes, dev))
        if is_ratio.dim() == 1:
            is_ratio = is_ratio.unsqueeze(1)
    return TokenInputs(
        adv, mask, optional["old_logp"], optional["ref_logp"], is_ratio, optional["sampling_logp"], data_group
    )


def _backend(name: str, device: torch.device) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .ops import cpu_rows, torch_rows

        if device.type != "cpu":
            return torch_rows
        if cpu_rows.available():
            return cpu_rows  # the fused C rows; torch_rows when the extension is not built (one warning)
        cpu_rows.warn_unavailable()
        return torch_rows
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}); on a CPU it runs only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing triton), or use backend='torch'"
        )
    from .ops import triton_logits

    return triton_logits


# ----------------------------------------------------------------------------------------------------------------
# Autograd


def check_ids_range(ids: torch.Tensor, vocab: int) -> None:
    """O(B·T) range check of the ids, no pass over the logits; run eagerly (inside the op under torch.compile)."""
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"completion_ids must lie in [0, {vocab}) (the logits' vocabulary), got values in [{lo}, {hi}]")


def forward_rows(
    logits: torch.Tensor,
    ids: torch.Tensor,
    cfg: LossConfig,
    backend: ModuleType,
    inp: TokenInputs,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (float64, detached), ℓ, H and metrics; when `out` is given, ∂loss/∂logits is written into it."""
    if out is not None and not cfg.is_sequence_level and hasattr(backend, "fused_token_grad"):
        # One read of each row: ℓ, H, g and ∂logits in the same pass (token-level options only).
        batch, length = inp.mask.shape
        logp, entropy = backend.fused_token_grad(
            logits,
            ids,
            cfg.temperature,
            advantages=inp.advantages.float().expand(batch, length),
            old_logp=None if inp.old_logp is None else inp.old_logp.float(),
            ref_logp=None if inp.ref_logp is None else inp.ref_logp.float(),
            is_ratio=None if inp.is_ratio is None else inp.is_ratio.float().expand(batch, length),
            weight=aggregation_weights(inp.mask, cfg, inp.data_group).float(),
            entropy_weight=entropy_bonus_weights(inp.mask, cfg).float() if cfg.entropy_coef != 0.0 else None,
            cfg=cfg,
            out=out,
        )
        with torch.no_grad():
            loss, metrics = grpo_objective(logp.double(), entropy.double(), inp, cfg)
        return loss, logp, entropy, metrics

    # Sequence-level options (or no gradient): statistics first, the O(B·T) objective, then one gradient pass.
    logp, entropy, row_state = backend.row_stats(logits, ids, cfg.temperature)
    with torch.enable_grad():
        lp = logp.double().requires_grad_(out is not None)
        ent = entropy.double().requires_grad_(out is not None and cfg.entropy_coef != 0.0)
        loss, metrics = grpo_objective(lp, ent, inp, cfg)
    if out is not None:
        grads = torch.autograd.grad(loss, [lp, ent] if ent.requires_grad else [lp])
        h = grads[1].float() if len(grads) > 1 else None
        backend.row_grad(logits, ids, row_state, entropy, grads[0].float(), h, cfg.temperature, out)
    return loss.detach(), logp, entropy, metrics


class _GRPOLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, cfg, backend, inp, inplace, ids, metrics_out):  # type: ignore[override]
        check_ids_range(ids, getattr(backend, "vocab", logits.shape[-1]))  # a vocabulary shard knows the full V
        out = None
        if ctx.needs_input_grad[0]:
            out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        loss, logp, entropy, metrics = forward_rows(logits, ids, cfg, backend, inp, out)
        metrics_out.update(metrics)
        ctx.grad_logits = out
        ctx.mark_non_differentiable(logp, entropy)
        return loss.to(torch.float32), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):  # type: ignore[override]
        grad = ctx.grad_logits
        if grad is None:
            raise RuntimeError(
                "grpo_loss: backward called a second time; the gradient buffer is consumed by the first backward "
                "(use retain_graph only with a fresh grpo_loss call)"
            )
        ctx.grad_logits = None
        scale = float(grad_loss)  # one host sync for a scalar; saves a pass over the gradient when it is 1
        if scale != 1.0:
            grad.mul_(scale)  # a Python scalar is applied in fp32 (opmath), not rounded to the gradient's dtype
        return grad, None, None, None, None, None, None


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, backend):  # type: ignore[override]
        check_ids_range(ids, logits.shape[-1])
        logp, entropy, row_state = backend.row_stats(logits, ids, temperature)
        ctx.save_for_backward(logits, ids, row_state, entropy)
        ctx.temperature, ctx.backend = temperature, backend
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        logits, ids, row_state, entropy = ctx.saved_tensors
        g = torch.zeros_like(entropy) if grad_logp is None else grad_logp.float()
        h = None if grad_entropy is None else grad_entropy.float()
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        ctx.backend.row_grad(logits, ids, row_state, entropy, g, h, ctx.temperature, out)
        return out, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Public API


def selective_log_softmax(
    logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each chosen token and the entropy of each row, without a full log_softmax.

    Args:
        logits: [B, T, V] float32/bfloat16/float16; any batch and time strides, unit vocabulary stride.
        completion_ids: [B, T] int32/int64 in [0, V).
        temperature: τ > 0; the distribution is softmax(logits / τ).
    Returns:
        (logp, entropy), each [B, T] float32, differentiable w.r.t. `logits` through both.
    """
    logits = _check_logits(logits)
    batch, length, _ = logits.shape
    ids = _check_ids(completion_ids, batch, length, logits.device)
    temperature = LossConfig(temperature=temperature).temperature
    return _SelectiveLogSoftmax.apply(logits, ids, temperature, _backend(backend, logits.device))


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
    backend: str = "auto",
    vocab_parallel_group: Any = None,
    data_parallel_group: Any = None,
    **options: Any,
) -> GRPOOutput:
    """The GRPO loss family (TRL 1.16 semantics, ../shared/GRPO_SPEC.md) from logits, with its gradient.

    Args:
        logits: [B, T, V] float32/bfloat16/float16, `logits[b, t]` scores `completion_ids[b, t]` (already shifted);
            strided views such as `full_logits[:, -T-1:-1]` are read in place, never copied.
        completion_ids: [B, T] int32/int64 in [0, V).
        advantages: [B], [B, 1] or [B, T].
        completion_mask: [B, T] bool/int/float, 1 = a token that counts; default all ones.
        old_logp: [B, T] log-probs of the policy that sampled; None = the detached current ones (ratio 1).
        ref_logp: [B, T] reference log-probs; required when beta != 0.
        importance_sampling_ratio: [B], [B, 1] or [B, T] rollout-engine correction ρ (a constant factor).
        sampling_logp: [B, T] sampler log-probs for the off-policy mask (default old_logp).
        inplace_backward: write ∂loss/∂logits into the logits buffer itself (zero extra V-wide memory). The logits
            are overwritten during the forward and autograd's version counter is bypassed: use it only when nothing
            else reads these logits afterwards.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        vocab_parallel_group: a torch.distributed group over which the vocabulary is sharded (Megatron-style
            tensor-parallel lm_head): `logits` is this rank's contiguous shard [B, T, V_rank], shards in rank order,
            `completion_ids` are global ids. One all-gather of [B, T, 5] partials per call; the loss and ℓ, H are
            those of the full vocabulary, and each rank gets its shard's gradient (two reads of the shard).
        data_parallel_group: the group the cross-rank defaults span (dapo-family token count, entropy quantile,
            metrics). Default: the default process group when torch.distributed is initialized and no
            vocab_parallel_group is given; with one, no data-parallel reduction unless this is set.
        **options: loss_type ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"), beta,
            epsilon_low, epsilon_high, delta, temperature, importance_sampling_level ("token" | "sequence"),
            use_bias_correction_kl, max_completion_length, num_items_in_batch, sapo_temperature_pos/neg,
            vespo_k_pos/neg, vespo_lambda_pos/neg, off_policy_mask_threshold, top_entropy_quantile, entropy_coef
            (see `LossConfig`; defaults as in TRL's GRPOConfig).
    Returns:
        GRPOOutput(loss, logp, entropy, metrics).

    Example:
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> ids = torch.randint(0, 11, (2, 5))
        >>> out = grpo_loss(logits, ids, advantages=torch.tensor([1.0, -1.0]))
        >>> out.loss.backward()
    """
    if torch.compiler.is_compiling():
        if vocab_parallel_group is not None:
            raise ValueError("vocab_parallel_group is not supported under torch.compile; call grpo_loss eagerly")
        tensors = (advantages, completion_mask, old_logp, ref_logp, importance_sampling_ratio, sampling_logp)
        data_group = resolve_data_group(data_parallel_group, None)
        return _compiled_grpo_loss(logits, completion_ids, tensors, inplace_backward, backend, options, data_group)
    unknown = set(options) - OPTION_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"grpo_loss got unknown option(s) {sorted(unknown)}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    check_group("vocab_parallel_group", vocab_parallel_group)
    check_group("data_parallel_group", data_parallel_group)
    cfg = LossConfig(**options)
    logits = _check_logits(logits)
    batch, length, _ = logits.shape
    ids = _check_ids(completion_ids, batch, length, logits.device)
    rows = _backend(backend, logits.device)
    if vocab_parallel_group is not None:
        offset, vocab = shard_offset(logits.shape[-1], vocab_parallel_group, logits.device)
        rows = ShardBackend(vocab_parallel_group, offset, vocab, rows)
    data_group = resolve_data_group(data_parallel_group, vocab_parallel_group)
    inp = _token_inputs(
        logits, advantages, completion_mask, old_logp, ref_logp, importance_sampling_ratio, sampling_logp,
        beta=cfg.beta, data_group=data_group,
    )
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True would overwrite a leaf tensor that requires grad; pass a non-leaf view")
    metrics: dict[str, torch.Tensor] = {}
    loss, logp, entropy = _GRPOLossFunction.apply(logits, cfg, rows, inp, inplace_backward, ids, metrics)
    return GRPOOutput(loss=loss, logp=logp, entropy=entropy, metrics=metrics)


def _compiled_grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    tensors: tuple[Any, ...],
    inplace: bool,
    backend: str,
    options: dict[str, Any],
    data_group: Any,
) -> GRPOOutput:
    """grpo_loss as traced by torch.compile: opaque row ops around a traced O(B·T) objective (see compile_op)."""
    if inplace:
        raise ValueError("inplace_backward=True is not supported under torch.compile (the op may not mutate its input)")
    cfg = traced_config(options)
    validate_config(logits, cfg.loss_type, cfg.importance_sampling_level, flat_numbers(cfg))
    logits = _check_logits(logits)
    batch, length, _ = logits.shape
    ids = _check_ids(completion_ids, batch, length, logits.device)
    inp = _token_inputs(logits, *tensors, beta=cfg.beta, data_group=data_group)
    logp, entropy, _ = row_stats_op(logits, ids, cfg.temperature, backend)
    loss, metrics = grpo_objective(logp.double(), entropy.double(), inp, cfg)
    return GRPOOutput(loss=loss.float(), logp=logp.detach(), entropy=entropy.detach(), metrics=metrics)


class GRPOLoss(torch.nn.Module):
    """`grpo_loss` as a module: options fixed at construction, tensors per call.

    >>> loss_fn = GRPOLoss(loss_type="dapo", beta=0.04)
    >>> out = loss_fn(logits, ids, advantages, mask, old_logp, ref_logp)
    """

    def __init__(self, *, inplace_backward: bool = False, backend: str = "auto", **options: Any) -> None:
        super().__init__()
        self.config = LossConfig(**options)  # validates now, not at the first step
        self.inplace_backward = inplace_backward
        self.backend = backend
        self._options = options

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
            backend=self.backend,
            **self._options,
            **tensors,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._options.items())
