"""The backend interfaces: `RowBackend` (what every logits backend offers the loss, and the one per-row state they
share) and `LinearBackend` (the fused-linear tile backends, with the parameter objects they take).

A row backend is a module (`ops/torch_rows.py`, `ops/cpu_rows.py`, `ops/triton_logits.py`) or an object with these
names; `grpo_kernels.dispatch.pick_backend` returns one, typed as `RowBackend`, so the api -> kernel edge is visible
to a reader and to a type checker. The fused-linear backends (`ops/linear_tiles.TileBackend` objects: the
`BACKEND` of `ops/linear_folds_torch.py` and of `ops/linear_folds_triton.py`) follow `LinearBackend`.

Row state, [B, T, ROW_STATE_WIDTH] float32 (float64 for float64 logits, which only the torch rows take), contiguous,
the same for every backend. Per row, with x the raw logits, m = max_v x_v, z'_v = (x_v − m)/τ (<= 0) and
e_v = exp(z'_v):
    [..., 0]  m          the raw row maximum (not divided by τ)
    [..., 1]  s          log Σ_v e_v                      (so lse = m/τ + s, p_v = exp(z'_v − s), ℓ = z'_y − s)
    [..., 2]  q          1 − p_y = Σ_{v≠y} e_v / Σ_v e_v   (summed over the other tokens: exact for a peaked row)
    [..., 3]  c          Σ_v p_v z'_v                     (so H = s − c)
Natural-log units. A backend that computes in base 2 (the Triton kernels use exp2) converts at its launcher. The
row state of a vocabulary shard's merged statistics (vocab_parallel) has the same layout, over the full vocabulary.

ℓ in float64. Every backend returns ℓ as float64, formed in float64 from the target's own term, z'_y = (x_y − m)/τ
and e_y = exp(z'_y) taken from the raw target logit, and the sum of the other tokens' fp32 exponentials,
accumulated wider than fp32: ℓ = −log1p(Σ_{v≠y} e_v / e_y) where p_y is not tiny, z'_y − log Σe elsewhere. It is
then exact to the rounding of that sum (a few 1e-8 absolute, about eps32 times Σ p·|z'|) for any |ℓ|, where an
fp32 ℓ of size 10 carries 5e-7 and one of size 1e3 carries 6e-5. The O(B·T) math takes ℓ − ℓ_old and ℓ_ref − ℓ
from it, so exp(ℓ − ℓ_old), the KL and the clip decisions match float64; where the terms of g = ∂loss/∂ℓ cancel
(a policy-gradient term against the KL's, each 200 times g) g keeps that absolute precision. This costs a few
scalars per row, never a V-wide pass; the fp32 row state above stays what the gradient pass reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import LossConfig

ROW_STATE_WIDTH = 4
SHARD_PARTIALS_WIDTH = 5  # (m, Σe, Σe·z', raw target logit or −inf, Σ_{v≠y} e) of one shard row: see shard_partials


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ℓ, H, the row state and g, h for inputs of `dtype`: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_row_state(batch: int, length: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized row state of the shape every backend's `row_stats` returns (torch.compile's fake kernel);
    `dtype`: the logits' dtype."""
    return torch.empty(batch, length, ROW_STATE_WIDTH, dtype=stats_dtype(dtype), device=device)


def logp_from_sums(z_y: torch.Tensor, e_y: torch.Tensor, others: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """ℓ in float64 (the module docstring) from the target's z'_y and e_y, Σ_{v≠y} e and log Σe, all float64:
    −log1p(Σ_{v≠y} e / e_y), exact near 0, where p_y is not tiny; z'_y − log Σe elsewhere."""
    return torch.where(z_y > -20.0, -torch.log1p(others / e_y), z_y - log_sum)


class FusedTokenGrad(Protocol):
    """The one-read fused pass of the token-level losses (`LossConfig.is_fused`): ℓ, H, the token coefficient
    g = ∂loss/∂ℓ and ∂logits in one read of each row. Returns (logp, entropy): logp [B, T] float64 (the module
    docstring's "ℓ in float64"), entropy [B, T] float32; writes `out`. g is formed from that float64 ℓ (ops/coef.py:
    the coefficient's three copies). `rho` is ρ, the importance-sampling ratio, or None. A token with weight 0 and
    entropy weight 0 (masked) gets an exactly zero gradient row, whatever its logits and per-token inputs hold (the
    `row_grad` contract)."""

    def __call__(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        *,
        advantages: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        rho: torch.Tensor | None,
        weight: torch.Tensor,
        entropy_weight: torch.Tensor | None,
        cfg: LossConfig,
        out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RowBackend(Protocol):
    """The vocabulary-wide work of the logits path. Inputs are trusted: the public functions validated them.

    `fused_token_grad` is None for a backend without the one-read pass; the loss then runs `row_stats`, the
    O(B·T) objective and `row_grad` (two reads of each row).
    """

    fused_token_grad: FusedTokenGrad | None

    def row_stats(
        self, logits: torch.Tensor, ids: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, row_state): logp [B, T] float64 (the module docstring's "ℓ in float64"), entropy [B, T]
        float32 (float64 for float64 logits), row_state in this module's layout."""
        ...

    def row_grad(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        row_state: torch.Tensor,
        g: torch.Tensor,
        h: torch.Tensor | None,
        temperature: float,
        out: torch.Tensor,
    ) -> None:
        """out = (g·(onehot(y) − p) − h·p·(z' − c)) / τ, in out's dtype; `out` may be `logits` itself. An id outside
        [0, V) (a target in another vocabulary shard) contributes no one-hot. A row with g = 0 and h = 0 (or None),
        a masked token, is written as exact zeros whatever its logits and row state hold (NaN, ±inf): masked means
        absent (docs/loss.md)."""
        ...

    def shard_partials(self, logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
        """[B, T, SHARD_PARTIALS_WIDTH] float32 partials of the vocabulary shard [offset, offset + V); `ids` global."""
        ...


# The fused-linear hooks of vocabulary parallelism (None: one process): `merge` turns one shard's pass-1 statistics
# (an ops/linear_tiles.RowStats) into the full vocabulary's; `reduce_dx` sums the fp32 ∂hidden over the shards.
MergeHook = Callable[[Any], Any]
ReduceHook = Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class LinearInputs:
    """One fused-linear call's inputs, as the tile backends take them."""

    hidden: torch.Tensor  # [B, T, H]
    weight: torch.Tensor  # [V, H]: the lm_head, or this rank's rows of it
    bias: torch.Tensor | None  # [V]
    ids: torch.Tensor  # [B, T] target ids; shard-local under vocabulary parallelism (may lie outside [0, V))
    temperature: float


@dataclass(frozen=True)
class RowCoefficients:
    """Pass 2's per-token inputs, each [B, T] float32 (float64 for float64 inputs): pass 1's lse and H, and the
    objective's g = ∂loss/∂ℓ and h = ∂loss/∂H (None when the loss does not depend on H)."""

    lse: torch.Tensor
    entropy: torch.Tensor
    g: torch.Tensor
    h: torch.Tensor | None


class LinearBackend(Protocol):
    """The vocabulary-tile work of the fused-linear functions: ℓ, H, lse (pass 1), then the gradients of hidden,
    weight and bias (pass 2). Inputs are trusted: the public functions validated them."""

    def stats(
        self, inp: LinearInputs, merge: MergeHook | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def grads(
        self,
        inp: LinearInputs,
        coef: RowCoefficients,
        needs: tuple[bool, bool, bool],
        reduce_dx: ReduceHook | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]: ...
