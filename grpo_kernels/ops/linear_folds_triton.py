"""The fused-linear folds of the CUDA path: two Triton kernels on fp32 tiles of cuBLAS GEMMs (online softmax
statistics in pass 1, the logits gradient in pass 2). `BACKEND` is the tile driver (ops/linear_tiles.py) over them;
docs/fused_linear.md says why tiles and folds rather than one fused kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_tiles import GradRows, RowStats, TileBackend

# Columns a fold program handles per step: 1024 fp32 values = 8 per thread at 4 warps.
BLOCK_V = 1024


@triton.jit(do_not_specialize=["v0", "n_cols"])
def linear_stats_fwd_kernel(
    z_ptr,  # [R, n_cols] fp32 logits of one tile, before the temperature
    stride_z,
    ids_ptr,  # [R] target ids (global vocabulary index)
    max_ptr,  # [R] running max of z / τ
    sum_exp_ptr,  # [R] Σ e^{z/τ − max}
    sum_exp_z_ptr,  # [R] Σ e^{z/τ − max} · (z/τ − max)
    target_ptr,  # [R] z/τ at the target, written by the tile that holds it
    v0,  # first vocabulary index of the tile
    n_cols,
    inv_t,
    BLOCK_V: tl.constexpr,
):
    # One program per row: fold the tile's columns into the row's online logsumexp / entropy statistics.
    i_r = tl.program_id(0).to(tl.int64)
    p_z = z_ptr + i_r * stride_z
    b_max = tl.load(max_ptr + i_r)
    b_s = tl.load(sum_exp_ptr + i_r)
    b_sz = tl.load(sum_exp_z_ptr + i_r)
    for start in range(0, n_cols, BLOCK_V):
        o_v = start + tl.arange(0, BLOCK_V)
        m_v = o_v < n_cols
        b_z = tl.load(p_z + o_v, mask=m_v, other=float("-inf")) * inv_t  # [BLOCK_V]
        b_new = tl.maximum(b_max, tl.max(b_z, axis=0))
        b_shift = tl.where(b_new == float("-inf"), 0.0, b_new)  # rows that are −inf so far stay at 0, not NaN
        b_rescale = tl.exp(b_max - b_shift)
        b_moved = tl.where(b_s > 0, b_max - b_shift, 0.0)  # re-reference Σ e·(z − max) to the new max
        b_z = b_z - b_shift
        b_e = tl.exp(b_z)
        b_sz = (b_sz + b_moved * b_s) * b_rescale + tl.sum(b_e * tl.where(b_e > 0, b_z, 0.0), axis=0)
        b_s = b_s * b_rescale + tl.sum(b_e, axis=0)
        b_max = b_new
    tl.store(max_ptr + i_r, b_max)
    tl.store(sum_exp_ptr + i_r, b_s)
    tl.store(sum_exp_z_ptr + i_r, b_sz)
    local = tl.load(ids_ptr + i_r) - v0
    if (local >= 0) & (local < n_cols):
        tl.store(target_ptr + i_r, tl.load(p_z + local) * inv_t)


@triton.heuristics({"HAS_H": lambda args: args["h_ptr"] is not None})
@triton.jit(do_not_specialize=["v0", "n_cols"])
def linear_grad_bwd_kernel(
    z_ptr,  # [R, n_cols] fp32 logits of one tile, before the temperature
    stride_z,
    dz_ptr,  # [R, n_cols] out: ∂loss/∂logits, in the GEMM dtype
    stride_dz,
    ids_ptr,  # [R]
    lse_ptr,  # [R] logsumexp of z/τ
    mean_z_ptr,  # [R] Σ p·z/τ (read only with HAS_H)
    g_ptr,  # [R] ∂loss/∂ℓ
    h_ptr,  # [R] ∂loss/∂H, or None
    v0,
    n_cols,
    inv_t,
    HAS_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # dz = (g·(onehot − p) − h·p·(z − Σp·z)) / τ on one [1, BLOCK_V] block of a row.
    i_r = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < n_cols
    b_z = tl.load(z_ptr + i_r * stride_z + o_v, mask=m_v, other=float("-inf")) * inv_t  # [BLOCK_V]
    b_p = tl.exp(b_z - tl.load(lse_ptr + i_r))
    b_g = tl.load(g_ptr + i_r)
    local = tl.load(ids_ptr + i_r) - v0
    b_dz = tl.where(o_v == local, b_g, 0.0) - b_g * b_p
    if HAS_H:
        b_h = tl.load(h_ptr + i_r)
        b_dz -= b_h * b_p * tl.where(b_p > 0, b_z - tl.load(mean_z_ptr + i_r), 0.0)
    tl.store(dz_ptr + i_r * stride_dz + o_v, (b_dz * inv_t).to(dz_ptr.dtype.element_ty), mask=m_v)


def _block_v(n_cols: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(n_cols))


def _fold_stats(z: torch.Tensor, ids: torch.Tensor, v0: int, inv_t: float, st: RowStats) -> None:
    rows, n_cols = z.shape
    linear_stats_fwd_kernel[(rows,)](
        z, z.stride(0), ids, st.max, st.sum_exp, st.sum_exp_z, st.target, v0, n_cols, inv_t, BLOCK_V=_block_v(n_cols)
    )


def _fold_grad(z: torch.Tensor, v0: int, inv_t: float, rows: GradRows, grad_dtype: torch.dtype) -> torch.Tensor:
    n_rows, n_cols = z.shape
    dz = torch.empty(n_rows, n_cols, dtype=grad_dtype, device=z.device)
    block = _block_v(n_cols)
    linear_grad_bwd_kernel[(n_rows, triton.cdiv(n_cols, block))](
        z, z.stride(0), dz, dz.stride(0), rows.ids, rows.lse, rows.mean_z, rows.g, rows.h, v0, n_cols, inv_t,
        BLOCK_V=block,
    )  # fmt: skip
    return dz


BACKEND = TileBackend(
    fold_stats=_fold_stats,
    fold_grad=_fold_grad,
    # One fp32 logits tile holds 2^25 elements (128 MiB, plus 64 MiB of bf16 dz in pass 2): at B·T = 8192 that is
    # an [8192 x H] @ [H x 4096] GEMM (compute bound on an H100/H200) and 38 tiles for V = 151936; at B·T = 32768
    # the tile is 1024 wide and the GEMMs are as large.
    tile_elements=1 << 25,
    # Vocabulary tiles are multiples of 256 columns, so that cuBLAS never gets a thin, ragged GEMM but the last one.
    min_vocab_tile=256,
    # dz rounded to the inputs' dtype (bf16: one rounding per element, as the materialized path's ∂logits are), so
    # that ∂hidden = dz @ W and ∂W = dzᵀ @ hidden run on the tensor cores with fp32 accumulation.
    dz_in_input_dtype=True,
)
