"""The GRPO loop on `grpo_loss`, in the manner of nanoGPT's train.py: read `train` from the top.

Each step: sample G completions for each of B prompts from the LoRA policy, score them with the reward functions,
normalize the rewards within each group, then take `num_iterations` optimizer steps on the clipped objective with a
KL penalty to the reference policy, which is the same base model with the adapter disabled (no second copy).
Processes, sampling, the model and the output folder have modules of their own (dist, sampling, model, rundir).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import grpo_loss
from ..config import TOKEN_COUNT_LOSS_TYPES
from ..rewards import RewardFunc
from .checkpoint import latest_checkpoint, save_checkpoint
from .completions import completion_records, console_lines
from .config import TrainConfig
from .data import load_data, load_reward_funcs, prompt_indices, rows_data
from .dist import Dist, all_reduce_, barrier, init_distributed, max_over_ranks, rank_device, together, wrap_ddp
from .model import (
    add_lora,
    completion_logits,
    load_model,
    make_optimizer,
    micro_batches,
    peak_memory_mb,
    prepare_tokenizer,
    resolve_device,
)
from .preempt import stop_after_step
from .progress import Progress, zero_variance_warning
from .resume import resume_or_start
from .rollout import Rollout, rollout
from .rundir import (
    ADAPTER_DIR,
    COMPLETIONS_FILE,
    METRICS_FILE,
    JsonLog,
    prepare_output_dir,
    read_records_repairing,
    save_adapter,
    save_plot,
    storage,
    write_records,
)
from .sampling import sample_seed

Evaluator = Callable[[Any, Any], dict[str, float]]  # (model, tokenizer) -> metrics, logged as eval/<name>


@dataclass
class TrainResult:
    model: Any  # the peft model, adapter enabled
    tokenizer: Any
    records: list[dict[str, Any]]  # one per step, as in metrics.jsonl
    output_dir: Path
    adapter_dir: Path  # written when the run finished (not when interrupted)
    plot_path: Path | None = None
    interrupted: bool = False  # stopped by Ctrl-C or SIGTERM after the step in progress
    last_checkpoint: Path | None = None
    signal: int | None = None  # the signal that stopped the run, when interrupted


# ----------------------------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    rows: list[dict[str, Any]] | None = None,
    reward_funcs: list[RewardFunc] | None = None,
    evaluate: Evaluator | None = None,
    eval_every: int = 0,
) -> TrainResult:
    """Train a LoRA adapter with GRPO. `model`/`tokenizer`/`rows`/`reward_funcs` override what `cfg` names
    (a model folder or hub id, a dataset, reward function names); the model gets a fresh LoRA adapter.
    `evaluate(model, tokenizer)`, when given, runs on rank 0 every `eval_every` steps and after the last; its
    metrics are logged as `eval/<name>`.

    Under `torchrun --nproc_per_node N` (WORLD_SIZE > 1) the run is data-parallel: each rank samples and trains on
    prompts_per_step / N prompts of every step (each with its whole group of G completions), the policy update runs
    through DistributedDataParallel (the LoRA gradients averaged over the ranks), and only rank 0 writes metrics,
    checkpoints, the adapter and the plot. `accelerate launch --multi_gpu --num_processes N` sets the same variables.
    Completions are sampled from per-completion seeds, so N processes train the same adapter as one (up to float
    reduction order). An error on any rank (a bad row, a reward that fails, a full disk) stops every rank.

    Ctrl-C or SIGTERM stops after the step in progress, with a checkpoint of it (`TrainResult.interrupted`);
    a second one stops at once. Every row of the data is checked before the model loads."""
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device, _ = resolve_device(cfg)
    ctx = init_distributed(device)
    try:
        return _train(cfg, model, tokenizer, rows, reward_funcs, evaluate, eval_every, ctx)
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
    evaluate: Evaluator | None,
    eval_every: int,
    ctx: Dist,
) -> TrainResult:
    torch.manual_seed(cfg.seed)  # the same on every rank: the same LoRA initialization everywhere
    device, dtype = resolve_device(cfg)
    device = rank_device(device, ctx)
    out_dir = Path(cfg.output_dir)
    # What the user's input can make fail is tried first, before the model loads: the rewards, every row of the data,
    # the output folder. Under torchrun an error on any rank stops every rank, with its one message (`together`).
    with together(ctx):
        if cfg.prompts_per_step % ctx.world:
            raise ValueError(
                f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the number of processes "
                f"({ctx.world}): each rank trains on an equal share of every step's prompts"
            )
        reward_funcs = load_reward_funcs(cfg.reward_funcs) if reward_funcs is None else reward_funcs
        weights = cfg.weights(len(reward_funcs))
        if ctx.main:  # rank 0 builds the datasets cache entry first; building it together races
            data = load_data(cfg, reward_funcs) if rows is None else rows_data(cfg, rows, reward_funcs)
            prepare_output_dir(out_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    with together(ctx):
        if not ctx.main:
            data = load_data(cfg, reward_funcs) if rows is None else rows_data(cfg, rows, reward_funcs)
    local_prompts = cfg.prompts_per_step // ctx.world

    with together(ctx):
        if model is None:
            model, tokenizer = load_model(cfg.model, dtype=dtype)
        elif tokenizer is None:
            raise ValueError("a tokenizer must come with the model")
        tokenizer = prepare_tokenizer(tokenizer)
        model = add_lora(model.to(device), cfg)
        model.train()  # from_pretrained returns eval mode; old/ref log-probs and updates all see the same mode
        optimizer = make_optimizer(model, cfg)
        progress = Progress(cfg.max_steps, 0, bar=cfg.progress, every=cfg.logging_steps, enabled=ctx.main)
        start, scheduler = resume_or_start(cfg, out_dir, model, optimizer, progress.note)  # the same on every rank
        progress.done = start
        # a resumed run drops what was logged past its checkpoint
        records, torn = read_records_repairing(out_dir / METRICS_FILE)
        records = [r for r in records if r["step"] <= start]
        logged, torn_log = read_records_repairing(out_dir / COMPLETIONS_FILE)
        for note in (torn, torn_log):
            if note:
                progress.note(note)
    trained = wrap_ddp(model, device, ctx)  # after the checkpoint is loaded: DDP broadcasts rank 0's parameters
    barrier(ctx)  # every rank has read the checkpoint and the records before rank 0 rewrites them
    with together(ctx):
        if ctx.main:
            write_records(out_dir / METRICS_FILE, records)
            if logged or cfg.log_completions:
                write_records(out_dir / COMPLETIONS_FILE, [r for r in logged if r["step"] <= start])

    last_ckpt = latest_checkpoint(out_dir) if start else None
    flat_steps, warned, stopped, signum = 0, False, False, 0
    with contextlib.ExitStack() as stack:
        request = stack.enter_context(stop_after_step(cfg.max_steps, start + 1, enabled=ctx.main))  # Ctrl-C, SIGTERM
        stack.enter_context(progress)
        with together(ctx):
            if ctx.main:
                metrics_log = stack.enter_context(JsonLog(out_dir / METRICS_FILE))
                if cfg.log_completions:
                    completions_log = stack.enter_context(JsonLog(out_dir / COMPLETIONS_FILE))
        for step in range(start, cfg.max_steps):
            request.step = step + 1
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # this rank's contiguous share of the step's prompts, each with its seeds for its G completions
            first = ctx.rank * local_prompts
            indices = prompt_indices(step, cfg.prompts_per_step, len(data.rows), cfg.seed)
            batch = [data.rows[i] for i in indices[first : first + local_prompts]]
            seeds = [
                sample_seed(cfg.seed, step, first + i, j)
                for i in range(local_prompts)
                for j in range(cfg.num_generations)
            ]
            roll = rollout(
                model, tokenizer, batch, cfg, data.reward_funcs, weights, seeds=seeds, ctx=ctx, columns=data.columns
            )
            update = policy_update(trained, optimizer, scheduler, roll, cfg, ctx)
            record = {
                "step": step + 1,
                **roll.metrics,
                **update,
                "time/step_s": time.perf_counter() - t0,
                "peak_memory_mb": peak_memory_mb(device),
            }
            records.append(record)
            last = step + 1 == cfg.max_steps
            signum = max_over_ranks(request.signum or 0, ctx)  # a signal to any rank: this step is the last
            stopped = not last and signum > 0
            request.step = step + 1 if stopped or last else step + 2  # the step a signal from now on stops after
            logging = (step + 1) % cfg.logging_steps == 0 or last or stopped
            samples = []
            if logging and cfg.log_completions:
                samples = completion_records(step + 1, roll, cfg.log_completions, cfg.num_generations, ctx)
            flat_steps = flat_steps + 1 if record["frac_reward_zero_std"] == 1.0 else 0
            with together(ctx):  # rank 0 writes; a full disk stops every rank
                if ctx.main:
                    if evaluate is not None and eval_every and ((step + 1) % eval_every == 0 or last):
                        record |= {f"eval/{k}": v for k, v in evaluate(model, tokenizer).items()}
                    metrics_log.append([record])
                    if samples:
                        completions_log.append(samples)
                    progress.step(record)
                    progress.show(console_lines(samples))
                    if flat_steps == cfg.zero_variance_warning_steps and not warned:
                        progress.note(zero_variance_warning(flat_steps, cfg, record, _completions_hint(cfg, out_dir)))
                        warned = True
                    if (cfg.save_steps and (step + 1) % cfg.save_steps == 0) or last or stopped:
                        with storage(out_dir / f"checkpoint-{step + 1}"):
                            last_ckpt = save_checkpoint(
                                out_dir, step + 1, model, optimizer, scheduler, cfg.to_dict(), keep=cfg.save_total_limit
                            )
            if stopped:
                break

    adapter_dir, plot_path = out_dir / ADAPTER_DIR, None
    with together(ctx):  # on every rank, train returns once the adapter is written
        if ctx.main and not stopped:
            save_adapter(model, out_dir)
            if cfg.plot and records:
                plot_path = save_plot(records, out_dir)
    signal = signum if stopped else None
    return TrainResult(model, tokenizer, records, out_dir, adapter_dir, plot_path, stopped, last_ckpt, signal)


def _completions_hint(cfg: TrainConfig, out_dir: Path) -> str:
    if cfg.log_completions:
        return str(out_dir / COMPLETIONS_FILE)
    return f"{COMPLETIONS_FILE} (pass --log-completions N to write it)"


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
    # token-count losses are normalized by the whole rollout batch's tokens (num_items_in_batch): their micro-batch
    # losses add up; the others average per micro-batch and are divided by the number of micro-batches
    loss = out.loss if cfg.loss.loss_type in TOKEN_COUNT_LOSS_TYPES else out.loss / num_chunks
    loss.backward()
    # The metrics are already means over this micro-batch of every rank, so they weigh by its tokens on every rank
    w = all_reduce_(roll.completion_mask[sl].sum().double(), ctx).item()
    for key, value in out.metrics.items():
        sums[key] += float(value) * w
        weights[key] += w
    return loss.item()
