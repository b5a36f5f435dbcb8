"""The GRPO loop on `grpo_loss`, one readable function in the manner of nanoGPT's train.py.

Each step: sample G completions for each of B prompts from the LoRA policy, score them with the reward functions,
normalize the rewards within each group, then take `num_iterations` optimizer steps on the clipped objective with a
KL penalty to the reference policy, which is the same base model with the adapter disabled (no second copy).
"""

from __future__ import annotations

import contextlib
import hashlib
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
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import group_advantages, grpo_loss, selective_log_softmax
from ..distributed import comm_device
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
# Processes (torchrun)


@dataclass
class Dist:
    """This process's place in a data-parallel run: rank 0 of 1 when single-process."""

    rank: int = 0
    world: int = 1
    owns_group: bool = False  # this run called init_process_group, so it also tears it down

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed(device: torch.device) -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA); else a single process.
    A group someone else initialized (the caller of `train`) is used as it is and left alone."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), owns_group=True)


def gather_cat(x: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """The ranks' equally shaped tensors concatenated along dim 0 in rank order (x itself when single-process)."""
    if not ctx.active:
        return x
    y = x.contiguous().to(comm_device(None, x.device))
    parts = [torch.empty_like(y) for _ in range(ctx.world)]
    dist.all_gather(parts, y)
    return torch.cat(parts).to(x.device)


def all_reduce_(x: torch.Tensor, ctx: Dist, op: Any = None) -> torch.Tensor:
    """x reduced over the ranks (sum unless `op`), in place where the backend allows; x when single-process."""
    if not ctx.active:
        return x
    y = x.to(comm_device(None, x.device))
    dist.all_reduce(y, op=dist.ReduceOp.SUM if op is None else op)
    return y.to(x.device)


def wrap_ddp(model: Any, device: torch.device, ctx: Dist) -> Any:
    """The model that the policy update runs: a DistributedDataParallel wrapper when multi-process, else the model
    itself. Sampling, old/ref log-probs and saving keep using the unwrapped model.

    DDP's construction broadcasts rank 0's parameters and buffers, the frozen base weights included (a one-time
    copy of the model), so every rank starts from the same adapter whatever its own initialization or checkpoint
    did; its reducer then all-reduces and averages the trainable, LoRA, gradients only."""
    if not ctx.active:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def sample_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """The seed of completion `generation` of prompt `prompt` (its place in the step's global batch) at `step`:
    a pure function, so a completion is the same whichever rank, batch or resumed run samples it."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SeededSampler:
    """A logits processor that samples each row with its own seeded torch.Generator and returns scores whose argmax
    is the sampled token (`generate` runs greedy around it). Temperature, top-k and top-p are transformers' own
    warpers, so the distribution is exactly the one `do_sample=True` samples from; only the randomness differs:
    row i draws from `seeds[i]` alone, never from the global RNG, so batching and sharding leave it unchanged."""

    def __init__(self, seeds: list[int], cfg: TrainConfig, device: torch.device) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(cfg.temperature)]
        if cfg.top_k:
            self.warpers.append(TopKLogitsWarper(cfg.top_k))
        if cfg.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(cfg.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"SeededSampler has {len(self.generators)} seeds for {scores.shape[0]} rows")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        out = torch.full_like(scores, -math.inf)
        out.scatter_(1, tokens[:, None], 0.0)
        return out


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
    kwargs = {"logits_to_keep": length + 1} if _accepts_logits_to_keep(getattr(model, "module", model)) else {}
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
    seeds: list[int] | None = None,
) -> Samples:
    """One batched `generate` for every prompt × G (× 1 with `greedy`, for evaluation). With `seeds` (one per
    completion, prompt-major), completion i is sampled from its own generator seeded with seeds[i] (`SeededSampler`)
    instead of the global RNG."""
    from transformers import GenerationConfig, LogitsProcessorList

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
    seeded = seeds is not None and not greedy
    if seeded and len(seeds) != len(prompts) * g:
        raise ValueError(f"generate needs {len(prompts) * g} seeds (prompts x G), got {len(seeds)}")
    sample = not greedy and not seeded  # seeded sampling runs greedy over SeededSampler's scores
    if seeded:  # greedy search returns one sequence per input: the prompts are repeated here instead
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
    gen_cfg = GenerationConfig(
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=cfg.top_k if sample else None,
        max_new_tokens=cfg.max_completion_length,
        num_return_sequences=1 if seeded else g,
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
    processors = LogitsProcessorList([SeededSampler(seeds, cfg, device)] if seeded else [])
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg, logits_processor=processors
    )
    model.train(was_training)
    prompt_len = prompt_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=device))
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = (torch.arange(completion_ids.shape[1], device=device)[None] <= first_eos[:, None]).float()
    return Samples(
        prompt_ids if seeded else prompt_ids.repeat_interleave(g, 0),
        prompt_mask if seeded else prompt_mask.repeat_interleave(g, 0),
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
    *,
    seeds: list[int] | None = None,
    ctx: Dist | None = None,
) -> Rollout:
    """Sample, score and prepare one rollout batch. Under torchrun `rows` is this rank's shard of the step's prompts
    (whole groups, equal shards in rank order): the rewards are gathered so that the advantages (any `scale_rewards`)
    and the logged metrics are those of the whole batch; the returned tensors are this rank's part."""
    ctx = ctx or Dist()
    system = resolve_system_prompt(cfg.system_prompt)
    prompts = [render_prompt(tokenizer, row["prompt"], system, use_chat_template=cfg.chat_template) for row in rows]
    g = cfg.num_generations
    t0 = time.perf_counter()
    samples = generate(model, tokenizer, prompts, cfg, seeds=seeds)
    gen_time = time.perf_counter() - t0
    completion_ids, completion_mask, truncated = samples.completion_ids, samples.completion_mask, samples.truncated
    num_tokens = completion_mask.sum(1)  # [N]
    completions = decode_completions(tokenizer, samples)

    columns = columns_for(rows, g)
    total, per_func = combine_rewards(
        reward_funcs, completions, weights, prompts=[p for p in prompts for _ in range(g)], **columns
    )
    local_n = len(total)
    rewards = gather_cat(torch.tensor(total, dtype=torch.float32), ctx)  # [N] of the whole batch
    advantages = group_advantages(rewards, g, scale=cfg.scale_rewards)
    advantages = advantages[ctx.rank * local_n : (ctx.rank + 1) * local_n].to(completion_ids.device)

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
    num_tokens = gather_cat(num_tokens.float().cpu(), ctx)
    truncated = gather_cat(truncated.cpu(), ctx)
    gen_time = all_reduce_(torch.tensor(gen_time, dtype=torch.float64), ctx, dist.ReduceOp.MAX).item()
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
        v = gather_cat(torch.tensor(values, dtype=torch.float32), ctx)
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
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    roll: Rollout,
    cfg: TrainConfig,
    ctx: Dist | None = None,
) -> dict[str, float]:
    """`num_iterations` optimizer steps on one rollout batch, each accumulated over its micro-batches.

    Under torchrun `model` is the DistributedDataParallel wrapper (`wrap_ddp`): each rank holds an equal share of the
    batch's sequences, and the last micro-batch's backward of each optimizer step all-reduces the gradients and
    averages them over the ranks (the others run under `no_sync`); the losses are normalized so that the average is
    the whole batch's gradient:
    grpo/sapo/dr_grpo/luspo average over (equally many) sequences per rank, and the token-sum losses divide by
    the token count of all ranks over the world size (`num_items_in_batch` below, `dapo_normalizer`)."""
    ctx = ctx or Dist()
    n, length = roll.completion_ids.shape
    chunks = micro_batches(n, cfg)
    num_items = all_reduce_(roll.completion_mask.sum().double().cpu(), ctx).item()  # tokens of all ranks
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    losses, grad_norms = [], []
    model.train()
    for _ in range(cfg.num_iterations):
        step_loss = 0.0
        for i, sl in enumerate(chunks):
            # DDP: the micro-batches accumulate locally under no_sync; the last one's backward all-reduces the sum,
            # one gradient all-reduce per optimizer step
            sync = i == len(chunks) - 1 or not isinstance(model, DistributedDataParallel)
            with contextlib.nullcontext() if sync else model.no_sync():
                step_loss += _micro_batch_loss(model, roll, sl, length, num_items, len(chunks), cfg, sums, weights, ctx)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.active:  # the ranks' losses average to the whole batch's, as their gradients do
            step_loss = all_reduce_(torch.tensor(step_loss, dtype=torch.float64), ctx).item() / ctx.world
        losses.append(step_loss)
        grad_norms.append(norm.item())
    metrics = {k: sums[k] / max(weights[k], 1.0) for k in sums}
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["learning_rate"] = scheduler.get_last_lr()[0]
    return metrics


