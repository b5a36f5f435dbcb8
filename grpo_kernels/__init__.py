"""grpo-kernels: the GRPO loss family from logits in one read, exact next to a float64 oracle."""

from .advantages import group_advantages
from .api import GRPOLoss, GRPOOutput, grpo_loss, selective_log_softmax
from .config import LOSS_TYPES, LossConfig
from .fused_linear import fused_linear_grpo_loss, fused_linear_log_softmax

__all__ = [
    "LOSS_TYPES",
    "GRPOLoss",
    "GRPOOutput",
    "LossConfig",
    "fused_linear_grpo_loss",
    "fused_linear_log_softmax",
    "group_advantages",
    "grpo_loss",
    "selective_log_softmax",
]
__version__ = "0.1.0"
