"""The row-backend interface: what every logits backend offers the loss, and the one per-row state they share.

A backend is a module (`ops/torch_rows.py`, `ops/triton_logits.py`, ...) or an object with these names;
`grpo_kernels.dispatch.pick_backend` returns one, typed as `RowBackend`, so the api -> kernel edge is visible to a
reader and to a type checker. The fused-linear backends (`ops/linear_torch.py`, `ops/linear_triton.py`) follow
`LinearBackend`.

Row state, [B, T, ROW_STATE_WIDTH] float32 (float64 for float64 logits, which only the torch rows take), contiguous,
the same for every backend. Per row, with x the raw logits, m = max_v x_v, z'_v = (x_v − m)/τ (<= 0) and
e_v = exp(z'_v):
    [..., 0]  m          the raw row maximum (not divided by τ)
    [..., 1]  s          log Σ_v e_v                      (so lse = m/τ + s, p_v = exp(z'_v − s), ℓ = z'_y − s)
    [..., 2]  q          1 − p_y = Σ_{v≠y} e_v / Σ_v e_v   (summed over the other tokens: exact for a peaked row)
    [..., 3]  c          Σ_v p_v z'_v                     (so H = s − c)
Natural-log units. A backend that computes in base 2 (the Triton kernels use exp2) converts at its launcher. The
row state of a vocabulary shard's merged statistics (vocab_parallel) has the same layout, over the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..config import CLIPPED_LOSS_TYPES, LossConfig

ROW_STATE_WIDTH = 4
# The per-token loss of the one-read fused passes (Triton and C kernels alike): 0 the clipped PPO form, 1 cispo, 2 sapo
FUSED_LOSS_CODES = {**{name: 0 for name in CLIPPED_LOSS_TYPES}, "cispo": 1, "sapo": 2}
SHARD_PARTIALS_WIDTH = 5  # (m, Σe, Σe·z', raw target logit or −inf, Σ_{v≠y} e) of one shard row: see shard_partials


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ℓ, H, the row state and g, h for inputs of `dtype`: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_row_state(
    batch: int, length: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An uninitialized row state of the shape every backend's `row_stats` returns (torch.compile's fake kernel);
    `dtype`: the logits' dtype."""
    return torch.empty(batch, length, ROW_STATE_WIDTH, dtype=stats_dtype(dtype), device=device)


def gather_target_logit(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x_y of each row, [B, T] float64 (exact: every logits dtype is a subset of float64); an O(B·T) gather."""
    return logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1).double()


def exact_logp(
    target_logit: torch.Tensor, row_state: torch.Tensor, temperature: float, logp: torch.Tensor
) -> torch.Tensor:
    """ℓ in float64 from the row state: (x_y − m)/τ − s, formed in float64 from the raw target logit x_y and the
    state's raw max m and s = log Σe. Exact to the fp32 rounding of s (|s| <= log V, so about 1e-6 absolute) for
    any |ℓ|, where the fp32 ℓ of size 1e3 carries 6e-5: exp(ℓ − ℓ_old) and the KL then match float64 to 1e-5.
    Where z'_y > −20 (ℓ near 0, peaked rows) the backend's own fp32 ℓ, formed without cancellation, is kept."""
    z_y = (target_logit - row_state[..., 0].double()) / temperature
    return torch.where(z_y > -20.0, logp.double(), z_y - row_state[..., 1].double())


class FusedTokenGrad(Protocol):
    """The one-read fused pass of the token-level losses (`LossConfig.is_fused`): ℓ, H, the token coefficient
    g = ∂loss/∂ℓ and ∂logits in one read of each row. Returns (logp, entropy): logp [B, T] float64, formed as
    (x_y − m)/τ − s in float64 (exact next to the fp32 row statistics, see `exact_logp`), entropy [B, T] float32;
    writes `out`. g is formed from that float64 ℓ. A token with weight 0 and entropy weight 0 (masked) gets an
    exactly zero gradient row, whatever its logits and per-token inputs hold (the `row_grad` contract)."""

    def __call__(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        *,
        advantages: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        is_ratio: torch.Tensor | None,
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
        """(logp, entropy, row_state): logp, entropy [B, T] float32, row_state in this module's layout."""
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

    def target_logit(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The raw logit of each row's target, [B, T] float64, exact (O(B·T); `gather_target_logit` for a backend
        that holds the whole row). With the row state it gives ℓ in float64 (`exact_logp`)."""
        ...

    def shard_partials(self, logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
        """[B, T, SHARD_PARTIALS_WIDTH] float32 partials of the vocabulary shard [offset, offset + V); `ids` global."""
        ...


# The fused-linear tile drivers: `merge` and `reduce_dx` are the vocabulary-parallel hooks (None: one process).
MergeHook = Callable[[Any], Any]
ReduceHook = Callable[[torch.Tensor], Any]


class LinearBackend(Protocol):
    """The vocabulary-tile work of `fused_linear_grpo_loss` (ℓ, H, lse, then the gradients of hidden, W, b)."""

    def stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ids: torch.Tensor,
        temperature: float,
        merge: MergeHook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ids: torch.Tensor,
        lse: torch.Tensor,
        entropy: torch.Tensor,
        g: torch.Tensor,
        h: torch.Tensor | None,
        temperature: float,
        needs: tuple[bool, ...],
        reduce_dx: ReduceHook | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]: ...
