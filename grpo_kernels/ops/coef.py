"""The per-token coefficient g = ∂loss/∂ℓ of the one-read fused pass,
and the one layout of the scalars its kernels take.

The coefficient exists three times, a managed set held together by tests/ops/test_token_coef.py:
- `loss_math.per_token_terms`, the definition (float64, differentiated by autograd);
- `triton_logits._token_coef`, in registers between the Triton kernel's two reads of a row;
- `token_coef` in `csrc/cpu_rows.c`, the same between the C kernel's reads.
`coef_scalars` turns a `LossConfig` into the scalars both launchers pass, in one order (`FLOAT_FIELDS`) with one
meaning, so the two kernels cannot read them differently. A new token-level loss option touches all three copies,
this layout and that test.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

from ..config import CLIPPED_LOSS_TYPES, LossConfig

# The per-token loss of the fused kernels (Triton and C alike): 0 the clipped PPO form, 1 cispo, 2 sapo.
FUSED_LOSS_CODES = {**dict.fromkeys(CLIPPED_LOSS_TYPES, 0), "cispo": 1, "sapo": 2}


@dataclass(frozen=True)
class CoefFlags:
    """The switches of the coefficient: the Triton kernel's constexprs (LOSS, HAS_DELTA, BIAS_KL), the C `Coef`'s
    ints (loss, has_delta, bias_kl)."""

    loss: int  # FUSED_LOSS_CODES
    has_delta: bool  # the δ cap of the clipped types is on
    bias_kl: bool  # use_bias_correction_kl: the KL term times the ratio

    def values(self) -> tuple[int, bool, bool]:
        return (self.loss, self.has_delta, self.bias_kl)


@dataclass(frozen=True)
class CoefScalars:
    """The float scalars of the coefficient, in the order both kernels take them (`FLOAT_FIELDS`)."""

    lo: float  # 1 − ε_low
    hi: float  # 1 + ε_high
    delta: float  # the δ cap (0.0 when off: `CoefFlags.has_delta` says whether it applies)
    eps_high: float  # cispo's absolute cap on the ratio
    beta: float  # the KL weight
    sapo_pos: float  # sapo's temperature for A > 0
    sapo_neg: float  # and for A <= 0

    def values(self) -> tuple[float, ...]:
        return astuple(self)


FLOAT_FIELDS = tuple(f.name for f in fields(CoefScalars))


def coef_flags(cfg: LossConfig) -> CoefFlags:
    """The switches of the coefficient for `cfg`, a token-level (`cfg.is_fused`) config."""
    return CoefFlags(FUSED_LOSS_CODES[cfg.loss_type], cfg.delta is not None, cfg.use_bias_correction_kl)


def coef_scalars(cfg: LossConfig) -> CoefScalars:
    """The float scalars of the coefficient for `cfg`."""
    return CoefScalars(
        lo=1.0 - cfg.epsilon_low,
        hi=1.0 + cfg.epsilon_high,
        delta=0.0 if cfg.delta is None else cfg.delta,
        eps_high=cfg.epsilon_high,
        beta=cfg.beta,
        sapo_pos=cfg.sapo_temperature_pos,
        sapo_neg=cfg.sapo_temperature_neg,
    )
