"""TRL drop-in: `FusedGRPOTrainer` is TRL's `GRPOTrainer` with its loss computed by `grpo_loss` from the logits.

Same constructor, options, loss, gradients and logged metrics as TRL 1.16; only `_compute_loss` changes. For code
that builds its own `GRPOTrainer`, `patch_grpo_trainer` swaps the same method into an instance or a class.

    from grpo_kernels.integrations.trl import FusedGRPOTrainer as GRPOTrainer
"""

from __future__ import annotations

import types
from typing import Any

import torch

SUPPORTED_TRL_VERSIONS = ("1.16.0",)


def _check_trl_version() -> None:
    try:
        import trl
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "grpo_kernels.integrations.trl needs TRL; install the supported version with "
            "`pip install 'grpo-kernels[trl]'`"
        ) from exc
    from packaging.version import Version

    found = Version(trl.__version__).public
    if found not in SUPPORTED_TRL_VERSIONS:
        raise ImportError(
            f"grpo_kernels.integrations.trl supports trl=={' or '.join(SUPPORTED_TRL_VERSIONS)}, found trl {found}. "
            "The fused loss reproduces that version's GRPOTrainer._compute_loss line by line, so another version could "
            "train with a silently different loss. Install the supported one with `pip install 'grpo-kernels[trl]'`."
        )


_check_trl_version()

from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from ..api import grpo_loss

# The losses TRL normalizes by `num_items_in_batch` (active tokens of the whole generation batch), not per micro-batch.
_TOKEN_COUNT_LOSSES = ("cispo", "dapo", "vespo")
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


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
    """`GRPOTrainer._compute_loss` of TRL 1.16, with the per-token math and its gradient done by `grpo_loss`.

    The model returns plain logits for the last T+1 positions (`logits_to_keep`); `grpo_loss` reads the strided
    slice that scores the T completion tokens, at `self.temperature`, without a copy. TRL's normalizers outside the
    per-token math (gradient accumulation, steps_per_generation, the MoE aux loss) are applied as TRL applies them.
    """
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    length = completion_ids.size(1)  # T
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mode = "train" if self.model.training else "eval"

    # ---- the forward: plain logits (TRL's fused head is off unless `fused_lm_head=True` is passed)
    if self.args.cast_lm_head_to_fp32:
        _keep_lm_head_in_fp32(self.accelerator.unwrap_model(model))
    model_inputs = _model_inputs(inputs, input_ids, attention_mask)
    if self.aux_loss_enabled:
        model_inputs["output_router_logits"] = True
    with self.accelerator.autocast():
        outputs = model(**model_inputs, logits_to_keep=length + 1, use_cache=False)
    # logits[:, t] scores the token at t + 1: the last T+1 rows, less the last, score the completion. Indexing from
    # the end also holds for a model that ignores `logits_to_keep` and returns every position.
    logits = outputs.logits[:, -(length + 1) : -1]  # [B, T, V], a strided view

    # ---- TRL's normalizers outside the per-token math. grpo_loss gives TRL's loss at accumulation 1 (and, for the
    # token-count losses, steps_per_generation 1); `scale` brings it to TRL's. TRL divides the entropy bonus by the
    # accumulation factor only, so the coefficient handed to grpo_loss is pre-divided by what `scale` adds to that.
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    if self.loss_type in _TOKEN_COUNT_LOSSES:
        # TRL: Σ m L / (N / P · accumulation / steps_per_generation), N spanning the generation batch
        scale = self.args.steps_per_generation / accumulation if mode == "train" else 1.0
    else:
        scale = 1.0 / accumulation
    apply_coef = 0.0
    if self._entropy_bonus_enabled:
        # The coefficient and gate from the end of the previous optimizer step (TRL's adaptive controller)
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef

    advantages = inputs["advantages"]
    if advantages.dim() == 2 and advantages.size(1) == 1:  # TRL's own unsqueezed form, [B, 1]
        advantages = advantages.squeeze(1)
    # TRL applies the vLLM ratio to every loss when the correction is on; vespo folds it into φ whenever present
    is_ratio = None
    if self.loss_type == "vespo" or (self.use_vllm and self.vllm_importance_sampling_correction):
        is_ratio = inputs.get("importance_sampling_ratio")
    num_items = None
    if self.loss_type in _TOKEN_COUNT_LOSSES:
        num_items = float(inputs["num_items_in_batch"])
    old_logp = inputs.get("old_per_token_logps")

    out = grpo_loss(
        logits,
        completion_ids,
        advantages,
        mask,
        old_logp,
        inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
        importance_sampling_ratio=is_ratio,
        sampling_logp=inputs.get("sampling_per_token_logps") if self.off_policy_mask_threshold is not None else None,
        loss_type=self.loss_type,
        beta=self.beta,
        epsilon_low=self.epsilon_low,
        epsilon_high=self.epsilon_high,
        delta=self.args.delta,
        temperature=self.temperature,
        importance_sampling_level=self.importance_sampling_level,
        use_bias_correction_kl=self.args.use_bias_correction_kl,
        max_completion_length=self.max_completion_length,
        num_items_in_batch=num_items,
        sapo_temperature_pos=self.args.sapo_temperature_pos,
        sapo_temperature_neg=self.args.sapo_temperature_neg,
        vespo_k_pos=self.args.vespo_k_pos,
        vespo_lambda_pos=self.args.vespo_lambda_pos,
        vespo_k_neg=self.args.vespo_k_neg,
        vespo_lambda_neg=self.args.vespo_lambda_neg,
        off_policy_mask_threshold=self.off_policy_mask_threshold,
        top_entropy_quantile=self.top_entropy_quantile,
        entropy_coef=apply_coef / (accumulation * scale),
    )
    loss = out.loss * scale if scale != 1.0 else out.loss

    # ---- entropy bonus bookkeeping, as TRL
    if self._entropy_bonus_enabled:
        policy_loss = out.metrics.get("policy_loss", out.loss.detach())  # absent when the applied coefficient is 0
        if self.loss_type in _TOKEN_COUNT_LOSSES:
            policy_loss = policy_loss * scale  # TRL logs these after their full normalizer, the others before
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())

        if self.use_adaptive_entropy and mode == "train":
            effective_mask = mask
            if self.top_entropy_quantile < 1.0:
                # The same mask grpo_loss applied: TRL's quantile over the same gathered entropies
                effective_mask = mask * self.get_high_entropy_mask(out.entropy, mask, 1 - self.top_entropy_quantile)
            stats = torch.stack([(out.entropy * effective_mask).sum(), effective_mask.sum()]).detach()
            if self._entropy_window_stats is None:
                self._entropy_window_stats = stats
            else:
                self._entropy_window_stats = self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min
                    )
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None

        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    # ---- MoE load-balancing loss, scaled for gradient accumulation like the policy loss
    if self.aux_loss_enabled:
        aux_loss = outputs.aux_loss
        loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

    # ---- metrics under TRL's names. grpo_loss already reduced the means over ranks; the per-sequence extremes
    # are rebuilt from ℓ (O(B·T), no pass over the logits).
    metrics = self._metrics[mode]
    if "kl" in out.metrics:
        metrics["kl"].append(out.metrics["kl"].item())
    metrics["entropy"].append(out.metrics["entropy"].item())
    if self.loss_type in _CLIPPED_LOSSES:
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            metrics[name].append(out.metrics[name].item())
        low, high = _clipped_tokens(self, out.logp, old_logp, advantages, mask)
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(_masked_seq_mean(low, mask))).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(_masked_seq_mean(high, mask))).item())
    elif self.loss_type == "cispo":
        metrics["cispo_clip_ratio"].append(out.metrics["cispo_clip_ratio"].item())
    elif self.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"].append(out.metrics["vespo/phi_seq_mean"].item())
    return loss


