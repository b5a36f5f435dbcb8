"""One rollout batch: sample G completions per prompt, score them, group-normalize the rewards, and compute the old
and reference log-probs the loss needs (the reference is the model with its adapter disabled)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import group_advantages
from ..rewards import RewardError, RewardFunc, combine_rewards, reward_label, reward_name
from .config import TrainConfig
from .data import render_prompt, resolve_system_prompt, reward_columns
from .dist import World, all_reduce_, gather_cat, together
from .model import per_token_logp
from .rowcheck import Columns
from .sampling import decode_completions, generate


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
    # for the completions log: this rank's prompts (as the dataset has them) and completion texts, and of the whole
    # batch (every rank's, in rank order) the total reward, each reward's values (NaN: not applicable), advantages
    prompts: list[Any]  # [B_local]
    texts: list[str]  # [N]
    rewards: torch.Tensor  # [N_all]
    reward_values: dict[str, torch.Tensor]  # name -> [N_all]
    all_advantages: torch.Tensor  # [N_all]


def rollout(
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    cfg: TrainConfig,
    reward_funcs: list[RewardFunc],
    reward_weights: list[float],
    *,
    seeds: list[int] | None = None,
    world: World | None = None,
    columns: Columns | None = None,
) -> Rollout:
    """Sample, score and prepare one rollout batch. Under torchrun `rows` is this rank's shard of the step's prompts
    (whole groups, equal shards in rank order): the rewards are gathered so that the advantages (any `scale_rewards`)
    and the logged metrics are those of the whole batch; the returned tensors are this rank's part."""
    world, columns = world or World(), columns or Columns()
    system = resolve_system_prompt(cfg.system_prompt)
    questions = [row[columns.prompt] for row in rows]
    prompts = [render_prompt(tokenizer, q, system, use_chat_template=cfg.chat_template) for q in questions]
    t0 = time.perf_counter()
    samples = generate(model, tokenizer, prompts, cfg, seeds=seeds)
    gen_time = time.perf_counter() - t0
    completions = decode_completions(tokenizer, samples)
    scores = score(completions, rows, prompts, cfg, reward_funcs, reward_weights, world, columns)
    local_n = len(completions)
    advantages = scores.advantages[world.rank * local_n : (world.rank + 1) * local_n]

    loss_mask = samples.completion_mask.clone()
    if cfg.mask_truncated_completions:
        loss_mask[samples.truncated] = 0.0
    input_ids = torch.cat([samples.prompt_ids, samples.completion_ids], 1)
    attention_mask = torch.cat([samples.prompt_mask, samples.completion_mask.long()], 1)
    old_logp, ref_logp = policy_logps(model, input_ids, attention_mask, samples.completion_ids, cfg)
    metrics = scores.metrics | sampling_metrics(samples, gen_time, world)
    return Rollout(
        input_ids, attention_mask, samples.completion_ids, loss_mask, advantages.to(input_ids.device), old_logp,
        ref_logp, metrics, questions, completions, scores.rewards, scores.values, scores.advantages,
    )  # fmt: skip


@dataclass
class Scores:
    """The rewards of the whole batch (every rank's, in rank order), its advantages and reward metrics."""

    rewards: torch.Tensor  # [N_all] the weighted sum of the rewards that apply
    values: dict[str, torch.Tensor]  # name -> [N_all], NaN where the reward does not apply
    advantages: torch.Tensor  # [N_all]
    metrics: dict[str, float | None]


def score(
    completions: list[str],
    rows: list[dict[str, Any]],
    prompts: list[str],
    cfg: TrainConfig,
    reward_funcs: list[RewardFunc],
    reward_weights: list[float],
    world: World,
    columns: Columns,
) -> Scores:
    """Score this rank's completions with every reward, gather the whole batch's, and normalize them in groups.

    A reward returns None (or NaN) where it does not apply; a completion that no reward applies to counts 0, as in
    TRL, and is counted (`frac_reward_none`). When no reward applies to any completion of the batch there is nothing
    to learn from: a `RewardError` names the rewards."""
    g = cfg.num_generations
    kwargs = reward_columns(rows, columns, g)
    with together(world):  # a reward that fails on one rank stops every rank, with its message
        total, per_func = combine_rewards(
            reward_funcs, completions, reward_weights, prompts=[p for p in prompts for _ in range(g)], **kwargs
        )
    rewards = gather_cat(torch.tensor(total, dtype=torch.float32), world)  # [N] of the whole batch
    values = {
        reward_name(f): gather_cat(torch.tensor(v, dtype=torch.float32), world) for f, v in zip(reward_funcs, per_func)
    }
    none = torch.stack(list(values.values())).isnan().all(0)  # [N_all]: no reward applies
    if none.all():
        labels = ", ".join(reward_label(f) for f in reward_funcs)
        raise RewardError(
            f"no reward gave a value for any of the {none.numel()} completions of this step: {labels} returned None "
            "or NaN for every one (None means 'does not apply'; a reward that always fails to score leaves nothing "
            "to learn from)"
        )
    grouped = rewards.view(-1, g)
    metrics: dict[str, float | None] = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "frac_reward_zero_std": (grouped.std(1) == 0).float().mean().item() if g > 1 else 1.0,
        "frac_reward_none": none.float().mean().item(),
    }
    for name, v in values.items():
        applicable = v[~v.isnan()]
        metrics[f"rewards/{name}/mean"] = applicable.mean().item() if applicable.numel() else None  # JSON null
        metrics[f"rewards/{name}/std"] = applicable.std().item() if applicable.numel() > 1 else 0.0
    if "accuracy" in values:
        metrics["accuracy"] = metrics["rewards/accuracy/mean"]
    return Scores(rewards, values, group_advantages(rewards, g, scale=cfg.scale_rewards), metrics)


def policy_logps(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_ids: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The old policy's log-probs (μ > 1: the ratio is against the sampling policy; else None, a ratio of 1) and the
    reference's (the frozen base weights, the adapter disabled; None when β = 0)."""
    old_logp = ref_logp = None
    if cfg.num_iterations > 1:
        old_logp = per_token_logp(model, input_ids, attention_mask, completion_ids, cfg)
    if cfg.loss.beta != 0.0:
        with model.disable_adapter():
            ref_logp = per_token_logp(model, input_ids, attention_mask, completion_ids, cfg)
    return old_logp, ref_logp


def sampling_metrics(samples: Any, gen_time: float, world: World) -> dict[str, float]:
    """The completions' lengths, truncation and sampling speed, over every rank."""
    num_tokens = gather_cat(samples.completion_mask.sum(1).float().cpu(), world)
    truncated = gather_cat(samples.truncated.cpu(), world)
    gen_time = all_reduce_(torch.tensor(gen_time, dtype=torch.float64), world, dist.ReduceOp.MAX).item()
    return {
        "completions/mean_length": num_tokens.mean().item(),
        "completions/min_length": num_tokens.min().item(),
        "completions/max_length": num_tokens.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "tokens_per_s": num_tokens.sum().item() / max(gen_time, 1e-9),
        "time/generate_s": gen_time,
    }
