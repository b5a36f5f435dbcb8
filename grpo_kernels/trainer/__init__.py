"""A thin LoRA GRPO trainer on `grpo_loss`: config, data, the loop, checkpoints, the plot, and the CPU demo."""

from .config import TrainConfig
from .loop import TrainResult, train
from .model import load_model

__all__ = ["TrainConfig", "TrainResult", "load_model", "train"]
