"""The frozen option set of the GRPO loss family, validated once at the public boundary.

`make_config` turns a call's options into one `LossConfig`; everything below the public functions trusts it. The
loss-type families are defined here and nowhere else. What each option means: docs/loss.md (TRL 1.16 semantics).
"""

from __future__ import annotations

import ast
import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import Any

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # -min(r A, clip(r) A)
# Normalized by the (global) active-token count N over the world size P: Σ m L / (max(N, 1) / P).
TOKEN_COUNT_LOSS_TYPES = ("dapo", "cispo", "vespo")
# Whose per-token loss the one-read fused kernel can form in registers (no sequence-level quantity).
FUSED_LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo")
IS_LEVELS = ("token", "sequence")
BACKENDS = ("auto", "triton", "torch")
LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38


def _check_finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


# TRL 1.16 GRPOConfig's defaults where ours differ (docs/loss.md, "Defaults that differ from TRL"); every other
# option has TRL's name and default. tests/test_validation.py holds this table to TRL's GRPOConfig.
TRL_DEFAULTS_THAT_DIFFER: dict[str, object] = {
    "loss_type": "dapo",  # ours: "grpo"
    "use_bias_correction_kl": True,  # ours: False
    "max_completion_length": 512,  # ours: None, the logits' T (only dr_grpo's normalizer reads it)
}
# TRL's names for our options where the two differ: accepted as keyword options, translated.
TRL_NAMES = {"epsilon": "epsilon_low"}


@dataclass(frozen=True)
class LossConfig:
    """Scalar options of `grpo_loss`, under TRL 1.16 GRPOConfig's names (its `epsilon` is `epsilon_low` here, and
    accepted as a keyword option); the defaults are TRL's but for the three in `TRL_DEFAULTS_THAT_DIFFER`
    (loss_type "grpo", not TRL's "dapo"; use_bias_correction_kl False; max_completion_length None).
    docs/loss.md says what each option does.

    Constructing one validates it (TypeError/ValueError naming the option); the instance is frozen and trusted by
    every layer below the public functions.
    """

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: equal to epsilon_low, as in TRL
    delta: float | None = None
    temperature: float = 1.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    max_completion_length: int | None = None
    num_items_in_batch: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    check_inputs: bool = False  # raise on non-finite unmasked inputs (one host sync; an O(B·T·V) pass of the logits)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IS_LEVELS}, got {self.importance_sampling_level!r}"
            )
        for name in (
            "beta",
            "epsilon_low",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
            "top_entropy_quantile",
            "entropy_coef",
        ):
            object.__setattr__(self, name, _check_finite_number(name, getattr(self, name)))
        for name in ("epsilon_high", "delta", "off_policy_mask_threshold", "num_items_in_batch"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _check_finite_number(name, getattr(self, name)))
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        temperature = _check_finite_number("temperature", self.temperature)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if LOG2E / temperature > FLOAT32_MAX:  # the kernels scale by log2(e)/τ in fp32
            raise ValueError(
                f"temperature must be >= {LOG2E / FLOAT32_MAX:.3g} so that 1/temperature is finite in float32, "
                f"got {temperature}"
            )
        object.__setattr__(self, "temperature", temperature)
        if self.beta < 0:
            raise ValueError(
                f"beta must be >= 0, got {self.beta}: it weighs the KL penalty that keeps the policy near the "
                "reference; a negative beta would reward moving away from it (the loss would be -KL)"
            )
        if self.delta is not None and not self.delta > 1:
            raise ValueError(f"delta must be > 1 (an upper cap on the ratio above 1), got {self.delta}")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(f"off_policy_mask_threshold must be >= 0 (a KL), got {self.off_policy_mask_threshold}")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (the power of w in vespo's φ), got {getattr(self, name)}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (the decay rate in vespo's φ), got {getattr(self, name)}")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError(
                f"epsilon_low and epsilon_high must be >= 0, got {self.epsilon_low} and {self.epsilon_high}"
            )
        if not 0.0 <= self.top_entropy_quantile <= 1.0:  # 0: only the highest-entropy tokens (H >= max H), as TRL
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ValueError(
                "sapo_temperature_pos and sapo_temperature_neg must be > 0, got "
                f"{self.sapo_temperature_pos} and {self.sapo_temperature_neg}"
            )
        if self.max_completion_length is not None:
            if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int):
                raise TypeError(
                    f"max_completion_length must be an int, got {type(self.max_completion_length).__name__}"
                )
            if self.max_completion_length <= 0:
                raise ValueError(f"max_completion_length must be > 0, got {self.max_completion_length}")
        if self.num_items_in_batch is not None and self.num_items_in_batch < 0:
            raise ValueError(f"num_items_in_batch must be >= 0, got {self.num_items_in_batch}")
        for name in ("use_bias_correction_kl", "check_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")

    @property
    def is_sequence_level(self) -> bool:
        """True when some quantity needs every token of a sequence before any token's gradient is known."""
        return (
            self.importance_sampling_level == "sequence"
            or self.loss_type == "vespo"
            or self.off_policy_mask_threshold is not None
            or self.top_entropy_quantile < 1.0
        )

    @property
    def is_fused(self) -> bool:
        """True when the one-read fused pass can form this loss's gradient in registers."""
        return not self.is_sequence_level and self.loss_type in FUSED_LOSS_TYPES

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def trl_names(options: dict[str, Any], where: str = "grpo_loss") -> dict[str, Any]:
    """`options` with TRL's names (`TRL_NAMES`: `epsilon`) written as ours; TypeError when both are given."""
    out = dict(options)
    for trl, ours in TRL_NAMES.items():
        if trl in out:
            if ours in out:
                raise TypeError(f"{where} got both {trl} (TRL's name) and {ours}: they are one option, pass one")
            out[ours] = out.pop(trl)
    return out


