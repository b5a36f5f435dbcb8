"""The GRPO loop on `grpo_loss`, in the manner of nanoGPT's train.py: read `train` and `_loop` from the top; setup,
`train_step` and log-and-save follow them, in that order.

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
from .data import TrainData, load_data, load_reward_funcs, prompt_indices, rendered_prompts, rows_data
from .dist import World, all_reduce_, barrier, init_distributed, max_over_ranks, rank_device, together, wrap_ddp
from .model import (
    add_lora,
    check_context,
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
    world = init_distributed(device)
    try:
        run = _setup(cfg, model, tokenizer, rows, reward_funcs, world)
        return _loop(run, evaluate, eval_every)
    finally:
        torch.set_num_threads(threads)  # a library call leaves the process's thread count as it found it
        if world.owns_group:
            dist.destroy_process_group()


def _loop(run: Run, evaluate: Evaluator | None, eval_every: int) -> TrainResult:
    cfg, world = run.cfg, run.world
    last_ckpt = latest_checkpoint(run.out_dir) if run.start else None
    flat_steps, warned, stopped, signum = 0, False, False, 0
    with contextlib.ExitStack() as stack:
        # Ctrl-C or SIGTERM: stop after the step in progress
        request = stack.enter_context(stop_after_step(cfg.max_steps, run.start + 1, enabled=world.main))
        stack.enter_context(run.progress)
        logs = _open_logs(stack, run)
        for step in range(run.start, cfg.max_steps):
            request.step = step + 1
            record, roll = train_step(run, step)
            run.records.append(record)
            last = step + 1 == cfg.max_steps
            signum = max_over_ranks(request.signum or 0, world)  # a signal to any rank: this step is the last
            stopped = not last and signum > 0
            request.step = step + 1 if stopped or last else step + 2  # the step a signal from now on stops after
            samples = []
            if cfg.log_completions and ((step + 1) % cfg.logging_steps == 0 or last or stopped):
                samples = completion_records(step + 1, roll, cfg.log_completions, cfg.num_generations, world)
            flat_steps = flat_steps + 1 if record["frac_reward_zero_std"] == 1.0 else 0
            warn = 0 < cfg.zero_variance_warning_steps == flat_steps and not warned  # 0: never
            warned = warned or warn
            save = bool(cfg.save_steps and (step + 1) % cfg.save_steps == 0) or last or stopped
            with together(world):  # rank 0 writes; a full disk stops every rank
                if world.main:
                    if evaluate is not None and eval_every and ((step + 1) % eval_every == 0 or last):
                        record |= {f"eval/{k}": v for k, v in evaluate(run.model, run.tokenizer).items()}
                    warn_after = flat_steps if warn else None
                    last_ckpt = _log_and_save(run, logs, record, samples, warn_after, save) or last_ckpt
            if stopped:
                break
    return _finish(run, stopped, signum, last_ckpt)


# ----------------------------------------------------------------------------------------------------------------
# Setup: the inputs, the policy and its optimizer, the resumed state


@dataclass
class Run:
    """What every step of a run works with, made once by `_setup`."""

    cfg: TrainConfig
    world: World
    device: torch.device
    out_dir: Path
    data: TrainData
    reward_weights: list[float]  # one per reward function of `data`
    model: Any  # the peft model: sampling, old/ref log-probs and saving use it
    trained: Any  # what the policy update runs: the DistributedDataParallel wrapper when multi-process, else `model`
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Progress
    start: int  # the step to start from: 0, or the resumed checkpoint's
    records: list[dict[str, Any]]  # one per step done, as in metrics.jsonl; the loop appends each step's
    unscored_noted: bool = False  # the note that some completions got no reward has been shown (it is shown once)


def _setup(
    cfg: TrainConfig,
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]] | None,
    reward_funcs: list[RewardFunc] | None,
    world: World,
) -> Run:
    torch.manual_seed(cfg.seed)  # the same on every rank: the same LoRA initialization everywhere
    device, dtype = resolve_device(cfg)
    device = rank_device(device, world)
    out_dir = Path(cfg.output_dir)
    data, reward_weights = _load_inputs(cfg, rows, reward_funcs, world, out_dir)
    with together(world):
        if model is None:
            model, tokenizer = load_model(cfg.model, dtype=dtype)
        elif tokenizer is None:
            raise ValueError("a tokenizer must come with the model")
        tokenizer = prepare_tokenizer(tokenizer)
        check_context(model, tokenizer, rendered_prompts(tokenizer, data, cfg), cfg)
        model = add_lora(model.to(device), cfg)
        model.train()  # from_pretrained returns eval mode; old/ref log-probs and updates all see the same mode
        optimizer = make_optimizer(model, cfg)
        progress = Progress(cfg.max_steps, 0, bar=cfg.progress, every=cfg.logging_steps, enabled=world.main)
        start, scheduler = resume_or_start(cfg, out_dir, model, optimizer, progress.note)  # the same on every rank
        progress.done = start
        records, logged = _logs_up_to(out_dir, start, progress)
    trained = wrap_ddp(model, device, world)  # after the checkpoint is loaded: DDP broadcasts rank 0's parameters
    barrier(world)  # every rank has read the checkpoint and the records before rank 0 rewrites them
    with together(world):
        if world.main:
            write_records(out_dir / METRICS_FILE, records)
            if logged is not None or cfg.log_completions:
                write_records(out_dir / COMPLETIONS_FILE, logged or [])
    return Run(
        cfg, world, device, out_dir, data, reward_weights, model, trained, tokenizer, optimizer, scheduler, progress,
        start, records,
    )  # fmt: skip


def _load_inputs(
    cfg: TrainConfig,
    rows: list[dict[str, Any]] | None,
    reward_funcs: list[RewardFunc] | None,
    world: World,
    out_dir: Path,
) -> tuple[TrainData, list[float]]:
    """The data and the reward weights, with the output folder made ready: what the user's input can make fail is
    tried first, before the model loads. Under torchrun an error on any rank stops every rank, with its one message
    (`together`)."""
    with together(world):
        if cfg.prompts_per_step % world.size:
            raise ValueError(
                f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the number of processes "
                f"({world.size}): each rank trains on an equal share of every step's prompts"
            )
        micro_batches(cfg.prompts_per_step // world.size * cfg.num_generations, cfg)  # its error, by name
        reward_funcs = load_reward_funcs(cfg.reward_funcs) if reward_funcs is None else reward_funcs
        reward_weights = cfg.parsed_reward_weights(len(reward_funcs))
        if world.main:  # rank 0 builds the datasets cache entry first; building it together races
            data = load_data(cfg, reward_funcs) if rows is None else rows_data(cfg, rows, reward_funcs)
            prepare_output_dir(out_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    with together(world):
        if not world.main:
            data = load_data(cfg, reward_funcs) if rows is None else rows_data(cfg, rows, reward_funcs)
    return data, reward_weights


def _logs_up_to(
    out_dir: Path, start: int, progress: Progress
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The metrics and the completions records of the steps up to `start`: a resumed run drops what was logged past
    its checkpoint (a torn last line is dropped with a note). The completions are None when their log held none."""
    records, torn = read_records_repairing(out_dir / METRICS_FILE)
    logged, torn_log = read_records_repairing(out_dir / COMPLETIONS_FILE)
    for note in (torn, torn_log):
        if note:
            progress.note(note)
    kept = [r for r in logged if r["step"] <= start] if logged else None
    return [r for r in records if r["step"] <= start], kept


