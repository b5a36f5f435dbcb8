"""A thin LoRA GRPO trainer on `grpo_loss`: config, data, the loop, checkpoints, the plot, and the CPU demo."""

from ..extras import TRAIN_MODULES, require

require("train", TRAIN_MODULES, "grpo_kernels.trainer")

from .config import TrainConfig  # noqa: E402 (after the check of the extra)
from .loop import TrainResult, train  # noqa: E402
from .model import load_model  # noqa: E402

__all__ = ["TrainConfig", "TrainResult", "load_model", "train"]
