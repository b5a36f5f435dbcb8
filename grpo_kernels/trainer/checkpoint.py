"""Atomic checkpoints: the LoRA adapter (safetensors), optimizer, scheduler, RNG states, config and step.

A checkpoint is written into a hidden temporary folder, its completion marker last, and renamed into place, so a
run killed at any instant (SIGKILL included) leaves either the whole `checkpoint-<step>` or none of it. Pruning
renames a checkpoint to a hidden name before deleting it, so a half-deleted one never looks complete. Only a
folder with its marker counts; `--resume` takes the newest such one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
STATE_FILE = "trainer_state.pt"
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "train_config.json"
COMPLETE_MARKER = "checkpoint_complete"  # written last: a checkpoint without it does not count
TMP_PREFIXES = (".tmp-", ".deleting-")  # what a save or a deletion writes before renaming it into place


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: dict[str, Any],
    *,
    keep: int = 2,
) -> Path:
    """Write `output_dir/checkpoint-<step>` atomically and keep only the newest `keep` checkpoints (0: keep all)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{step}-", dir=output_dir))
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # peft: adapter_model.safetensors + adapter_config.json
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
        fsync_tree(tmp)  # every file is on disk before the marker says so
        (tmp / COMPLETE_MARKER).write_text(f"{step}\n")
        fsync_tree(tmp)
        if final.exists():  # only when a run re-saves a step it already saved
            remove_checkpoint(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep:
        for old in list_checkpoints(output_dir)[:-keep]:
            remove_checkpoint(old)
    return final


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint so that no instant leaves it looking complete: rename it to a hidden name, then delete."""
    doomed = folder.with_name(f"{TMP_PREFIXES[1]}{folder.name}")
    shutil.rmtree(doomed, ignore_errors=True)  # left by a deletion that was itself interrupted
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (with their marker), oldest first; temporaries are hidden folders and never match."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in output_dir.iterdir()
        if (m := CHECKPOINT_NAME.fullmatch(p.name)) and p.is_dir() and is_complete(p)
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_adapter(model: Any, folder: str | os.PathLike) -> None:
    """Load the adapter weights saved in `folder` into a peft model in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(Path(folder) / ADAPTER_FILE, device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"checkpoint {folder} does not fit this model: unexpected adapter keys {unexpected[:4]}...")


def saved_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The training configuration a checkpoint was written with (`TrainConfig.to_dict()`)."""
    return json.loads((Path(folder) / CONFIG_FILE).read_text())


def load_checkpoint(
    folder: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None
) -> int:
    """Restore adapter, optimizer, scheduler (unless None: the caller rebuilds it) and RNG states from `folder`;
    returns the step to continue from."""
    folder = Path(folder)
    load_adapter(model, folder)
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])