# ----------------------------------------------------------------------------------------------------------------
# One step


def train_step(run: Run, step: int) -> tuple[dict[str, Any], Rollout]:
    """Step `step` (from 0) on this rank: sample and score its share of the step's prompts, then update the policy.
    Returns the step's record (as metrics.jsonl has it) and its rollout batch (for the completions log)."""
    cfg, world = run.cfg, run.world
    t0 = time.perf_counter()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    # this rank's contiguous share of the step's prompts, each with its seeds for its G completions
    local_prompts = cfg.prompts_per_step // world.size
    first = world.rank * local_prompts
    indices = prompt_indices(step, cfg.prompts_per_step, len(run.data.rows), cfg.seed)
    batch = [run.data.rows[i] for i in indices[first : first + local_prompts]]
    seeds = [
        sample_seed(cfg.seed, step, first + i, j) for i in range(local_prompts) for j in range(cfg.num_generations)
    ]
    roll = rollout(
        run.model, run.tokenizer, batch, cfg, run.data.reward_funcs, run.reward_weights,
        seeds=seeds, world=world, columns=run.data.columns,
    )  # fmt: skip
    update = policy_update(run.trained, run.optimizer, run.scheduler, roll, cfg, world)
    record = {
        "step": step + 1,
        **roll.metrics,
        **update,
        "time/step_s": time.perf_counter() - t0,
        "peak_memory_mb": peak_memory_mb(run.device),
    }
    return record, roll


