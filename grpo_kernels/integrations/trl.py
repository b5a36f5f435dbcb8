"""TRL drop-in: `FusedGRPOTrainer` is TRL's `GRPOTrainer` with its loss computed by `grpo_loss` from the logits.

Same constructor, options, loss, gradients and logged metrics as TRL 1.16; only `_compute_loss` changes. For code
that builds its own `GRPOTrainer`, `patch_grpo_trainer` swaps the same method into an instance or a class.

    from grpo_kernels.integrations.trl import FusedGRPOTrainer as GRPOTrainer

With `use_fused_linear=True` the loss is computed by `fused_linear_grpo_loss` from the last hidden states and the
lm_head weight instead: the model's forward runs as usual, but its lm_head is handed zero positions, so no logits
are ever formed (see `_score_from_hidden`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
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

from ..api import GRPOOutput, grpo_loss
from ..fused_linear import fused_linear_grpo_loss

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


# ----------------------------------------------------------------------------------------------------------------
# Fused-linear mode: the loss from the lm_head's input hidden states and its weight

# Config fields by which a model transforms its lm_head output (TRL's `add_fused_lm_head` reads the same ones); the
# fused-linear loss computes `hidden @ W.T + b` only, so a model that sets any of them is refused.
_LOGIT_SOFTCAP_FIELDS = ("final_logit_softcapping",)
_LOGIT_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
# Autograd nodes between the lm_head's output and the model's `logits` that leave the values unchanged
_PASSTHROUGH_NODES = frozenset(
    {"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "SliceBackward0", "CloneBackward0"}
)


def _refuse(reason: str) -> ValueError:
    return ValueError(f"use_fused_linear=True: {reason}. Use the default logits mode (use_fused_linear=False).")


def _fused_linear_head(self: GRPOTrainer, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(the output-embedding module the forward calls, the nn.Linear whose weight and bias score the hidden states).

    Raises ValueError for what `fused_linear_grpo_loss` cannot reproduce. With PEFT, `get_output_embeddings` reaches
    the base model through peft's wrappers; an lm_head trained as `modules_to_save` is read from its active copy.
    """
    if getattr(self, "is_fsdp_enabled", False) and not getattr(self.accelerator, "is_fsdp2", False):
        raise _refuse(
            "FSDP1 flattens the lm_head weight into a buffer outside the model's forward; use FSDP2 (fsdp_version: 2), "
            "whose sharded DTensor weight fused_linear_grpo_loss gathers"
        )
    if getattr(self, "is_deepspeed_enabled", False):
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
            raise _refuse("DeepSpeed ZeRO-3 partitions the lm_head weight outside the model's forward")
    unwrapped = self.accelerator.unwrap_model(model)
    config = getattr(unwrapped, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_SOFTCAP_FIELDS:
        if getattr(text_config, name, None) is not None:
            raise _refuse(
                f"the model applies final logit softcapping (config.{name}={getattr(text_config, name)}), which "
                "the fused-linear loss does not compute"
            )
    for name in _LOGIT_SCALE_FIELDS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            raise _refuse(
                f"the model scales its logits (config.{name}={value}), which the fused-linear loss does not compute"
            )
    head = unwrapped.get_output_embeddings() if hasattr(unwrapped, "get_output_embeddings") else None
    if head is None:
        raise _refuse(f"{type(unwrapped).__name__} has no output embedding (lm_head) module")
    linear = head
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - depends on the environment
        BaseTunerLayer = ModulesToSaveWrapper = ()  # type: ignore[assignment,misc]
    if BaseTunerLayer and isinstance(head, BaseTunerLayer):
        raise _refuse(
            "the lm_head carries a PEFT adapter (target_modules includes it), whose output the fused-linear loss "
            "does not compute; remove lm_head from the adapter's target modules"
        )
    if ModulesToSaveWrapper and isinstance(head, ModulesToSaveWrapper):
        if head.disable_adapters or not head.active_adapters:
            linear = head.original_module
        elif len(head.active_adapters) == 1 and head.active_adapters[0] in head.modules_to_save:
            linear = head.modules_to_save[head.active_adapters[0]]
        else:
            raise _refuse(f"the lm_head is trained (modules_to_save) by several active adapters {head.active_adapters}")
    if not isinstance(linear, torch.nn.Linear) or type(linear).forward is not torch.nn.Linear.forward:
        raise _refuse(f"the lm_head is a {type(linear).__name__}, not a plain torch.nn.Linear")
    weight = linear.weight
    # A DTensor (FSDP2 / fully_shard) weight is fine: fused_linear_grpo_loss gathers it for the call
    if not weight.is_floating_point() or weight.is_meta or weight.dim() != 2:
        raise _refuse(
            f"the lm_head weight is not a plain floating-point matrix on a device ({type(weight).__name__}, "
            f"{weight.dtype}, {weight.device}): quantized and offloaded heads are not supported"
        )
    return head, linear


def _score_from_hidden(
    self: GRPOTrainer, model: torch.nn.Module, model_inputs: dict[str, Any], length: int
) -> tuple[Any, Callable[..., GRPOOutput]]:
    """The model's forward with its lm_head fed zero positions; `fused_linear_grpo_loss` bound to what it would read.

    The forward runs whole, through every wrapper (DDP, PEFT, the multimodal model's merge of image features), with
    `logits_to_keep=T+1`; a pre-hook on the output embedding takes the hidden states it receives and hands it their
    first 0 positions instead. The lm_head's own forward thus runs on a (B, 0, H) input: no logits are formed, while
    the (B, 0, V) `logits` the model returns stay connected to the body and the head (so that a wrapper which looks
    for unused parameters from the outputs finds them all), and the MoE aux loss comes out as in the logits mode.
    The hidden states that score the completion are the strided view `[:, -T-1:-1]` of the captured ones.
    """
    head, linear = _fused_linear_head(self, model)
    captured: list[torch.Tensor] = []
    head_outputs: list[Any] = []

    def take_hidden(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs.get("input")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise _refuse(f"the lm_head was called with an input other than [B, S, H] hidden states: {hidden!r:.80}")
        captured.append(hidden)
        empty = hidden[:, :0]
        return ((empty, *args[1:]), kwargs) if args else (args, {**kwargs, "input": empty})

    pre_hook = head.register_forward_pre_hook(take_hidden, with_kwargs=True)
    post_hook = head.register_forward_hook(lambda module, args, output: head_outputs.append(output))
    try:
        with self.accelerator.autocast():
            outputs = model(**model_inputs, logits_to_keep=length + 1, use_cache=False)
            device_type = captured[0].device.type if captured else self.accelerator.device.type
            amp_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    finally:
        pre_hook.remove()
        post_hook.remove()
    if len(captured) != 1:
        raise _refuse(f"the model's forward called its lm_head {len(captured)} times, not once")
    _check_logits_untransformed(outputs.logits, head_outputs[0])

    weight, bias = linear.weight, linear.bias
    hidden = captured[0][:, -(length + 1) : -1]  # [B, T, H], a strided view of the lm_head's input
    # The lm_head's precision in the logits mode: fp32 with cast_lm_head_to_fp32 (TRL's fp32 head), else autocast's
    # dtype for both operands when it is on, else the weight's
    if self.args.cast_lm_head_to_fp32:
        dtype = torch.float32
    elif amp_dtype is not None and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
        dtype = amp_dtype
    else:
        dtype = weight.dtype
    hidden = hidden.to(weight.device, dtype)  # the same view when nothing changes, else one [B, T, H] copy
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return outputs, functools.partial(fused_linear_grpo_loss, hidden, weight, bias=bias)


def _check_logits_untransformed(logits: Any, head_output: Any) -> None:
    """Refuse a model whose `logits` are its lm_head output transformed (a softcap or scale its config doesn't name).

    Reads the autograd graph between the two (only dtype casts and views may lie in between); without a graph (under
    no_grad) only identity can be checked, and the config checks of `_fused_linear_head` stand alone.
    """
    if logits is head_output or not isinstance(logits, torch.Tensor) or not isinstance(head_output, torch.Tensor):
        return
    node, target = logits.grad_fn, head_output.grad_fn
    if node is None or target is None:
        return
    for _ in range(16):
        if node is target:
            return
        if node is None or node.name() not in _PASSTHROUGH_NODES or not node.next_functions:
            break
        node = node.next_functions[0][0]
    raise _refuse(
        f"the model transforms its lm_head output before returning the logits (through {node.name() if node else None}"
        "), which the fused-linear loss does not compute"
    )


def fused_compute_loss(self: GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """`GRPOTrainer._compute_loss` of TRL 1.16, with the per-token math and its gradient done by `grpo_loss`.

    The model returns plain logits for the last T+1 positions (`logits_to_keep`); `grpo_loss` reads the strided
    slice that scores the T completion tokens, at `self.temperature`, without a copy. TRL's normalizers outside the
    per-token math (gradient accumulation, steps_per_generation, the MoE aux loss) are applied as TRL applies them.
    With `self.use_fused_linear`, `fused_linear_grpo_loss` scores the same tokens from the lm_head's input hidden
    states and its weight, with the same options, normalizers and metrics.
    """
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    length = completion_ids.size(1)  # T
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mode = "train" if self.model.training else "eval"

    # ---- the forward: plain logits (TRL's fused head is off unless `fused_lm_head=True` is passed), or, in the
    # fused-linear mode, the hidden states the lm_head would have scored
    if self.args.cast_lm_head_to_fp32:
        _keep_lm_head_in_fp32(self.accelerator.unwrap_model(model))
    model_inputs = _model_inputs(inputs, input_ids, attention_mask)
    if self.aux_loss_enabled:
        model_inputs["output_router_logits"] = True
    # `score(completion_ids, advantages, ...)`: grpo_loss on the logits, or fused_linear_grpo_loss on the hidden
    # states; both take the same arguments and options, mapped once below
    score: Callable[..., GRPOOutput]
    if getattr(self, "use_fused_linear", False):
        outputs, score = _score_from_hidden(self, model, model_inputs, length)
    else:
        with self.accelerator.autocast():
            outputs = model(**model_inputs, logits_to_keep=length + 1, use_cache=False)
        # logits[:, t] scores the token at t + 1: the last T+1 rows, less the last, score the completion. Indexing
        # from the end also holds for a model that ignores `logits_to_keep` and returns every position.
        logits = outputs.logits[:, -(length + 1) : -1]  # [B, T, V], a strided view
        score = functools.partial(grpo_loss, logits)

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

    out = score(
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

    `use_fused_linear=True` (a keyword of this class, not of GRPOConfig) computes the loss from the last hidden
    states and the lm_head weight with `fused_linear_grpo_loss`, never forming the (B, T, V) logits; same options,
    normalizers and metrics. It needs a plain nn.Linear lm_head (tied or not, frozen or trained; PEFT adapters on
    the body are fine) and refuses, with a ValueError, models that softcap or scale their logits, adapters on the
    lm_head, and lm_head weights flattened or partitioned outside the forward (FSDP1, DeepSpeed ZeRO-3).
    """

    use_fused_linear: bool = False
    _compute_loss = fused_compute_loss

    def __init__(self, *args: Any, use_fused_linear: bool = False, **kwargs: Any) -> None:
        self.use_fused_linear = bool(use_fused_linear)
        super().__init__(*args, **kwargs)
        if self.use_fused_linear:
            _fused_linear_head(self, self.model)  # refuse an unsupported model now rather than at the first step


def patch_grpo_trainer(trainer_or_class: Any, use_fused_linear: bool = False) -> Any:
    """Make an existing `GRPOTrainer` instance (or a `GRPOTrainer` class and its subclasses) use the fused loss.

    For code that constructs TRL's trainer itself. Returns its argument. `use_fused_linear` as in
    `FusedGRPOTrainer` (an instance's model is checked at once, a class's at its first loss).

    >>> trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    >>> patch_grpo_trainer(trainer).train()
    """
    if isinstance(trainer_or_class, type):
        if not issubclass(trainer_or_class, GRPOTrainer):
            raise TypeError(f"patch_grpo_trainer expects a GRPOTrainer subclass, got {trainer_or_class.__name__}")
        trainer_or_class._compute_loss = fused_compute_loss
        trainer_or_class.use_fused_linear = bool(use_fused_linear)
    elif isinstance(trainer_or_class, GRPOTrainer):
        if use_fused_linear:
            _fused_linear_head(trainer_or_class, trainer_or_class.model)
        trainer_or_class._compute_loss = types.MethodType(fused_compute_loss, trainer_or_class)
        trainer_or_class.use_fused_linear = bool(use_fused_linear)
    else:
        raise TypeError(
            f"patch_grpo_trainer expects a GRPOTrainer instance or class, got {type(trainer_or_class).__name__}"
        )
    return trainer_or_class


__all__ = ["SUPPORTED_TRL_VERSIONS", "FusedGRPOTrainer", "fused_compute_loss", "patch_grpo_trainer"]
