"""The GRPO loop on `grpo_loss`, one readable function in the manner of nanoGPT's train.py.

Each step: sample G completions for each of B prompts from the LoRA policy, score them with the reward functions,
normalize the rewards within each group, then take `num_iterations` optimizer steps on the clipped objective with a
KL penalty to the reference policy, which is the same base model with the adapter disabled (no second copy).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import resource
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import group_advantages, grpo_loss, selective_log_softmax
from ..rewards import RewardFunc, combine_rewards, get_reward_funcs, reward_name
from .checkpoint import latest_checkpoint, load_checkpoint, remove_partial_checkpoints, save_checkpoint
from .config import TrainConfig
from .data import (
    LoadError,
    columns_for,
    hub_offline,
    prompt_indices,
    render_prompt,
    resolve_system_prompt,
    rows_from_config,
)
from .plotting import plot_metrics, read_metrics

# Loss types whose normalizer is the token count of the whole rollout batch (TRL's num_items_in_batch): their
# micro-batch losses add up; the others average per micro-batch and are divided by the number of micro-batches.
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")


@dataclass
class Rollout:
    """One rollout batch of N = B·G sequences; the prompt part is left-padded to P tokens."""

    input_ids: torch.Tensor  # [N, P+T]
    attention_mask: torch.Tensor  # [N, P+T]
    completion_ids: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T] float, 0 after EOS (and for truncated completions when masked)
    advantages: torch.Tensor  # [N]
    old_logp: torch.Tensor | None  # [N, T], None when num_iterations == 1 (ratio exactly 1)
    ref_logp: torch.Tensor | None  # [N, T], None when beta == 0
    metrics: dict[str, float]


@dataclass
class Samples:
    """What one batched `generate` returns, the prompts repeated once per completion (N = prompts × G)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T], pad after EOS
    completion_mask: torch.Tensor  # [N, T] float, 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool, no EOS within max_completion_length


@dataclass
class TrainResult:
    model: Any  # the peft model, adapter enabled
    tokenizer: Any
    records: list[dict[str, Any]]  # one per step, as in metrics.jsonl
    output_dir: Path
    adapter_dir: Path
    plot_path: Path | None = None


# ----------------------------------------------------------------------------------------------------------------
# Model


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
    kwargs = {"logits_to_keep": length + 1} if _accepts_logits_to_keep(model) else {}
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **kwargs
    ).logits  # [n, T+1 or P+T, V]
    return logits[:, -length - 1 : -1]


def micro_batches(n: int, cfg: TrainConfig) -> list[slice]:
    """The rollout batch of n sequences cut into `gradient_accumulation_steps` micro-batches."""
    size = math.ceil(n / cfg.gradient_accumulation_steps)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _accepts_logits_to_keep(model: Any) -> bool:
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


