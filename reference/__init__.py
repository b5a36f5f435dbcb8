"""The one pure-PyTorch float64 oracle of the GRPO loss family (docs/loss.md); tests and benchmarks import it."""

from reference.grpo import (
    ReferenceOutput,
    reference_group_advantages,
    reference_grpo_loss,
    reference_selective_log_softmax,
)

__all__ = [
    "ReferenceOutput",
    "reference_group_advantages",
    "reference_grpo_loss",
    "reference_selective_log_softmax",
]
