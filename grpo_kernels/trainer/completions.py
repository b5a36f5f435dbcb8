"""What the model wrote: at every logging step, `--log-completions N` completions of the batch go to
completions.jsonl with their prompt, each reward's value and their advantage, and the console shows two of them.

The N are taken one per prompt first (the first completion of every prompt, then the second, ...), so that they
show N different prompts when there are that many, the same ones whichever number of processes sampled them.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from .dist import World
from .rollout import Rollout


def chosen(num_prompts: int, group_size: int, n: int) -> list[int]:
    """Indices into a batch of `num_prompts` groups of `group_size` completions (prompt-major): one per prompt first."""
    order = [p * group_size + j for j in range(group_size) for p in range(num_prompts)]
    return order[:n]


def completion_records(step: int, roll: Rollout, n: int, group_size: int, world: World) -> list[dict[str, Any]]:
    """The records of step `step` (the same on every rank; every rank must call this, it gathers the texts)."""
    total = roll.rewards.numel()
    local = len(roll.texts)
    first = world.rank * local
    mine = {
        i: (roll.prompts[(i - first) // group_size], roll.texts[i - first])
        for i in chosen(total // group_size, group_size, n)
        if first <= i < first + local
    }
    if world.multi_process:
        parts: list[Any] = [None] * world.size
        dist.all_gather_object(parts, mine)
        mine = {k: v for part in parts for k, v in part.items()}
    records = []
    for i in chosen(total // group_size, group_size, n):
        prompt, text = mine[i]
        rewards = {name: _value(v[i].item()) for name, v in roll.reward_values.items()}  # float32, as trained on
        records.append(
            {
                "step": step,
                "prompt": prompt,
                "completion": text,
                "rewards": rewards,
                "reward": round(roll.rewards[i].item(), 6),
                "advantage": round(roll.all_advantages[i].item(), 6),
            }
        )
    return records


def _value(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 6)


def console_lines(records: list[dict[str, Any]], width: int = 160) -> list[str]:
    """One line each for the best and the worst of `records` by reward (one line when they are the same)."""
    if not records:
        return []
    best = max(records, key=lambda r: r["reward"])
    worst = min(records, key=lambda r: r["reward"])
    lines = []
    for record in [best] if best is worst else [best, worst]:
        parts = ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in record["rewards"].items())
        head = f"  reward {record['reward']:.2f} ({parts}), advantage {record['advantage']:+.2f}: "
        prompt = record["prompt"] if isinstance(record["prompt"], str) else record["prompt"][-1].get("content", "")
        line = head + f"{str(prompt)!r} -> {record['completion']!r}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return lines