# ----------------------------------------------------------------------------------------------------------------
# Rollouts


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: TrainConfig,
    *,
    greedy: bool = False,
) -> Samples:
    """One batched `generate` for every prompt × G (× 1 with `greedy`, for evaluation)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    g = 1 if greedy else cfg.num_generations
    enc = tokenizer(
        prompts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=cfg.max_prompt_length,
        add_special_tokens=not (cfg.chat_template and getattr(tokenizer, "chat_template", None)),
    )
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    eos = eos_token_ids(model, tokenizer)
    gen_cfg = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else cfg.temperature,
        top_p=None if greedy else cfg.top_p,
        top_k=None if greedy else cfg.top_k,
        max_new_tokens=cfg.max_completion_length,
        num_return_sequences=g,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        bos_token_id=tokenizer.bos_token_id,
        # Explicit neutral values: transformers fills the fields left None from the model's generation_config, and
        # any other warper would make the sampler differ from softmax(logits / temperature), the loss' policy.
        repetition_penalty=1.0,
        typical_p=1.0,
        no_repeat_ngram_size=0,
        use_cache=True,
    )
    was_training = model.training
    model.eval()  # no dropout while sampling
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg)
    model.train(was_training)
    prompt_len = prompt_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=device))
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = (torch.arange(completion_ids.shape[1], device=device)[None] <= first_eos[:, None]).float()
    return Samples(
        prompt_ids.repeat_interleave(g, 0),
        prompt_mask.repeat_interleave(g, 0),
        completion_ids,
        completion_mask,
        ~is_eos.any(1),
    )


def decode_completions(tokenizer: Any, samples: Samples) -> list[str]:
    """The completions' text, up to their EOS."""
    lengths = samples.completion_mask.sum(1).long().tolist()
    ids = [row[:n] for row, n in zip(samples.completion_ids.tolist(), lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def rollout(
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    cfg: TrainConfig,
    reward_funcs: list[RewardFunc],
    weights: list[float],
) -> Rollout:
    system = resolve_system_prompt(cfg.system_prompt)
    prompts = [render_prompt(tokenizer, row["prompt"], system, use_chat_template=cfg.chat_template) for row in rows]
    g = cfg.num_generations
    t0 = time.perf_counter()
    samples = generate(model, tokenizer, prompts, cfg)
    gen_time = time.perf_counter() - t0
    completion_ids, completion_mask, truncated = samples.completion_ids, samples.completion_mask, samples.truncated
    num_tokens = completion_mask.sum(1)  # [N]
    completions = decode_completions(tokenizer, samples)

    columns = columns_for(rows, g)
    total, per_func = combine_rewards(
        reward_funcs, completions, weights, prompts=[p for p in prompts for _ in range(g)], **columns
    )
    rewards = torch.tensor(total, dtype=torch.float32)  # [N]
    advantages = group_advantages(rewards, g, scale=cfg.scale_rewards).to(completion_ids.device)

    loss_mask = completion_mask.clone()
    if cfg.mask_truncated_completions:
        loss_mask[truncated] = 0.0
    input_ids = torch.cat([samples.prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([samples.prompt_mask, completion_mask.long()], 1)
    old_logp = ref_logp = None
    if cfg.num_iterations > 1:  # μ > 1: the ratio is against the sampling policy
        old_logp = per_token_logp(model, input_ids, attention_mask, completion_ids, cfg)
    if cfg.beta != 0.0:
        with model.disable_adapter():  # the reference policy: the frozen base weights
            ref_logp = per_token_logp(model, input_ids, attention_mask, completion_ids, cfg)

    grouped = rewards.view(-1, g)
    metrics = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "frac_reward_zero_std": (grouped.std(1) == 0).float().mean().item() if g > 1 else 1.0,
        "completions/mean_length": num_tokens.mean().item(),
        "completions/min_length": num_tokens.min().item(),
        "completions/max_length": num_tokens.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "tokens_per_s": num_tokens.sum().item() / max(gen_time, 1e-9),
        "time/generate_s": gen_time,
    }
    for func, values in zip(reward_funcs, per_func):
        v = torch.tensor(values)
        applicable = v[~v.isnan()]
        name = reward_name(func)
        metrics[f"rewards/{name}/mean"] = applicable.mean().item() if applicable.numel() else math.nan
        metrics[f"rewards/{name}/std"] = applicable.std().item() if applicable.numel() > 1 else 0.0
        if name == "accuracy":
            metrics["accuracy"] = metrics[f"rewards/{name}/mean"]
    return Rollout(input_ids, attention_mask, completion_ids, loss_mask, advantages, old_logp, ref_logp, metrics)


# ----------------------------------------------------------------------------------------------------------------
# Policy update


def policy_update(
    model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, roll: Rollout, cfg: TrainConfig
) -> dict[str, float]:
    """`num_iterations` optimizer steps on one rollout batch, each accumulated over its micro-batches."""
    n, length = roll.completion_ids.shape
    chunks = micro_batches(n, cfg)
    token_sum = cfg.loss_type in TOKEN_SUM_LOSSES
    options = cfg.loss_options()  # temperature and max_completion_length included: sampling and loss share them
    num_items = roll.completion_mask.sum().item()
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    losses, grad_norms = [], []
    model.train()
    for _ in range(cfg.num_iterations):
        step_loss = 0.0
        for sl in chunks:
            logits = completion_logits(model, roll.input_ids[sl], roll.attention_mask[sl], length)  # [n, T, V] view
            out = grpo_loss(
                logits,
                roll.completion_ids[sl],
                roll.advantages[sl],
                roll.completion_mask[sl],
                None if roll.old_logp is None else roll.old_logp[sl],
                None if roll.ref_logp is None else roll.ref_logp[sl],
                num_items_in_batch=num_items,
                backend=cfg.backend,
                **options,
            )
            loss = out.loss if token_sum else out.loss / len(chunks)
            loss.backward()
            step_loss += loss.item()
            w = roll.completion_mask[sl].sum().item()
            for key, value in out.metrics.items():
                sums[key] += float(value) * w
                weights[key] += w
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        grad_norms.append(norm.item())
    metrics = {k: sums[k] / max(weights[k], 1.0) for k in sums}
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["learning_rate"] = scheduler.get_last_lr()[0]
    return metrics


def make_optimizer(model: Any, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, Any]:
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    total = cfg.max_steps * cfg.num_iterations
    if cfg.lr_scheduler == "cosine":
        scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total)
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)
    return optimizer, scheduler


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    rows: list[dict[str, Any]] | None = None,
    reward_funcs: list[RewardFunc] | None = None,
) -> TrainResult:
    """Train a LoRA adapter with GRPO. `model`/`tokenizer`/`rows`/`reward_funcs` override what `cfg` names
    (a model folder or hub id, a dataset, reward function names); the model gets a fresh LoRA adapter."""
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        return _train(cfg, model, tokenizer, rows, reward_funcs)
    finally:
        torch.set_num_threads(threads)  # a library call leaves the process's thread count as it found it


