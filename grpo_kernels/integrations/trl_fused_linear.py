"""The TRL drop-in's fused-linear mode: the loss from the lm_head's input hidden states and its weight.

The model's forward runs as usual, but its lm_head is handed zero positions, so no logits are ever formed (see
`score_from_hidden`); what `fused_linear_grpo_loss` cannot reproduce is refused by name (`fused_linear_head`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..api import GRPOOutput
from ..fused_linear import fused_linear_grpo_loss
from .trl_versions import TRLMapping, forward_context, logits_to_keep

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


def fused_linear_head(self: Any, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
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


def score_from_hidden(
    self: Any, model: torch.nn.Module, model_inputs: dict[str, Any], length: int, mapping: TRLMapping
) -> tuple[Any, Callable[..., GRPOOutput]]:
    """The model's forward with its lm_head fed zero positions; `fused_linear_grpo_loss` bound to what it would read.

    The forward runs whole, through every wrapper (DDP, PEFT, the multimodal model's merge of image features), with
    `logits_to_keep=T+1`; a pre-hook on the output embedding takes the hidden states it receives and hands it their
    first 0 positions instead. The lm_head's own forward thus runs on a (B, 0, H) input: no logits are formed, while
    the (B, 0, V) `logits` the model returns stay connected to the body and the head (so that a wrapper which looks
    for unused parameters from the outputs finds them all), and the MoE aux loss comes out as in the logits mode.
    The hidden states that score the completion are the strided view `[:, -T-1:-1]` of the captured ones.
    """
    head, linear = fused_linear_head(self, model)
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
        with forward_context(self, mapping):
            outputs = model(**model_inputs, **logits_to_keep(self, mapping, length), use_cache=False)
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
    # The lm_head's precision in the logits mode: fp32 with cast_lm_head_to_fp32 (TRL's fp32 head; before TRL 1.15
    # only where no autocast is on), else autocast's dtype for both operands when it is on, else the weight's
    if self.args.cast_lm_head_to_fp32 and (mapping.fp32_head_outside_autocast or amp_dtype is None):
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
    no_grad) only identity can be checked, and the config checks of `fused_linear_head` stand alone.
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


__all__ = ["fused_linear_head", "score_from_hidden"]