# ----------------------------------------------------------------------------------------------------------------
# Log and save: rank 0 alone writes


@dataclass
class _Logs:
    metrics: JsonLog | None = None  # rank 0's metrics.jsonl
    completions: JsonLog | None = None  # rank 0's completions.jsonl, with --log-completions


def _open_logs(stack: contextlib.ExitStack, run: Run) -> _Logs:
    logs = _Logs()
    with together(run.world):
        if run.world.main:
            logs.metrics = stack.enter_context(JsonLog(run.out_dir / METRICS_FILE))
            if run.cfg.log_completions:
                logs.completions = stack.enter_context(JsonLog(run.out_dir / COMPLETIONS_FILE))
    return logs


def _log_and_save(
    run: Run, logs: _Logs, record: dict[str, Any], samples: list[dict[str, Any]], warn_after: int | None, save: bool
) -> Path | None:
    """Rank 0's end of a step: append its record and completions, show them, warn that the last `warn_after` steps
    had no learning signal (None: no warning now), and save a checkpoint when `save`. Returns the checkpoint saved."""
    cfg, step = run.cfg, record["step"]
    logs.metrics.append([record])
    if samples:
        logs.completions.append(samples)
    run.progress.step(record)
    run.progress.show(console_lines(samples))
    if record.get("frac_reward_none") and not run.unscored_noted:
        run.unscored_noted = True
        run.progress.note(
            f"step {step}: {record['frac_reward_none']:.0%} of the completions got no value from any reward (each "
            "returned None or NaN); they count 0, as in TRL (frac_reward_none in metrics.jsonl, noted once)"
        )
    if warn_after is not None:
        run.progress.note(zero_variance_warning(warn_after, cfg, record, _completions_hint(cfg, run.out_dir)))
    if not save:
        return None
    with storage(run.out_dir / f"checkpoint-{step}"):
        return save_checkpoint(
            run.out_dir, step, run.model, run.optimizer, run.scheduler, cfg.to_dict(), keep=cfg.save_total_limit
        )


def _completions_hint(cfg: TrainConfig, out_dir: Path) -> str:
    if cfg.log_completions:
        return str(out_dir / COMPLETIONS_FILE)
    return f"{COMPLETIONS_FILE} (pass --log-completions N to write it)"


def _finish(run: Run, stopped: bool, signum: int, last_ckpt: Path | None) -> TrainResult:
    """The adapter and the plot of a run that ran to its end (not of one stopped by a signal), and the result."""
    adapter_dir, plot_path = run.out_dir / ADAPTER_DIR, None
    with together(run.world):  # on every rank, train returns once the adapter is written
        if run.world.main and not stopped:
            save_adapter(run.model, run.out_dir)
            if run.cfg.plot and run.records:
                plot_path = save_plot(run.records, run.out_dir)
    signal = signum if stopped else None
    return TrainResult(
        run.model, run.tokenizer, run.records, run.out_dir, adapter_dir, plot_path, stopped, last_ckpt, signal
    )


# ----------------------------------------------------------------------------------------------------------------
# Policy update


def policy_update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    roll: Rollout,
    cfg: TrainConfig,
    world: World | None = None,
) -> dict[str, float]:
    """`num_iterations` optimizer steps on one rollout batch, each accumulated over its micro-batches
    (`accumulate_gradients`)."""
    world = world or World()
    params = [p for p in model.parameters() if p.requires_grad]
    # each metric's token-weighted sum over the micro-batches, and the sum of their weights
    sums: dict[str, float] = defaultdict(float)
    tokens: dict[str, float] = defaultdict(float)
    losses, grad_norms = [], []
    model.train()
    for _ in range(cfg.num_iterations):
        step_loss = accumulate_gradients(model, roll, cfg, world, sums, tokens)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if world.multi_process:  # the ranks' losses average to the whole batch's, as their gradients do
            step_loss = all_reduce_(torch.tensor(step_loss, dtype=torch.float64), world).item() / world.size
        losses.append(step_loss)
        grad_norms.append(norm.item())
    metrics = {k: sums[k] / max(tokens[k], 1.0) for k in sums}
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["learning_rate"] = scheduler.get_last_lr()[0]
    return metrics