def _micro_batch_loss(
    model: Any,
    roll: Rollout,
    sl: slice,
    length: int,
    num_items: float,
    num_chunks: int,
    cfg: TrainConfig,
    sums: dict[str, float],
    weights: dict[str, float],
    ctx: Dist,
) -> float:
    """Forward and backward of one micro-batch; adds its token-weighted metrics to `sums`/`weights`."""
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
        **cfg.loss_options(),  # temperature and max_completion_length included: sampling and loss share them
    )
    loss = out.loss if cfg.loss_type in TOKEN_SUM_LOSSES else out.loss / num_chunks
    loss.backward()
    # The metrics are already means over this micro-batch of every rank, so they weigh by its tokens on every rank
    w = all_reduce_(roll.completion_mask[sl].sum().double(), ctx).item()
    for key, value in out.metrics.items():
        sums[key] += float(value) * w
        weights[key] += w
    return loss.item()


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
    (a model folder or hub id, a dataset, reward function names); the model gets a fresh LoRA adapter.

    Under `torchrun --nproc_per_node N` (WORLD_SIZE > 1) the run is data-parallel: each rank samples and trains on
    prompts_per_step / N prompts of every step (each with its whole group of G completions), the policy update runs
    through DistributedDataParallel (the LoRA gradients averaged over the ranks), and only rank 0 writes metrics,
    checkpoints, the adapter and the plot. `accelerate launch --multi_gpu --num_processes N` sets the same variables.
    Completions are sampled from per-completion seeds, so N processes train the same adapter as one (up to float
    reduction order)."""
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device, _ = resolve_device(cfg)
    ctx = init_distributed(device)
    try:
        return _train(cfg, model, tokenizer, rows, reward_funcs, ctx)
    finally:
        torch.set_num_threads(threads)  # a library call leaves the process's thread count as it found it
        if ctx.owns_group:
            dist.destroy_process_group()


def _train(
    cfg: TrainConfig,
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]] | None,
    reward_funcs: list[RewardFunc] | None,
    ctx: Dist,
) -> TrainResult:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if cfg.prompts_per_step % ctx.world:
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} must be divisible by the number of processes ({ctx.world}): "
            "each rank trains on an equal share of every step's prompts"
        )
    local_prompts = cfg.prompts_per_step // ctx.world
    torch.manual_seed(cfg.seed)  # the same on every rank: the same LoRA initialization everywhere
    device, dtype = resolve_device(cfg)
    if ctx.active and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", ctx.rank % torch.cuda.device_count())))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rows is None:  # data and rewards first: they fail fast and cheaply
        if ctx.active and not ctx.main:
            dist.barrier()  # rank 0 builds the datasets cache entry first; building it together races
        rows = rows_from_config(cfg)
        if ctx.active and ctx.main:
            dist.barrier()
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
    metrics_path = out_dir / "metrics.jsonl"
    if ctx.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(out_dir)
    start = 0
    if cfg.resume and (ckpt := latest_checkpoint(out_dir)) is not None:  # every rank loads the same checkpoint
        start = load_checkpoint(ckpt, model, optimizer, scheduler)
    records = _read_records(metrics_path, upto=start)  # a resumed run drops what was logged past its checkpoint
    trained = wrap_ddp(model, device, ctx)  # after the checkpoint is loaded: DDP broadcasts rank 0's parameters
    if ctx.active:
        dist.barrier()  # every rank has read the checkpoint and the records before rank 0 rewrites them
    if ctx.main:
        _write_records(metrics_path, records)

    columns = [
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    log = open(metrics_path, "a") if ctx.main else contextlib.nullcontext()  # noqa: SIM115
    with Progress(*columns, disable=not (cfg.progress and ctx.main), transient=False) as progress, log:
        task = progress.add_task("", total=cfg.max_steps, completed=start)
        for step in range(start, cfg.max_steps):
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # this rank's contiguous share of the step's prompts, each with its seeds for its G completions
            first = ctx.rank * local_prompts
            indices = prompt_indices(step, cfg.prompts_per_step, len(rows), cfg.seed)[first : first + local_prompts]
            batch = [rows[i] for i in indices]
            seeds = [
                sample_seed(cfg.seed, step, first + i, j)
                for i in range(local_prompts)
                for j in range(cfg.num_generations)
            ]
            roll = rollout(model, tokenizer, batch, cfg, reward_funcs, weights, seeds=seeds, ctx=ctx)
            update = policy_update(trained, optimizer, scheduler, roll, cfg, ctx)
            record = {
                "step": step + 1,
                **roll.metrics,
                **update,
                "time/step_s": time.perf_counter() - t0,
                "peak_memory_mb": peak_memory_mb(device),
            }
            records.append(record)
            if not ctx.main:
                continue
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
    plot_path = None
    if ctx.main:
        model.save_pretrained(adapter_dir, safe_serialization=True)
        if cfg.plot and records:
            plot_path = Path(plot_metrics(records, out_dir / "training_curves.png"))
    if ctx.active:
        dist.barrier()  # on every rank, train returns once the adapter is written
    return TrainResult(model, tokenizer, records, out_dir, adapter_dir, plot_path)


def _read_records(path: Path, upto: int) -> list[dict[str, Any]]:
    return [r for r in read_metrics(path) if r["step"] <= upto] if path.exists() else []


def _write_records(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
