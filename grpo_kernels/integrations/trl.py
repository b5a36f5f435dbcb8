"""TRL drop-in: `FusedGRPOTrainer` is TRL's `GRPOTrainer` with its loss computed by `grpo_loss` from the logits.

Same constructor, options, loss, gradients and logged metrics as the running TRL (1.12 to 1.16: `trl_versions` holds
what differs between releases); only `_compute_loss` changes. For code that builds its own `GRPOTrainer`,
`patch_grpo_trainer` swaps the same method into an instance or a class.

    from grpo_kernels.integrations.trl import FusedGRPOTrainer as GRPOTrainer

With `use_fused_linear=True` the loss is computed by `fused_linear_grpo_loss` from the last hidden states and the
lm_head weight instead: the model's forward runs as usual, but its lm_head is handed zero positions, so no logits
are ever formed (`trl_fused_linear`).

Over 400 lines: `_compute_loss` and the TRL internals it mirrors (the forward, the per-sequence clip metrics, the
gathered logging) belong together; the per-release differences and the self-check live in modules of their own.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .trl_versions import (
    TESTED_RANGE,
    TRLMapping,
    check_options,
    forward_context,
    logits_to_keep,
    mapping_for,
    untested_allowed,
)

try:
    import trl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "grpo_kernels.integrations.trl needs TRL; install a supported version with `pip install 'grpo-kernels[trl]'`"
    ) from exc
from packaging.version import Version

if Version(Version(trl.__version__).public) < Version("1.12.0"):
    raise ImportError(
        f"grpo_kernels.integrations.trl supports trl{TESTED_RANGE}, found trl {trl.__version__}; install a supported "
        "one with `pip install 'grpo-kernels[trl]'`."
    )

from trl import GRPOTrainer

from ..api import GRPOOutput, grpo_loss
from ..config import LossConfig
from ..loss_math import TokenInputs, grpo_objective
from .trl_check import FirstStepMismatch, FirstStepReport, first_step_check
from .trl_fused_linear import fused_linear_head, score_from_hidden

# TRL's own loss, kept before any class is patched: the first-step self-check runs it beside the fused one
_TRL_COMPUTE_LOSS = GRPOTrainer._compute_loss


def _model_inputs(inputs: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
    """The forward's keyword arguments: those TRL 1.16's `_get_per_token_logps_and_entropies` passes.

    TRL slices the multimodal tensors per chunk of sequences; `_compute_loss` runs one chunk of the whole batch,
    where every slice is the identity, so they pass unchanged. The branches follow TRL's, in its order.
    """
    model_inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    pixel_values = inputs.get("pixel_values")
    spatial_shapes = inputs.get("spatial_shapes")
    if pixel_values is not None:
        model_inputs["pixel_values"] = pixel_values
        if inputs.get("image_grid_thw") is not None:
            model_inputs["image_grid_thw"] = inputs["image_grid_thw"]
        elif inputs.get("image_position_ids") is not None:
            model_inputs["image_position_ids"] = inputs["image_position_ids"]
        elif spatial_shapes is not None:  # LFM2-VL: tile-indexed
            model_inputs["pixel_attention_mask"] = inputs.get("pixel_attention_mask")
            model_inputs["spatial_shapes"] = spatial_shapes
    if inputs.get("pixel_attention_mask") is not None and spatial_shapes is None:
        model_inputs["pixel_attention_mask"] = inputs["pixel_attention_mask"]
    for key in ("image_sizes", "token_type_ids", "mm_token_type_ids"):
        if inputs.get(key) is not None:
            model_inputs[key] = inputs[key]
    return model_inputs


def _keep_lm_head_in_fp32(model: torch.nn.Module) -> None:
    """With `cast_lm_head_to_fp32`, run TRL's fp32 head outside autocast, as its fused head does (once per model).

    TRL replaces `lm_head.forward` by an fp32 `F.linear`, which autocast would run in bf16 when the plain forward
    (rather than TRL's fused head, which disables autocast itself) calls it.
    """
    head = model.get_output_embeddings()
    if head is None or getattr(head, "_grpo_kernels_fp32", False):
        return
    forward = head.forward

    def fp32_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            return forward(hidden_states)

    head.forward = fp32_forward
    head._grpo_kernels_fp32 = True


def fused_compute_loss(self: GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """`GRPOTrainer._compute_loss` of the running TRL, with the per-token math and its gradient done by `grpo_loss`.

    On the first training step with `verify_first_step` (always on an untested TRL), TRL's own `_compute_loss` runs
    beside it on the same batch and the two are compared (see `trl_check`).
    """
    state = _integration_state(self)
    if state.verify_pending and self.model.training:
        state.verify_pending = False
        loss, self.first_step_report = first_step_check(
            self, model, inputs, _fused_loss, _TRL_COMPUTE_LOSS, trl.__version__
        )
        return loss
    return _fused_loss(self, model, inputs)


def _fused_loss(self: GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The fused `_compute_loss`, as the running TRL's mapping (`trl_versions`) says.

    The model returns plain logits for the last T+1 positions (`logits_to_keep`); `grpo_loss` reads the strided
    slice that scores the T completion tokens, at `self.temperature`, without a copy. TRL's normalizers outside the
    per-token math (gradient accumulation, steps_per_generation, the MoE aux loss) are applied as TRL applies them.
    With `self.use_fused_linear`, `fused_linear_grpo_loss` scores the same tokens from the lm_head's input hidden
    states and its weight, with the same options, normalizers and metrics.
    """
    mapping = _integration_state(self).mapping
    mode = "train" if self.model.training else "eval"
    batch = _batch_inputs(self, inputs, mapping)
    outputs, score = _forward(self, model, inputs, batch, mapping)
    accumulation, scale = _normalizers(self, mode, mapping)
    options = _loss_options(self, batch) | {"entropy_coef": _entropy_coef(self) / (accumulation * scale)}
    out = score(batch.completion_ids, batch.advantages, batch.mask, batch.old_logp, batch.ref_logp, **options)
    loss = out.loss * scale if scale != 1.0 else out.loss
    if self._entropy_bonus_enabled:
        _log_entropy_bonus(self, out, batch.mask, scale, mode, mapping)
    if self.aux_loss_enabled:  # the MoE load-balancing loss, scaled for gradient accumulation like the policy loss
        aux_loss = outputs.aux_loss
        loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_metrics(self, out, batch, mode, mapping)
    return loss


@dataclass
class _Batch:
    """One `_compute_loss` call's tensors, as the loss reads them."""

    input_ids: torch.Tensor  # [B, P+T], prompt then completion
    attention_mask: torch.Tensor  # [B, P+T]
    completion_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]: the completion mask, times the tool mask when there is one
    advantages: torch.Tensor  # [B] (or [B, T])
    old_logp: torch.Tensor | None  # [B, T]
    ref_logp: torch.Tensor | None  # [B, T], None when beta == 0
    importance_ratio: torch.Tensor | None  # the vLLM importance-sampling ratio, where TRL applies it
    sampling_logp: torch.Tensor | None  # the sampler's log-probs, for the off-policy mask
    num_items: float | None  # the generation batch's token count, for the token-count losses


