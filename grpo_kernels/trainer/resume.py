"""Where a run starts: step 0 with a new schedule, or the newest complete checkpoint, after checking that the
configuration still computes the same run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .checkpoint import latest_checkpoint, load_checkpoint, saved_config
from .config import HARMLESS_FIELDS, SCHEDULE_FIELDS, TrainConfig
from .model import make_scheduler


def resume_or_start(
    cfg: TrainConfig, out_dir: Path, model: Any, optimizer: torch.optim.Optimizer, say: Callable[[str], None]
) -> tuple[int, Any]:
    """The step to start from and the LR schedule: step 0 and a new schedule, or with `resume` the newest complete
    checkpoint's step and states. A checkpoint whose configuration differs in anything but `HARMLESS_FIELDS` is
    refused unless `allow_config_change`, which continues with the new values and rebuilds the schedule."""
    ckpt = latest_checkpoint(out_dir) if cfg.resume else None
    if ckpt is None:
        say(f"starting fresh in {out_dir}" + (" (--resume: no complete checkpoint there)" if cfg.resume else ""))
        return 0, make_scheduler(optimizer, cfg)
    changes = {k: v for k, v in cfg.changes_from(saved_config(ckpt)).items() if k not in HARMLESS_FIELDS}
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    if changes and not cfg.allow_config_change:
        raise ValueError(
            f"the configuration differs from that of {ckpt} in what the run computes: {listed}. Resume with the "
            "checkpoint's values, or pass --allow-config-change to continue with the new ones"
        )
    rebuild = any(k in SCHEDULE_FIELDS for k in changes)
    scheduler = None if rebuild else make_scheduler(optimizer, cfg)
    start = load_checkpoint(ckpt, model, optimizer, scheduler)
    say(f"resuming from {ckpt} (step {start} of {cfg.max_steps})")
    if changes:
        say(f"configuration changed since {ckpt.name}: {listed}; continuing with the new values")
    if rebuild:
        scheduler = make_scheduler(optimizer, cfg, done=start * cfg.num_iterations)
        say(
            f"LR schedule rebuilt for {cfg.max_steps} steps: {cfg.lr_scheduler}, learning rate now "
            f"{scheduler.get_last_lr()[0]:.3g}"
        )
    return start, scheduler
