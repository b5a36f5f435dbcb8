"""The fused-linear algorithm in vocabulary tiles of torch matmuls: ℓ, H and the gradients of hidden, weight and bias
from `hidden @ weight.T + bias` without ever holding a (B·T, V) tensor.

This is the CPU path (`stats`, `grads` with the C folds of ops/cpu_rows.py, or the torch folds below where that
extension is not built), and the tile driver that the CUDA path (`linear_triton`) runs with its Triton folds: only
the per-tile element-wise work differs between them.

Pass 1 (`stats`): for each vocabulary tile, z = (x @ W_tileᵀ + b_tile) / τ in fp32, folded into per-row online
statistics (running max m, Σ e^{z−m}, Σ e^{z−m}·(z−m), the target's z) -> ℓ, H, lse.
Pass 2 (`grads`), once g = ∂loss/∂ℓ and h = ∂loss/∂H are known per row: recompute each tile, form
dz = (g·(onehot − p) − h·p·(z − Σp·z)) / τ and accumulate ∂x += dz @ W_tile, ∂W_tile = dzᵀ @ x, ∂b_tile = Σ_rows dz,
all in fp32 (float64 for float64 hidden and weight). The vocabulary is the outer loop so that ∂W needs only a
[V_tile, H] fp32 accumulator; ∂x needs a [B·T, H] one (the size of hidden itself). Rows with g = h = 0 (padding, zero
advantages) enter pass 2 as zeros (their count would need a host read): they add exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import cpu_rows
from .rows import stats_dtype

# Elements of one fp32 logits tile (rows x vocabulary). On a CPU, 2^20 (4 MiB) stays near the caches; the CUDA path
# has its own, larger budget. Tests lower these to force many tiles and ragged last tiles.
TILE_ELEMENTS = 1 << 20
# The vocabulary tile is a multiple of this (and at least this), so that a GEMM is never absurdly thin.
MIN_VOCAB_TILE = 128

# matmul(bf16, bf16) -> fp32 output without an intermediate bf16 rounding; CUDA only (torch >= 2.8).
_HAS_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


@dataclass(frozen=True)
class TilePlan:
    """How the (rows, V) logits are cut: row blocks of at most `rows` rows, vocabulary tiles of `vocab` columns."""

    rows: int
    vocab: int


def plan_tiles(num_rows: int, vocab: int, tile_elements: int, min_vocab_tile: int) -> TilePlan:
    """The widest vocabulary tile (a multiple of `min_vocab_tile`) for which all rows fit in `tile_elements`."""
    v_tile = max(min_vocab_tile, (tile_elements // max(num_rows, 1)) // min_vocab_tile * min_vocab_tile)
    v_tile = min(v_tile, vocab)
    return TilePlan(rows=max(1, min(num_rows, tile_elements // v_tile)), vocab=v_tile)


def row_blocks(hidden: torch.Tensor, rows: int) -> list[tuple[int, torch.Tensor]]:
    """(first flat row, [R, H] view) blocks covering hidden's B·T rows in order, without copying hidden.

    A strided (B, T, H) view such as `last_hidden[:, -T-1:-1]` cannot be flattened to (B·T, H) without a copy, so
    its blocks are cut per sequence instead; each block is still one 2-D matrix with unit stride along H.
    """
    batch, length, width = hidden.shape
    try:
        flat = hidden.view(batch * length, width)
    except RuntimeError:
        flat = None
    if flat is not None:
        return [(r0, flat[r0 : r0 + rows]) for r0 in range(0, batch * length, rows)]
    return [(b * length + t0, hidden[b, t0 : t0 + rows]) for b in range(batch) for t0 in range(0, length, rows)]


def _vocab_tiles(vocab: int, v_tile: int) -> Iterator[tuple[int, int]]:
    for v0 in range(0, vocab, v_tile):
        yield v0, min(v0 + v_tile, vocab)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (or acc += a @ b) with an fp32 result (float64 for float64 operands), never rounding the product to
    the inputs' dtype.

    On CUDA, bf16/fp16 operands go to the tensor cores with fp32 output; elsewhere they are upcast first.
    """
    if _HAS_MM_OUT_DTYPE and a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if acc is None:
        dtype = stats_dtype(a.dtype)
        return torch.mm(a.to(dtype), b.to(dtype))
    return acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _logits_tile(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    z = matmul_fp32(x, w.t())  # [R, Vt] fp32 (float64 for float64 inputs), before the temperature
    if b is not None:
        z += b.to(z.dtype)
    return z


# ----------------------------------------------------------------------------------------------------------------
# The torch folds: what the Triton kernels of linear_triton do, on a whole tile at once


@dataclass
class RowStats:
    """Per-row online softmax statistics over the vocabulary tiles seen so far, each [N] fp32 (float64 for float64
    inputs)."""

    max: torch.Tensor  # running max of z
    sum_exp: torch.Tensor  # Σ e^{z − max}
    sum_exp_z: torch.Tensor  # Σ e^{z − max} · (z − max): relative to the max, so H = log Σe − this / Σe does not
    # cancel two numbers of the size of the logits (terms with e == 0 count 0, so −inf logits are harmless)
    target: torch.Tensor  # z at the target token once its tile has been seen; −inf while (or if) not seen, so a
    # vocabulary shard without the target contributes nothing to the max over shards

    @classmethod
    def empty(cls, num_rows: int, device: torch.device, dtype: torch.dtype = torch.float32) -> RowStats:
        full = lambda value: torch.full((num_rows,), value, dtype=dtype, device=device)
        return cls(full(float("-inf")), full(0.0), full(0.0), full(float("-inf")))

    def rows(self, r0: int, r1: int) -> RowStats:
        return RowStats(self.max[r0:r1], self.sum_exp[r0:r1], self.sum_exp_z[r0:r1], self.target[r0:r1])


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


def fold_grad_torch(
    z: torch.Tensor,
    ids: torch.Tensor,
    v0: int,
    inv_t: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    g: torch.Tensor,
    h: torch.Tensor | None,
    grad_dtype: torch.dtype,
) -> torch.Tensor:
    """∂loss/∂(x @ Wᵀ + b) on one tile: (g·(onehot − p) − h·p·(z − Σp·z)) / τ, [R, Vt] in `grad_dtype`."""
    if inv_t != 1.0:
        z = z * inv_t
    p = torch.exp(z - lse.unsqueeze(-1))
    dz = -g.unsqueeze(-1) * p
    if h is not None:
        dz -= h.unsqueeze(-1) * p * torch.where(p > 0, z - mean_z.unsqueeze(-1), 0.0)
    local = ids - v0
    inside = (local >= 0) & (local < z.shape[1])
    dz.scatter_add_(-1, local.clamp(0, z.shape[1] - 1).unsqueeze(-1), torch.where(inside, g, 0.0).unsqueeze(-1))
    if inv_t != 1.0:
        dz *= inv_t
    return dz.to(grad_dtype)


FoldStats = Callable[[torch.Tensor, torch.Tensor, int, float, RowStats], None]
FoldGrad = Callable[..., torch.Tensor]
# Vocabulary parallel (see vocab_parallel.py): the merge of every shard's statistics into the full vocabulary's,
# and the sum of every shard's fp32 ∂hidden.
MergeStats = Callable[[RowStats], RowStats]
ReduceGrad = Callable[[torch.Tensor], None]


# ----------------------------------------------------------------------------------------------------------------
# The tile driver, shared with linear_triton


def run_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    temperature: float,
    fold: FoldStats,
    plan: TilePlan,
    merge: MergeStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1: (logp, entropy, lse), each [B, T] float32; `merge` turns one vocabulary shard's statistics into the
    full vocabulary's before they are finished (ids are then shard-local and may lie outside the shard)."""
    batch, length, _ = hidden.shape
    flat_ids = ids.reshape(-1).long()
    st = RowStats.empty(batch * length, hidden.device, stats_dtype(hidden.dtype))
    blocks = row_blocks(hidden, plan.rows)
    for v0, v1 in _vocab_tiles(weight.shape[0], plan.vocab):
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        for r0, x in blocks:
            r1 = r0 + x.shape[0]
            fold(_logits_tile(x, w, b), flat_ids[r0:r1], v0, 1.0 / temperature, st.rows(r0, r1))
    if merge is not None:
        st = merge(st)
    log_sum = torch.log(st.sum_exp)
    lse = st.max + log_sum
    logp = (st.target - st.max) - log_sum  # not target − lse: keeps ℓ ≈ 0 exact when the target dominates
    entropy = log_sum - st.sum_exp_z / st.sum_exp
    return logp.view(batch, length), entropy.view(batch, length), lse.view(batch, length)


def run_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    needs: tuple[bool, bool, bool],
    fold: FoldGrad,
    grad_dtype: torch.dtype,
    tile_elements: int,
    min_vocab_tile: int,
    reduce_dx: ReduceGrad | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pass 2: (∂hidden [B, T, H], ∂weight [V, H], ∂bias [V]) in the inputs' dtypes; None where not needed.

    `g`, `h`: [B, T] float32 (h None when the loss does not depend on H). `grad_dtype` is the dtype dz is
    rounded to before its two GEMMs (fp32 here; the inputs' dtype on CUDA, for the tensor cores). `reduce_dx` sums
    the fp32 ∂hidden over vocabulary shards in place, before it is rounded to hidden's dtype.

    A row whose g and h are both exactly 0 (a padded token; a zero advantage without KL) adds exactly 0 to every
    gradient. How many there are is not known without reading it back to the host, so every row goes through the
    GEMMs; such a row enters as hidden = 0 with lse = +inf, hence p = 0 and dz = 0 exactly (its ∂hidden row is 0),
    whatever its hidden state and statistics hold (NaN at a padded position cannot reach ∂weight through 0·NaN).
    That costs one copy of hidden (B·T·H), which also makes a strided view flat.
    """
    batch, length, _ = hidden.shape
    active = g != 0  # NaN != 0: a NaN coefficient is kept and propagates
    if h is not None:
        active = active | (h != 0)
    x = torch.where(active.reshape(batch, length, 1), hidden, 0.0)
    lse = torch.where(active.reshape(lse.shape), lse, torch.inf)
    plan = plan_tiles(batch * length, weight.shape[0], tile_elements, min_vocab_tile)
    return _dense_grads(x, weight, bias, ids, lse, entropy, g, h, temperature, needs, fold, grad_dtype, plan, reduce_dx)


def _dense_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    needs: tuple[bool, bool, bool],
    fold: FoldGrad,
    grad_dtype: torch.dtype,
    plan: TilePlan,
    reduce_dx: ReduceGrad | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    need_x, need_w, need_b = needs
    batch, length, width = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    flat = lambda t: None if t is None else t.reshape(-1)
    ids, lse, g, h = flat(ids).long(), flat(lse), flat(g), flat(h)
    mean_z = None if h is None else lse - flat(entropy)  # Σ p·z per row
    acc = stats_dtype(hidden.dtype)  # fp32 accumulators (float64 for float64 inputs)
    dx = torch.zeros(batch * length, width, dtype=acc, device=dev) if need_x else None
    dw = torch.empty(vocab, width, dtype=weight.dtype, device=dev) if need_w else None
    db = torch.zeros(vocab, dtype=acc, device=dev) if need_b else None
    blocks = row_blocks(hidden, plan.rows)
    for v0, v1 in _vocab_tiles(vocab, plan.vocab):
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        dw_acc = None
        if need_w:  # fp32 (float64) weights accumulate in place; others through one [Vt, H] fp32 tile
            dw_acc = dw[v0:v1].zero_() if dw.dtype == acc else torch.zeros(v1 - v0, width, dtype=acc, device=dev)
        for r0, x in blocks:
            r1 = r0 + x.shape[0]
            mz, hr = (None, None) if h is None else (mean_z[r0:r1], h[r0:r1])
            z = _logits_tile(x, w, b)
            dz = fold(z, ids[r0:r1], v0, 1.0 / temperature, lse[r0:r1], mz, g[r0:r1], hr, grad_dtype)
            del z
            if need_x:
                matmul_fp32(dz, w, acc=dx[r0:r1])
            if need_w:
                matmul_fp32(dz.t(), x, acc=dw_acc)
            if need_b:
                db[v0:v1] += dz.sum(0, dtype=acc)
        if need_w and dw.dtype != acc:
            dw[v0:v1].copy_(dw_acc)
    if dx is not None and reduce_dx is not None:
        reduce_dx(dx)
    dx = None if dx is None else dx.view(batch, length, width).to(hidden.dtype)
    db = None if db is None else db.to(bias.dtype)
    return dx, dw, db


# ----------------------------------------------------------------------------------------------------------------
# The LinearBackend interface (ops/rows.py) used by fused_linear


def _fold_stats_cpu(z: torch.Tensor, ids: torch.Tensor, v0: int, inv_t: float, st: RowStats) -> None:
    """The C fold of ops/cpu_rows.py; the torch fold where the extension is not built or the tile does not fit it."""
    if not cpu_rows.fold_stats(z, ids, v0, inv_t, st):
        fold_stats_torch(z, ids, v0, inv_t, st)


def _fold_grad_cpu(
    z: torch.Tensor,
    ids: torch.Tensor,
    v0: int,
    inv_t: float,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    g: torch.Tensor,
    h: torch.Tensor | None,
    grad_dtype: torch.dtype,
) -> torch.Tensor:
    """The C fold (written over the logits tile); the torch fold where it does not apply."""
    grad = cpu_rows.fold_grad(z, ids, v0, inv_t, lse, mean_z, g, h, grad_dtype)
    return fold_grad_torch(z, ids, v0, inv_t, lse, mean_z, g, h, grad_dtype) if grad is None else grad


def stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    temperature: float,
    merge: MergeStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1 on the CPU: (logp, entropy, lse), each [B, T] float32."""
    plan = plan_tiles(hidden.shape[0] * hidden.shape[1], weight.shape[0], TILE_ELEMENTS, MIN_VOCAB_TILE)
    return run_stats(hidden, weight, bias, ids, temperature, _fold_stats_cpu, plan, merge)


def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    needs: tuple[bool, bool, bool],
    reduce_dx: ReduceGrad | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pass 2 on the CPU, with dz kept in fp32 (the CPU matmuls are fp32 anyway; float64 for float64 inputs)."""
    return run_grads(
        hidden,
        weight,
        bias,
        ids,
        lse,
        entropy,
        g,
        h,
        temperature,
        needs,
        _fold_grad_cpu,  # the C fold takes fp32 tiles; float64 ones go to the torch fold
        stats_dtype(hidden.dtype),
        TILE_ELEMENTS,
        MIN_VOCAB_TILE,
        reduce_dx,
    )