def _batch_inputs(self: GRPOTrainer, inputs: dict[str, Any], mapping: TRLMapping) -> _Batch:
    """Gather the tensors of `inputs` the forward and the loss read, in the forms `grpo_loss` takes."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    advantages = inputs["advantages"]
    if advantages.dim() == 2 and advantages.size(1) == 1:  # TRL's own unsqueezed form, [B, 1]
        advantages = advantages.squeeze(1)
    # TRL applies the vLLM ratio to every loss when the correction is on; vespo folds it into φ whenever present
    importance_ratio = None
    if self.loss_type == "vespo" or (self.use_vllm and self.vllm_importance_sampling_correction):
        importance_ratio = inputs.get("importance_sampling_ratio")
    num_items = None
    if self.loss_type in mapping.token_count_losses:
        num_items = float(inputs["num_items_in_batch"])
    return _Batch(
        input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
        attention_mask=torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
        completion_ids=completion_ids,
        mask=completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"],
        advantages=advantages,
        old_logp=inputs.get("old_per_token_logps"),
        ref_logp=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
        importance_ratio=importance_ratio,
        sampling_logp=inputs.get("sampling_per_token_logps") if self.off_policy_mask_threshold is not None else None,
        num_items=num_items,
    )


def _forward(
    self: GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any], batch: _Batch, mapping: TRLMapping
) -> tuple[Any, Callable[..., GRPOOutput]]:
    """The model's forward and the loss to score it with: `score(completion_ids, advantages, ...)` is grpo_loss on
    the plain logits (TRL's fused head is off unless `fused_lm_head=True` is passed), or, in the fused-linear mode,
    fused_linear_grpo_loss on the hidden states the lm_head would have scored; both take the same arguments."""
    length = batch.completion_ids.size(1)  # T
    if self.args.cast_lm_head_to_fp32 and mapping.fp32_head_outside_autocast:
        _keep_lm_head_in_fp32(self.accelerator.unwrap_model(model))
    model_inputs = _model_inputs(inputs, batch.input_ids, batch.attention_mask)
    if self.aux_loss_enabled:
        model_inputs["output_router_logits"] = True
    if getattr(self, "use_fused_linear", False):
        return score_from_hidden(self, model, model_inputs, length, mapping)
    with forward_context(self, mapping):
        outputs = model(**model_inputs, **logits_to_keep(self, mapping, length), use_cache=False)
    # logits[:, t] scores the token at t + 1: the last T+1 rows, less the last, score the completion. Indexing
    # from the end also holds for a model that ignores `logits_to_keep` and returns every position.
    logits = outputs.logits[:, -(length + 1) : -1]  # [B, T, V], a strided view
    return outputs, functools.partial(grpo_loss, logits)


def _normalizers(self: GRPOTrainer, mode: str, mapping: TRLMapping) -> tuple[float, float]:
    """(accumulation, scale): TRL's normalizers outside the per-token math. grpo_loss gives TRL's loss at accumulation
    1 (and, for the token-count losses, steps_per_generation 1); `scale` brings it to TRL's."""
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    if self.loss_type in mapping.token_count_losses:
        # TRL: Σ m L / (N / P · accumulation / steps_per_generation), N spanning the generation batch
        scale = self.args.steps_per_generation / accumulation if mode == "train" else 1.0
    else:
        scale = 1.0 / accumulation
    return accumulation, scale


def _entropy_coef(self: GRPOTrainer) -> float:
    """The entropy bonus's coefficient this step: the coefficient and gate from the end of the previous optimizer
    step (TRL's adaptive controller). TRL divides the bonus by the accumulation factor only, so the caller
    pre-divides it by what `scale` adds to that."""
    if not self._entropy_bonus_enabled:
        return 0.0
    if self.use_adaptive_entropy:
        return self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
    return self.entropy_coef


def _loss_options(self: GRPOTrainer, batch: _Batch) -> dict[str, Any]:
    """The keyword arguments of the loss but the entropy coefficient: the batch's, and the options of TRL's config,
    under grpo_loss's names."""
    return {
        "importance_sampling_ratio": batch.importance_ratio,
        "sampling_logp": batch.sampling_logp,
        "num_items_in_batch": batch.num_items,
        "loss_type": self.loss_type,
        "beta": self.beta,
        "epsilon_low": self.epsilon_low,
        "epsilon_high": self.epsilon_high,
        "delta": self.args.delta,
        "temperature": self.temperature,
        "importance_sampling_level": self.importance_sampling_level,
        "use_bias_correction_kl": self.args.use_bias_correction_kl,
        "max_completion_length": self.max_completion_length,
        "sapo_temperature_pos": self.args.sapo_temperature_pos,
        "sapo_temperature_neg": self.args.sapo_temperature_neg,
        "vespo_k_pos": self.args.vespo_k_pos,
        "vespo_lambda_pos": self.args.vespo_lambda_pos,
        "vespo_k_neg": self.args.vespo_k_neg,
        "vespo_lambda_neg": self.args.vespo_lambda_neg,
        "off_policy_mask_threshold": self.off_policy_mask_threshold,
        "top_entropy_quantile": self.top_entropy_quantile,
    }


def _log_entropy_bonus(
    self: GRPOTrainer, out: GRPOOutput, mask: torch.Tensor, scale: float, mode: str, mapping: TRLMapping
) -> None:
    """The entropy bonus's bookkeeping, as TRL: the policy loss, the adaptive coefficient's update, its value."""
    policy_loss = out.metrics.get("policy_loss", out.loss.detach())  # absent when the applied coefficient is 0
    if self.loss_type in mapping.token_count_losses:
        policy_loss = policy_loss * scale  # TRL logs these after their full normalizer, the others before
    self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
    if self.use_adaptive_entropy and mode == "train":
        _adapt_entropy_coef(self, out, mask)
    if mode == "train" and self.accelerator.sync_gradients:
        self._metrics[mode]["entropy_coef"].append(self.entropy_coef)


def _adapt_entropy_coef(self: GRPOTrainer, out: GRPOOutput, mask: torch.Tensor) -> None:
    """TRL's adaptive entropy controller: the window's entropy over every rank moves the coefficient at the end of
    each optimizer step."""
    effective_mask = mask
    if self.top_entropy_quantile < 1.0:
        # The same mask grpo_loss applied: TRL's quantile over the same gathered entropies
        effective_mask = mask * self.get_high_entropy_mask(out.entropy, mask, 1 - self.top_entropy_quantile)
    stats = torch.stack([(out.entropy * effective_mask).sum(), effective_mask.sum()]).detach()
    if self._entropy_window_stats is None:
        self._entropy_window_stats = stats
    else:
        self._entropy_window_stats = self._entropy_window_stats + stats
    if not self.accelerator.sync_gradients:
        return
    window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
    world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
    if world_entropy <= self.args.entropy_target:
        self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
    else:
        self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
    self._last_world_entropy = world_entropy
    self._entropy_window_stats = None


def _log_metrics(self: GRPOTrainer, out: GRPOOutput, batch: _Batch, mode: str, mapping: TRLMapping) -> None:
    """The loss's metrics under TRL's names. grpo_loss already reduced the means over ranks; the per-sequence
    extremes are rebuilt from ℓ (O(B·T), no pass over the logits)."""
    metrics = self._metrics[mode]
    if "kl" in out.metrics:
        metrics["kl"].append(out.metrics["kl"].item())
    metrics["entropy"].append(out.metrics["entropy"].item())
    for name in mapping.metric_names(self.loss_type):
        metrics[name].append(out.metrics[name].item())
    if self.loss_type in mapping.clipped_losses:
        low, high = _sequence_clip_fractions(self, out.logp, batch.old_logp, batch.advantages, batch.mask)
        metrics["clip_ratio/low_min"].append(_nanmin(self.accelerator.gather(low)).item())
        metrics["clip_ratio/high_max"].append(_nanmax(self.accelerator.gather(high)).item())


def _sequence_clip_fractions(
    self: GRPOTrainer,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's fraction of low- and high-clipped tokens, [B] float32 (TRL's masked_seq_mean of its
    is_low_clipped / is_high_clipped): `grpo_objective`'s clip metrics taken over one sequence at a time (vmap).

    NaN for a fully masked sequence at token level, which TRL's nanmin / nanmax then skip.
    """
    cfg = LossConfig(
        loss_type="grpo",  # any clipped loss: the clip metrics depend on the ratio and the clip range only
        epsilon_low=self.epsilon_low,
        epsilon_high=self.epsilon_high,
        delta=self.args.delta,
        importance_sampling_level=self.importance_sampling_level,
    )
    logp = logp.detach().double()
    old = logp if old_logp is None else old_logp.double()
    adv = advantages.double()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    m = mask.double()

    def one_sequence(lp: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, mm: torch.Tensor):  # each [1, T] or [1, 1]
        inp = TokenInputs(advantages=a, mask=mm, old_logp=lo, ref_logp=None, is_ratio=None, sampling_logp=None)
        _, values = grpo_objective(lp, torch.zeros_like(lp), inp, cfg)
        return values["clip_ratio/low_mean"], values["clip_ratio/high_mean"]

    low, high = torch.func.vmap(one_sequence)(logp[:, None], old[:, None], adv[:, None], m[:, None])
    if self.importance_sampling_level == "token" and logp.shape[1] > 1:  # TRL divides by the unclamped count
        empty = m.sum(-1) == 0
        low, high = low.masked_fill(empty, math.nan), high.masked_fill(empty, math.nan)
    return low.float(), high.float()


def _nanmin(x: torch.Tensor) -> torch.Tensor:
    """The least non-NaN value, NaN when there is none (TRL's nanmin)."""
    return torch.tensor(math.nan, device=x.device) if torch.isnan(x).all() else x[~torch.isnan(x)].min()


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(math.nan, device=x.device) if torch.isnan(x).all() else x[~torch.isnan(x)].max()


class _IntegrationState:
    """Per trainer: the TRL mapping in use, and whether the first-step self-check is still to run."""

    def __init__(self, mapping: TRLMapping, verify_pending: bool) -> None:
        self.mapping = mapping
        self.verify_pending = verify_pending


def _attach(trainer: GRPOTrainer, *, verify_first_step: bool = False, trl_untested: bool | None = None) -> None:
    """Resolve the running TRL's mapping for `trainer`, refuse what it can't reproduce, arm the self-check."""
    mapping, tested = mapping_for(trl.__version__, allow_untested=untested_allowed(trl_untested))
    check_options(trainer, mapping, trl.__version__)
    verify = bool(verify_first_step) or not tested
    if verify and (getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)):
        # the check takes each trainable parameter's local gradient with torch.autograd.grad, which sharded or
        # partitioned parameters don't give
        why = "verify_first_step=True" if tested else f"an untested TRL ({trl.__version__}) needs the first-step check"
        raise ValueError(f"{why}, which does not run under FSDP or DeepSpeed; check on a single process or DDP first")
    trainer._grpo_kernels_state = _IntegrationState(mapping, verify_pending=verify)


def _integration_state(trainer: GRPOTrainer) -> _IntegrationState:
    state = getattr(trainer, "_grpo_kernels_state", None)
    if state is None:  # a patched class: resolved at the first loss, with the class's settings
        cls = type(trainer)
        _attach(
            trainer,
            verify_first_step=getattr(cls, "verify_first_step", False),
            trl_untested=getattr(cls, "trl_untested", None),
        )
        state = trainer._grpo_kernels_state
    return state


class FusedGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` (trl 1.12 to 1.16), same constructor and options, with the loss and its gradient from
    `grpo_loss`.

    Every GRPOConfig option of the loss is honoured: the eight loss types, epsilon/epsilon_high, delta, beta and
    use_bias_correction_kl, importance_sampling_level, temperature, top_entropy_quantile, entropy_coef (static and
    adaptive), off_policy_mask_threshold, the vLLM importance-sampling correction, tool masks, num_items_in_batch with
    gradient accumulation and steps_per_generation, and the MoE aux loss; the logged metrics keep TRL's names. What a
    release has that the fused loss can't reproduce is refused by name (`use_liger_kernel=True` before TRL 1.15).

    Example:
        >>> from grpo_kernels.integrations.trl import FusedGRPOTrainer
        >>> trainer = FusedGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(...),
        ...                            train_dataset=dataset)
        >>> trainer.train()

    `use_fused_linear=True` (a keyword of this class, not of GRPOConfig) computes the loss from the last hidden
    states and the lm_head weight with `fused_linear_grpo_loss`, never forming the (B, T, V) logits; same options,
    normalizers and metrics. It needs a plain nn.Linear lm_head (tied or not, frozen or trained; PEFT adapters on
    the body are fine) and refuses, with a ValueError, models that softcap or scale their logits, adapters on the
    lm_head, and lm_head weights flattened or partitioned outside the forward (FSDP1, DeepSpeed ZeRO-3).

    `verify_first_step=True` runs TRL's own `_compute_loss` beside the fused one on the first training step and
    compares the loss, the trainable parameters' gradients and the metrics at the parity tolerances, raising
    `FirstStepMismatch` with a report of what differs (cost: one extra forward and backward, once; the report is
    kept as `trainer.first_step_report`). `trl_untested=True` (or GRPO_KERNELS_TRL_UNTESTED=1) accepts a TRL newer
    than the tested range, with a warning, and then always runs that check.
    """

    use_fused_linear: bool = False
    first_step_report: FirstStepReport | None = None
    _compute_loss = fused_compute_loss

    def __init__(
        self,
        *args: Any,
        use_fused_linear: bool = False,
        verify_first_step: bool = False,
        trl_untested: bool | None = None,
        **kwargs: Any,
    ) -> None:
        with warnings.catch_warnings():  # refuse an untested TRL before building anything (_attach warns below)
            warnings.simplefilter("ignore")
            mapping_for(trl.__version__, allow_untested=untested_allowed(trl_untested))
        self.use_fused_linear = bool(use_fused_linear)
        super().__init__(*args, **kwargs)
        _attach(self, verify_first_step=verify_first_step, trl_untested=trl_untested)
        if self.use_fused_linear:
            fused_linear_head(self, self.model)  # refuse an unsupported model now rather than at the first step


def patch_grpo_trainer(
    trainer_or_class: Any,
    use_fused_linear: bool = False,
    *,
    verify_first_step: bool = False,
    trl_untested: bool | None = None,
) -> Any:
    """Make an existing `GRPOTrainer` instance (or a `GRPOTrainer` class and its subclasses) use the fused loss.

    For code that constructs TRL's trainer itself. Returns its argument. `use_fused_linear`, `verify_first_step` and
    `trl_untested` as in `FusedGRPOTrainer` (an instance's model and options are checked at once, a class's
    instances at their first loss).

    >>> trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    >>> patch_grpo_trainer(trainer).train()
    """
    if isinstance(trainer_or_class, type):
        if not issubclass(trainer_or_class, GRPOTrainer):
            raise TypeError(f"patch_grpo_trainer expects a GRPOTrainer subclass, got {trainer_or_class.__name__}")
        mapping_for(trl.__version__, allow_untested=untested_allowed(trl_untested))
        trainer_or_class._compute_loss = fused_compute_loss
        trainer_or_class.use_fused_linear = bool(use_fused_linear)
        trainer_or_class.verify_first_step = bool(verify_first_step)
        trainer_or_class.trl_untested = trl_untested
    elif isinstance(trainer_or_class, GRPOTrainer):
        _attach(trainer_or_class, verify_first_step=verify_first_step, trl_untested=trl_untested)
        if use_fused_linear:
            fused_linear_head(trainer_or_class, trainer_or_class.model)
        trainer_or_class._compute_loss = types.MethodType(fused_compute_loss, trainer_or_class)
        trainer_or_class.use_fused_linear = bool(use_fused_linear)
    else:
        raise TypeError(
            f"patch_grpo_trainer expects a GRPOTrainer instance or class, got {type(trainer_or_class).__name__}"
        )
    return trainer_or_class


__all__ = [
    "TESTED_RANGE",
    "FirstStepMismatch",
    "FirstStepReport",
    "FusedGRPOTrainer",
    "fused_compute_loss",
    "patch_grpo_trainer",
]