def _train(
    cfg: TrainConfig,
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]] | None,
    reward_funcs: list[RewardFunc] | None,
) -> TrainResult:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    torch.manual_seed(cfg.seed)
    device, dtype = resolve_device(cfg)
    rows = rows_from_config(cfg) if rows is None else rows  # data and rewards first: they fail fast and cheaply
    reward_funcs = get_reward_funcs(cfg.reward_funcs) if reward_funcs is None else reward_funcs
    weights = cfg.weights(len(reward_funcs))
    if model is None:
        model, tokenizer = load_model(cfg.model, dtype=dtype)
    elif tokenizer is None:
        raise ValueError("a tokenizer must come with the model")
    tokenizer = prepare_tokenizer(tokenizer)

    model = add_lora(model.to(device), cfg)
    model.train()  # from_pretrained returns eval mode; old/ref log-probs and updates all see the same mode
    optimizer, scheduler = make_optimizer(model, cfg)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    remove_partial_checkpoints(out_dir)
    start = 0
    if cfg.resume and (ckpt := latest_checkpoint(out_dir)) is not None:
        start = load_checkpoint(ckpt, model, optimizer, scheduler)
    records = _read_records(
        metrics_path, upto=start
    )  # a resumed run drops what the killed one logged past its checkpoint
    _write_records(metrics_path, records)

    columns = [
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, disable=not cfg.progress, transient=False) as progress, open(metrics_path, "a") as log:
        task = progress.add_task("", total=cfg.max_steps, completed=start)
        for step in range(start, cfg.max_steps):
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            batch = [rows[i] for i in prompt_indices(step, cfg.prompts_per_step, len(rows), cfg.seed)]
            roll = rollout(model, tokenizer, batch, cfg, reward_funcs, weights)
            update = policy_update(model, optimizer, scheduler, roll, cfg)
            record = {
                "step": step + 1,
                **roll.metrics,
                **update,
                "time/step_s": time.perf_counter() - t0,
                "peak_memory_mb": peak_memory_mb(device),
            }
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            desc = f"reward {record['reward']:.3f}"
            if "accuracy" in record:
                desc += f"  acc {record['accuracy']:.2f}"
            if "kl" in record:
                desc += f"  kl {record['kl']:.4f}"
            progress.update(task, advance=1, description=desc)
            if (cfg.save_steps and (step + 1) % cfg.save_steps == 0) or step + 1 == cfg.max_steps:
                save_checkpoint(
                    out_dir, step + 1, model, optimizer, scheduler, cfg.to_dict(), keep=cfg.save_total_limit
                )

    adapter_dir = out_dir / "adapter"
    model.save_pretrained(adapter_dir, safe_serialization=True)
    plot_path = None
    if cfg.plot and records:
        plot_path = Path(plot_metrics(records, out_dir / "training_curves.png"))
    return TrainResult(model, tokenizer, records, out_dir, adapter_dir, plot_path)


def _read_records(path: Path, upto: int) -> list[dict[str, Any]]:
    return [r for r in read_metrics(path) if r["step"] <= upto] if path.exists() else []


def _write_records(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