def check_option_names(options: dict[str, Any], where: str = "grpo_loss", hint: bool = True) -> None:
    """TypeError for any option that is not a `LossConfig` field (TRL's names of `TRL_NAMES` are translated
    first), with the closest names as a hint (`hint`; not under torch.compile, which cannot trace difflib)."""
    unknown = set(options) - OPTION_DEFAULTS.keys() - TRL_NAMES.keys()
    if unknown:
        hints = []
        for name in sorted(unknown) if hint else ():
            close = difflib.get_close_matches(name, [*OPTION_DEFAULTS, *TRL_NAMES], n=2, cutoff=0.6)
            if close:
                hints.append(f"{name!r}: did you mean {' or '.join(map(repr, close))}?")
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise TypeError(f"{where} got unknown option(s) {sorted(unknown)}{hint}; LossConfig's fields are the options")


def make_config(config: LossConfig | None, options: dict[str, Any], where: str = "grpo_loss") -> LossConfig:
    """The one validated `LossConfig` of a call: `config` (default: all defaults) with `options` overriding its
    fields (TRL's `epsilon` is `epsilon_low`). Raises TypeError/ValueError naming the option."""
    check_option_names(options, where)
    options = trl_names(options, where)
    if config is None:
        return LossConfig(**options)
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig or None, got {type(config).__name__}")
    return replace(config, **options) if options else config


# Flat forms of the options for the torch.library op (a custom op takes primitives, not a dataclass), computed at
# import time so that code traced by torch.compile only reads constants.
OPTION_DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(LossConfig)}
# The option values as strings, type and value both ("float:0.1", "str:'0.1'", "NoneType:None"), so that a custom
# op (torch.compile's `validate_config`) can rebuild exactly what the caller passed and validate it as LossConfig does.
_PLAIN_TYPES = {t.__name__: t for t in (bool, int, float, str, type(None))}
_SEPARATOR = "\x1f"


def encode_options(values: dict[str, Any]) -> str:
    """`values` (every LossConfig field) as "type:repr" strings, in field order, joined by a control character that
    no repr holds unescaped; an object of another type keeps only its type's name (LossConfig refuses it by it)."""
    out = []
    for name in OPTION_DEFAULTS:
        value = values[name]
        kind = type(value).__name__
        out.append(f"{kind}:{value!r}" if kind in _PLAIN_TYPES else f"{kind}:")
    return _SEPARATOR.join(out)


def config_from_encoded(encoded: str) -> LossConfig:
    """Inverse of `encode_options`, then LossConfig's checks (TypeError/ValueError naming the option)."""
    values: dict[str, object] = {}
    for name, item in zip(OPTION_DEFAULTS, encoded.split(_SEPARATOR), strict=True):
        kind, text = item.split(":", 1)
        if kind not in _PLAIN_TYPES:
            values[name] = type(kind, (), {})()  # a stand-in of the same type name
        elif kind == "float":
            values[name] = float(text)  # repr round-trips, nan and inf included
        else:
            values[name] = ast.literal_eval(text)
    return LossConfig(**values)
