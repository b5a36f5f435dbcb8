"""The policy: device and dtype, the model and tokenizer, the LoRA adapter, log-probs, the optimizer and schedule.

The reference policy is the same model with its adapter disabled, so no second copy is ever loaded.
"""

from __future__ import annotations

import inspect
import os
import resource
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .. import selective_log_softmax
from .config import TrainConfig
from .data import hub_offline
from .errors import LoadError


def resolve_device(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device!r} but CUDA is not available")
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a local folder or a hub id, with errors that say which and why."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not name_or_path:
        raise ValueError("model must name a model folder or a Hugging Face hub id")
    looks_local = name_or_path.startswith((".", "/", "~")) or os.path.isdir(name_or_path)
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"model folder {name_or_path!r} does not exist")
    path = os.path.expanduser(name_or_path)
    if looks_local and not os.path.isfile(os.path.join(path, "config.json")):
        raise LoadError(
            f"model folder {name_or_path!r} has no config.json, so it is not a model folder as save_pretrained "
            "writes it (config.json, the weights, the tokenizer files); "
            + (f"it holds: {', '.join(sorted(os.listdir(path))[:6])}" if os.listdir(path) else "it is empty")
        )
    cached_only = not looks_local and hub_offline()  # no network: the local HF cache or a fast, clear failure
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=cached_only)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=cached_only)
    except (OSError, ValueError, KeyError) as err:
        if looks_local:
            raise LoadError(
                f"could not load the model folder {name_or_path!r} (it needs config.json, the weights and the "
                f"tokenizer files, as save_pretrained writes them): {err}"
            ) from err
        raise LoadError(
            f"could not load {name_or_path!r}: it is not a local folder, and "
            + (
                "the Hugging Face hub is unreachable and the model is not in its local cache"
                if cached_only
                else f"loading it from the Hugging Face hub failed ({type(err).__name__}: {err})"
            )
            + ". Pass a model folder (as save_pretrained writes it), or make the hub reachable."
        ) from err
    return model, tokenizer


def check_context(model: Any, tokenizer: Any, prompts: Sequence[str], cfg: TrainConfig) -> None:
    """Refuse, before the model runs, lengths past the model's context (`max_position_embeddings`): the completion
    limit alone, or with the longest of `prompts` (the rendered prompts, as `generate` tokenizes and cuts them)."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    if cfg.max_completion_length >= context:
        raise ValueError(
            f"max_completion_length={cfg.max_completion_length} does not fit the model's context of {context} "
            f"positions (max_position_embeddings in its config.json), which must also hold the prompt: at most "
            f"{context - 1}"
        )
    special = not (cfg.chat_template and getattr(tokenizer, "chat_template", None))
    lengths = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=special)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    used = min(lengths[longest], cfg.max_prompt_length)
    if used + cfg.max_completion_length > context:
        raise ValueError(
            f"prompts of up to {used} tokens (the longest prompt, row {longest + 1}, has {lengths[longest]}; "
            f"max_prompt_length={cfg.max_prompt_length} cuts longer ones) and max_completion_length="
            f"{cfg.max_completion_length} new tokens need {used + cfg.max_completion_length} positions, more than "
            f"the model's context of {context} (max_position_embeddings): lower max_prompt_length to at most "
            f"{context - cfg.max_completion_length}, or max_completion_length"
        )


def add_lora(model: Any, cfg: TrainConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft 0.21 probes an attribute transformers 5 deprecated; not ours to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, lora)
    except ValueError as err:
        raise ValueError(
            f"lora_target_modules={cfg.lora_target_modules!r} does not fit this model ({err}); "
            "try --lora-target-modules all-linear"
        ) from err


def prepare_tokenizer(tokenizer: Any) -> Any:
    tokenizer.padding_side = "left"  # prompts end where generation starts
    tokenizer.truncation_side = "left"  # a long prompt keeps its end
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def completion_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """[n, T, V] logits where [:, t] scores completion token t: a strided view of the model's output, no copy."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    kwargs = {"logits_to_keep": length + 1} if accepts_logits_to_keep(getattr(model, "module", model)) else {}
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **kwargs
    ).logits  # [n, T+1 or P+T, V]
    return logits[:, -length - 1 : -1]


def micro_batches(n: int, cfg: TrainConfig) -> list[slice]:
    """The rollout batch of n sequences cut into exactly `gradient_accumulation_steps` micro-batches, as even as
    they come (sizes differ by at most one; the loss weighs each by its share, `loop.micro_batch_share`)."""
    k = cfg.gradient_accumulation_steps
    if k > n:
        raise ValueError(
            f"gradient_accumulation_steps={k} is more than the {n} sequences of a rollout batch on this process "
            "(prompts_per_step x num_generations / processes): each micro-batch needs at least one"
        )
    return [slice(i * n // k, (i + 1) * n // k) for i in range(k)]


def accepts_logits_to_keep(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


@torch.no_grad()
def per_token_logp(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    cfg: TrainConfig,
) -> torch.Tensor:
    """log π(y_t | y_<t) of the completion tokens, [N, T] fp32, micro-batch by micro-batch (old or reference policy)."""
    out = []
    for mb in micro_batches(input_ids.shape[0], cfg):
        logits = completion_logits(model, input_ids[mb], attention_mask[mb], completion_ids.shape[1])
        out.append(selective_log_softmax(logits, completion_ids[mb], cfg.temperature)[0])
    return torch.cat(out)


def make_optimizer(model: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, *, done: int = 0) -> Any:
    """The LR schedule over `max_steps * num_iterations` optimizer steps, of which `done` are already taken: a
    resumed run whose configuration changed continues on the schedule of its new length and learning rate, and
    the optimizer takes the new AdamW hyperparameters."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    if done:
        for group in optimizer.param_groups:
            group.update(
                initial_lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
            )
    if cfg.lr_scheduler == "cosine":
        total = cfg.max_steps * cfg.num_iterations
        return get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total, last_epoch=done - 1)
    return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps, last_epoch=done - 1)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