def accumulate_gradients(
    model: Any,
    roll: Rollout,
    cfg: TrainConfig,
    world: World,
    sums: dict[str, float] | None = None,
    tokens: dict[str, float] | None = None,
) -> float:
    """The gradient of the whole rollout batch's loss, accumulated over its micro-batches into the parameters'
    `.grad`; returns that loss. Whatever the split (even uneven micro-batches), the gradient is the unsplit
    batch's: each micro-batch's loss is weighted by its share of the batch (`micro_batch_share`). The entropy
    bonus and the top-entropy quantile stay per micro-batch, as in TRL. `sums` and `tokens` gather each metric's
    token-weighted sum and its weight.

    Under torchrun `model` is the DistributedDataParallel wrapper (`wrap_ddp`): each rank holds an equal share of the
    batch's sequences, and the last micro-batch's backward all-reduces the gradients and averages them over the
    ranks (the others run under `no_sync`); the losses are normalized so that the average is the whole batch's
    gradient: the sequence-mean losses average over (equally many) sequences per rank, bnpo over the rank's tokens,
    and the token-sum losses divide by the token count of all ranks over the world size (`num_items_in_batch`,
    `dapo_normalizer`)."""
    sums = defaultdict(float) if sums is None else sums
    tokens = defaultdict(float) if tokens is None else tokens
    chunks = micro_batches(roll.completion_ids.shape[0], cfg)
    num_items = all_reduce_(roll.completion_mask.sum().double().cpu(), world).item()  # tokens of all ranks
    step_loss = 0.0
    for i, sl in enumerate(chunks):
        # DDP: the micro-batches accumulate locally under no_sync; the last one's backward all-reduces the sum,
        # one gradient all-reduce per optimizer step
        sync = i == len(chunks) - 1 or not isinstance(model, DistributedDataParallel)
        with contextlib.nullcontext() if sync else model.no_sync():
            share = micro_batch_share(roll.completion_mask, sl, cfg.loss.loss_type)
            loss, metrics, w = _micro_batch_loss(model, roll, sl, num_items, share, cfg, world)
        step_loss += loss
        for key, value in metrics.items():
            sums[key] += value * w
            tokens[key] += w
    return step_loss


def micro_batch_share(mask: torch.Tensor, sl: slice, loss_type: str) -> float:
    """The factor of micro-batch `sl`'s loss such that the micro-batches' losses add up to the whole batch's (of
    this rank): 1 for the token-count losses (normalized by the whole batch's tokens, `num_items_in_batch`), the
    micro-batch's share of the active tokens for bnpo (normalized by its own tokens), its share of the sequences for
    the others (a mean over its sequences)."""
    if loss_type in TOKEN_COUNT_LOSS_TYPES:
        return 1.0
    if loss_type == "bnpo":
        return mask[sl].sum().item() / max(mask.sum().item(), 1.0)
    return (sl.stop - sl.start) / mask.shape[0]


def _micro_batch_loss(
    model: Any,
    roll: Rollout,
    sl: slice,
    num_items: float,
    share: float,
    cfg: TrainConfig,
    world: World,
) -> tuple[float, dict[str, float], float]:
    """Forward and backward of one micro-batch, its loss weighted by `share` (`micro_batch_share`): (that loss, its
    metrics, their weight: its tokens on every rank)."""
    length = roll.completion_ids.shape[1]
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
    loss = out.loss * share
    loss.backward()
    # The metrics are already means over this micro-batch of every rank, so they weigh by its tokens on every rank
    w = all_reduce_(roll.completion_mask[sl].sum().double(), world).item()
    metrics = {key: float(value) for key, value in out.metrics.items()}
    return loss.item(), metrics, w
