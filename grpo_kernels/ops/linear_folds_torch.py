"""The fused-linear folds of the CPU path: the C folds of ops/cpu_rows.py, or these torch folds where that extension
is not built (or a tile does not fit it). `BACKEND` is the tile driver (ops/linear_tiles.py) over them.
"""

from __future__ import annotations

import torch

from . import cpu_rows
from .linear_tiles import GradRows, RowStats, TileBackend


def fold_stats_torch(z: torch.Tensor, ids: torch.Tensor, v0: int, inv_t: float, st: RowStats) -> None:
    """Fold one fp32 tile z [R, Vt] (columns v0 ..) into the statistics `st` (views of R rows), in place."""
    if inv_t != 1.0:
        z = z * inv_t
    new_max = torch.maximum(st.max, z.amax(-1))
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # a row with only −inf so far stays at 0, not NaN
    rescale = torch.exp(st.max - shift)
    moved = torch.where(st.sum_exp > 0, st.max - shift, 0.0)  # re-reference the old Σ e·(z − max) to the new max
    local = ids - v0
    picked = z.gather(-1, local.clamp(0, z.shape[1] - 1).unsqueeze(-1)).squeeze(-1)
    st.target.copy_(torch.where((local >= 0) & (local < z.shape[1]), picked, st.target))
    z = z - shift.unsqueeze(-1)
    e = torch.exp(z)
    st.sum_exp_z.add_(moved * st.sum_exp).mul_(rescale).add_((e * torch.where(e > 0, z, 0.0)).sum(-1))
    st.sum_exp.mul_(rescale).add_(e.sum(-1))
    st.max.copy_(new_max)


def fold_grad_torch(z: torch.Tensor, v0: int, inv_t: float, rows: GradRows, grad_dtype: torch.dtype) -> torch.Tensor:
    """∂loss/∂(x @ Wᵀ + b) on one tile: (g·(onehot − p) − h·p·(z − Σp·z)) / τ, [R, Vt] in `grad_dtype`."""
    if inv_t != 1.0:
        z = z * inv_t
    g = rows.g
    p = torch.exp(z - rows.lse.unsqueeze(-1))
    dz = -g.unsqueeze(-1) * p
    if rows.h is not None:
        dz -= rows.h.unsqueeze(-1) * p * torch.where(p > 0, z - rows.mean_z.unsqueeze(-1), 0.0)
    local = rows.ids - v0
    inside = (local >= 0) & (local < z.shape[1])
    dz.scatter_add_(-1, local.clamp(0, z.shape[1] - 1).unsqueeze(-1), torch.where(inside, g, 0.0).unsqueeze(-1))
    if inv_t != 1.0:
        dz *= inv_t
    return dz.to(grad_dtype)


def fold_stats(z: torch.Tensor, ids: torch.Tensor, v0: int, inv_t: float, st: RowStats) -> None:
    """The C fold of ops/cpu_rows.py; the torch fold where the extension is not built or the tile does not fit it."""
    if not cpu_rows.fold_stats(z, ids, v0, inv_t, st):
        fold_stats_torch(z, ids, v0, inv_t, st)


def fold_grad(z: torch.Tensor, v0: int, inv_t: float, rows: GradRows, grad_dtype: torch.dtype) -> torch.Tensor:
    """The C fold (written over the logits tile; it takes fp32 tiles only); the torch fold where it does not apply."""
    grad = cpu_rows.fold_grad(z, v0, inv_t, rows, grad_dtype)
    return fold_grad_torch(z, v0, inv_t, rows, grad_dtype) if grad is None else grad


# On a CPU a 2^20-element (4 MiB) fp32 tile stays near the caches; dz stays in fp32 (the CPU matmuls are fp32
# anyway; float64 for float64 inputs).
BACKEND = TileBackend(
    fold_stats=fold_stats, fold_grad=fold_grad, tile_elements=1 << 20, min_vocab_tile=128, dz_in_input_dtype=False
)