def _clipped_tokens(
    self: GRPOTrainer,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's is_low_clipped / is_high_clipped as floats, [B, T] or [B, 1] (sequence level), from the detached ℓ."""
    log_ratio = logp - (logp if old_logp is None else old_logp)
    if self.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if self.args.delta is not None:
        ratio = torch.clamp(ratio, max=self.args.delta)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    low = (ratio < 1 - self.epsilon_low) & (adv < 0)
    high = (ratio > 1 + self.epsilon_high) & (adv > 0)
    return low.float(), high.float()


def _masked_seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One value per sequence; NaN for a fully masked one (TRL's masked_seq_mean, which nanmin/nanmax skip)."""
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


class FusedGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` (1.16), same constructor and options, with the loss and its gradient from `grpo_loss`.

    Every GRPOConfig option of the loss is honoured: the eight loss types, epsilon/epsilon_high, delta, beta and
    use_bias_correction_kl, importance_sampling_level, temperature, top_entropy_quantile, entropy_coef (static and
    adaptive), off_policy_mask_threshold, the vLLM importance-sampling correction, tool masks, num_items_in_batch with
    gradient accumulation and steps_per_generation, and the MoE aux loss; the logged metrics keep TRL's names.

    Example:
        >>> from grpo_kernels.integrations.trl import FusedGRPOTrainer
        >>> trainer = FusedGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(...),
        ...                            train_dataset=dataset)
        >>> trainer.train()
    """

    _compute_loss = fused_compute_loss


def patch_grpo_trainer(trainer_or_class: Any) -> Any:
    """Make an existing `GRPOTrainer` instance (or a `GRPOTrainer` class and its subclasses) use the fused loss.

    For code that constructs TRL's trainer itself. Returns its argument.

    >>> trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    >>> patch_grpo_trainer(trainer).train()
    """
    if isinstance(trainer_or_class, type):
        if not issubclass(trainer_or_class, GRPOTrainer):
            raise TypeError(f"patch_grpo_trainer expects a GRPOTrainer subclass, got {trainer_or_class.__name__}")
        trainer_or_class._compute_loss = fused_compute_loss
    elif isinstance(trainer_or_class, GRPOTrainer):
        trainer_or_class._compute_loss = types.MethodType(fused_compute_loss, trainer_or_class)
    else:
        raise TypeError(
            f"patch_grpo_trainer expects a GRPOTrainer instance or class, got {type(trainer_or_class).__name__}"
        )
    return trainer_or_class


__all__ = ["SUPPORTED_TRL_VERSIONS", "FusedGRPOTrainer", "fused_compute_loss", "patch_grpo_trainer"]
