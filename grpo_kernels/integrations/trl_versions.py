"""What each range of TRL releases' `GRPOTrainer._compute_loss` does, in the terms the drop-in needs.

`_compute_loss` itself (loss types, options, normalizers, metric names) is the same text in every release from 1.12.0
through 1.16.0; the releases differ in how the policy's forward runs around it (explicit autocast, the fp32 lm_head,
`logits_to_keep`) and in what `use_liger_kernel` does. One `TRLMapping` per range records that; the drop-in reads the
mapping of the running TRL and nothing else about the version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..config import CLIPPED_LOSS_TYPES, IS_LEVELS, LOSS_TYPES

# Accept a TRL newer than the tested range (with a warning and the first-step self-check)
UNTESTED_ENV = "GRPO_KERNELS_TRL_UNTESTED"
TESTED_RANGE = ">=1.12.0,<1.17.0"


@dataclass(frozen=True)
class TRLMapping:
    """One range of TRL releases, as `fused_compute_loss` reproduces their `GRPOTrainer._compute_loss`."""

    versions: str  # a PEP 440 specifier
    loss_types: tuple[str, ...] = LOSS_TYPES
    importance_sampling_levels: tuple[str, ...] = IS_LEVELS
    # normalized by num_items_in_batch over the generation batch (TRL's `["cispo", "dapo", "vespo"]` branch)
    token_count_losses: tuple[str, ...] = ("cispo", "dapo", "vespo")
    clipped_losses: tuple[str, ...] = CLIPPED_LOSS_TYPES  # log clip_ratio/{low,high,region}_mean, low_min, high_max
    # metric name -> the loss types that log it, beside `entropy` (always), `kl` (beta != 0), `policy_loss` and
    # `entropy_coef` (entropy bonus on), `aux_loss` (MoE)
    loss_type_metrics: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("clip_ratio/low_mean", CLIPPED_LOSS_TYPES),
        ("clip_ratio/high_mean", CLIPPED_LOSS_TYPES),
        ("clip_ratio/region_mean", CLIPPED_LOSS_TYPES),
        ("cispo_clip_ratio", ("cispo",)),
        ("vespo/phi_seq_mean", ("vespo",)),
    )
    # `_get_per_token_logps_and_entropies` wraps the policy forward in `accelerator.autocast()` itself (1.15+); before,
    # the forward runs under whatever autocast the caller (accelerate's prepared model) has on
    forward_in_autocast: bool = True
    # cast_lm_head_to_fp32: the fp32 head runs outside autocast (TRL's fused head, 1.15+); before, TRL's fp32
    # `F.linear` head runs under the caller's autocast like any other linear
    fp32_head_outside_autocast: bool = True
    # `logits_to_keep` is passed only to a model whose forward accepts it (`self.model_kwarg_keys`, before 1.15)
    logits_to_keep_if_accepted: bool = False
    # options this range has that the drop-in can't reproduce: (field of the trainer's args, why), refused when set
    refused: tuple[tuple[str, str], ...] = ()

    def metric_names(self, loss_type: str) -> tuple[str, ...]:
        return tuple(name for name, losses in self.loss_type_metrics if loss_type in losses)


_NEWEST = TRLMapping(versions=">=1.15.0,<1.17.0")
MAPPINGS: tuple[TRLMapping, ...] = (
    dataclasses.replace(
        _NEWEST,
        versions=">=1.12.0,<1.14.0",
        forward_in_autocast=False,
        fp32_head_outside_autocast=False,
        logits_to_keep_if_accepted=True,
        refused=(
            (
                "use_liger_kernel",
                (
                    "this TRL computes the whole loss with Liger's LigerFusedLinearGRPOLoss in `compute_loss`, before "
                    "`_compute_loss` is reached, so the fused loss would never run"
                ),
            ),
        ),
    ),
    dataclasses.replace(
        _NEWEST,
        versions=">=1.14.0,<1.15.0",
        forward_in_autocast=False,
        fp32_head_outside_autocast=False,
        logits_to_keep_if_accepted=True,
        refused=(
            (
                "use_liger_kernel",
                (
                    "this TRL scores the tokens from the backbone's hidden states with its own chunked projection, "
                    "outside the model's forward, which the fused loss does not reproduce"
                ),
            ),
        ),
    ),
    _NEWEST,  # use_liger_kernel applies Liger's layer kernels only, inside the model's forward: honoured as is
)


def untested_allowed(argument: bool | None = None) -> bool:
    """The constructor argument when given, else the GRPO_KERNELS_TRL_UNTESTED environment variable."""
    if argument is not None:
        return bool(argument)
    return os.environ.get(UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def mapping_for(version: str, *, allow_untested: bool = False) -> tuple[TRLMapping, bool]:
    """(the mapping of TRL `version`, whether that version is tested).

    A release newer than the tested range gets the newest mapping when `allow_untested` is set (with a warning;
    the caller then runs the first-step self-check); anything else outside the range raises a RuntimeError.
    """
    found = Version(version)
    public = Version(found.public)
    for mapping in MAPPINGS:
        if SpecifierSet(mapping.versions).contains(public, prereleases=True):
            return mapping, True
    newest = MAPPINGS[-1]
    if allow_untested and public >= Version("1.17.0.dev0"):
        warnings.warn(
            f"grpo_kernels.integrations.trl is tested with trl{TESTED_RANGE}; running trl {version} with the mapping "
            f"of trl{newest.versions}. The first training step computes TRL's own loss beside the fused one and "
            "stops with a report if the loss, a gradient or a metric differs (one extra forward and backward, once).",
            stacklevel=3,
        )
        return newest, False
    hint = (
        f"; to try a newer release, set {UNTESTED_ENV}=1 or pass trl_untested=True, which checks the first "
        "training step against TRL's own loss"
        if public >= Version("1.17.0.dev0")
        else ""
    )
    raise RuntimeError(
        f"grpo_kernels.integrations.trl supports trl{TESTED_RANGE}, found trl {version}. The fused loss reproduces "
        "each supported release's GRPOTrainer._compute_loss, so another release could train with a silently "
        f"different loss. Install a supported one with `pip install 'grpo-kernels[trl]'`{hint}."
    )


def check_options(trainer: Any, mapping: TRLMapping, version: str) -> None:
    """Refuse, by name, an option `trainer` has set that this TRL release lacks or that the drop-in can't reproduce."""
    if trainer.loss_type not in mapping.loss_types:
        raise ValueError(
            f"loss_type={trainer.loss_type!r}: TRL {version}'s GRPOTrainer has no such loss type; it has "
            f"{', '.join(mapping.loss_types)}"
        )
    if trainer.importance_sampling_level not in mapping.importance_sampling_levels:
        raise ValueError(
            f"importance_sampling_level={trainer.importance_sampling_level!r}: TRL {version}'s GRPOTrainer has "
            f"{' and '.join(mapping.importance_sampling_levels)}"
        )
    for name, why in mapping.refused:
        value = getattr(trainer.args, name, None)
        if value:
            raise ValueError(
                f"{name}={value!r} is not supported by the fused loss with TRL {version}: {why}. Set {name}=False, "
                "or train with TRL's own GRPOTrainer."
            )


def forward_context(self: Any, mapping: TRLMapping) -> contextlib.AbstractContextManager:
    """The autocast TRL's `_get_per_token_logps_and_entropies` puts around the policy forward (none before 1.15)."""
    return self.accelerator.autocast() if mapping.forward_in_autocast else contextlib.nullcontext()


def logits_to_keep(self: Any, mapping: TRLMapping, length: int) -> dict[str, int]:
    """`logits_to_keep=T+1`, unless this TRL passes it only to models that accept it and this one doesn't."""
    if mapping.logits_to_keep_if_accepted and "logits_to_keep" not in getattr(self, "model_kwarg_keys", ()):
        return {}
    return {"logits_to_keep": length + 1}


__all__ = [
    "MAPPINGS",
    "TESTED_RANGE",
    "UNTESTED_ENV",
    "TRLMapping",
    "check_options",
    "forward_context",
    "logits_to_keep",
    "mapping_for",
    "untested_allowed",
]
