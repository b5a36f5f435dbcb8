"""The fused-linear tile driver: ℓ, H and the gradients of hidden, weight and bias from `hidden @ weight.T + bias`
in vocabulary tiles, never holding a (B·T, V) tensor. `TileBackend` is this driver with one device kind's folds.

Pass 1 (`TileBackend.stats`): for each vocabulary tile, z = (x @ W_tileᵀ + b_tile) / τ in fp32, folded into per-row
online statistics (running max m, Σ e^{z−m}, Σ e^{z−m}·(z−m), the target's z) -> ℓ, H, lse.
Pass 2 (`TileBackend.grads`), once g = ∂loss/∂ℓ and h = ∂loss/∂H are known per row: recompute each tile, form
dz = (g·(onehot − p) − h·p·(z − Σp·z)) / τ and accumulate ∂x += dz @ W_tile, ∂W_tile = dzᵀ @ x, ∂b_tile = Σ_rows dz,
all in fp32 (float64 for float64 hidden and weight). The vocabulary is the outer loop so that ∂W needs only a
[V_tile, H] fp32 accumulator; ∂x needs a [B·T, H] one (the size of hidden itself). Rows with g = h = 0 (padding, zero
advantages) enter pass 2 as zeros (their count would need a host read): they add exactly 0.

Only the per-tile element-wise work (the folds) differs between devices: the torch and C folds of
ops/linear_folds_torch.py, the Triton folds of ops/linear_folds_triton.py (docs/fused_linear.md: why tiles of
cuBLAS GEMMs and folds, not one fused kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .backend import LinearInputs, MergeHook, ReduceHook, RowCoefficients, stats_dtype

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


@dataclass
class RowStats:
    """Per-row online softmax statistics over the vocabulary tiles seen so far, each [N] fp32 (float64 for float64
    inputs): what a stats fold updates in place."""

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


@dataclass(frozen=True)
class GradRows:
    """What a gradient fold needs per row besides the tile, each [R] (flat, views of the call's [B·T])."""

    ids: torch.Tensor  # int64 target ids (global vocabulary index; outside the tile: no one-hot)
    lse: torch.Tensor  # logsumexp of z/τ (+inf for a row that adds nothing: p = 0)
    mean_z: torch.Tensor | None  # Σ p·z/τ, given with h only
    g: torch.Tensor  # ∂loss/∂ℓ
    h: torch.Tensor | None  # ∂loss/∂H, or None when the loss does not depend on H

    def rows(self, r0: int, r1: int) -> GradRows:
        cut = lambda t: None if t is None else t[r0:r1]
        return GradRows(self.ids[r0:r1], self.lse[r0:r1], cut(self.mean_z), self.g[r0:r1], cut(self.h))


# fold_stats(z [R, Vt], ids [R], v0, 1/τ, statistics of the R rows): folds the tile into the statistics in place.
FoldStats = Callable[[torch.Tensor, torch.Tensor, int, float, RowStats], None]
# fold_grad(z [R, Vt], v0, 1/τ, rows, dtype) -> dz [R, Vt] in `dtype`: (g·(onehot − p) − h·p·(z − Σp·z)) / τ.
FoldGrad = Callable[[torch.Tensor, int, float, GradRows, torch.dtype], torch.Tensor]


@dataclass
class TileBackend:
    """A `LinearBackend` (ops/backend.py): the tile loops of this module over one device kind's folds.

    Mutable on purpose: tests lower `tile_elements` and `min_vocab_tile` to force many tiles and ragged last ones.
    """

    fold_stats: FoldStats
    fold_grad: FoldGrad
    tile_elements: int  # elements of one fp32 logits tile (rows x vocabulary)
    min_vocab_tile: int  # the vocabulary tile is a multiple of this (and at least this): no absurdly thin GEMM
    dz_in_input_dtype: bool  # dz rounded to the inputs' dtype before its GEMMs (tensor cores) or kept in fp32

    def plan(self, num_rows: int, vocab: int) -> TilePlan:
        return plan_tiles(num_rows, vocab, self.tile_elements, self.min_vocab_tile)

    def stats(
        self, inp: LinearInputs, merge: MergeHook | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pass 1: (logp, entropy, lse), each [B, T] float32 (float64 for float64 inputs); `merge` turns one
        vocabulary shard's statistics into the full vocabulary's before they are finished (ids are then shard-local
        and may lie outside the shard)."""
        batch, length, _ = inp.hidden.shape
        flat_ids = inp.ids.reshape(-1).long()
        st = RowStats.empty(batch * length, inp.hidden.device, stats_dtype(inp.hidden.dtype))
        plan = self.plan(batch * length, inp.weight.shape[0])
        blocks = row_blocks(inp.hidden, plan.rows)
        for v0, v1 in _vocab_tiles(inp.weight.shape[0], plan.vocab):
            w, b = inp.weight[v0:v1], None if inp.bias is None else inp.bias[v0:v1]
            for r0, x in blocks:
                r1 = r0 + x.shape[0]
                self.fold_stats(_logits_tile(x, w, b), flat_ids[r0:r1], v0, 1.0 / inp.temperature, st.rows(r0, r1))
        if merge is not None:
            st = merge(st)
        log_sum = torch.log(st.sum_exp)
        lse = st.max + log_sum
        logp = (st.target - st.max) - log_sum  # not target − lse: keeps ℓ ≈ 0 exact when the target dominates
        entropy = log_sum - st.sum_exp_z / st.sum_exp
        return logp.view(batch, length), entropy.view(batch, length), lse.view(batch, length)

    def grads(
        self,
        inp: LinearInputs,
        coef: RowCoefficients,
        needs: tuple[bool, bool, bool],
        reduce_dx: ReduceHook | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Pass 2: (∂hidden [B, T, H], ∂weight [V, H], ∂bias [V]) in the inputs' dtypes; None where `needs` says
        not needed. `reduce_dx` sums the fp32 ∂hidden over vocabulary shards in place, before it is rounded to
        hidden's dtype.

        A row whose g and h are both exactly 0 (a padded token; a zero advantage without KL) adds exactly 0 to
        every gradient. How many there are is not known without reading it back to the host, so every row goes
        through the GEMMs; such a row enters as hidden = 0 with lse = +inf, hence p = 0 and dz = 0 exactly (its
        ∂hidden row is 0), whatever its hidden state and statistics hold (NaN at a padded position cannot reach
        ∂weight through 0·NaN). That costs one copy of hidden (B·T·H), which also makes a strided view flat.
        """
        hidden = inp.hidden
        batch, length, width = hidden.shape
        active = coef.g != 0  # NaN != 0: a NaN coefficient is kept and propagates
        if coef.h is not None:
            active = active | (coef.h != 0)
        x = torch.where(active.reshape(batch, length, 1), hidden, 0.0)
        flat = lambda t: None if t is None else t.reshape(-1)
        lse = flat(torch.where(active.reshape(coef.lse.shape), coef.lse, torch.inf))
        rows = GradRows(
            ids=flat(inp.ids).long(),
            lse=lse,
            mean_z=None if coef.h is None else lse - flat(coef.entropy),  # Σ p·z per row
            g=flat(coef.g),
            h=flat(coef.h),
        )
        grad_dtype = hidden.dtype if self.dz_in_input_dtype else stats_dtype(hidden.dtype)
        dx, dw, db = _accumulate_grads(self, x, inp, rows, needs, grad_dtype)
        if dx is not None and reduce_dx is not None:
            reduce_dx(dx)
        dx = None if dx is None else dx.view(batch, length, width).to(hidden.dtype)
        db = None if db is None else db.to(inp.bias.dtype)
        return dx, dw, db


def _accumulate_grads(
    backend: TileBackend,
    hidden: torch.Tensor,
    inp: LinearInputs,
    rows: GradRows,
    needs: tuple[bool, bool, bool],
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pass 2's tile loops over `hidden` (the call's, inactive rows zeroed): ∂hidden [B·T, H] and ∂bias [V] in the
    accumulation dtype, ∂weight [V, H] in weight's; `dz` of each tile in `grad_dtype`."""
    need_x, need_w, need_b = needs
    weight, bias = inp.weight, inp.bias
    batch, length, width = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    acc = stats_dtype(hidden.dtype)  # fp32 accumulators (float64 for float64 inputs)
    dx = torch.zeros(batch * length, width, dtype=acc, device=dev) if need_x else None
    dw = torch.empty(vocab, width, dtype=weight.dtype, device=dev) if need_w else None
    db = torch.zeros(vocab, dtype=acc, device=dev) if need_b else None
    plan = backend.plan(batch * length, vocab)
    blocks = row_blocks(hidden, plan.rows)
    for v0, v1 in _vocab_tiles(vocab, plan.vocab):
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        dw_acc = None
        if need_w:  # fp32 (float64) weights accumulate in place; others through one [Vt, H] fp32 tile
            dw_acc = dw[v0:v1].zero_() if dw.dtype == acc else torch.zeros(v1 - v0, width, dtype=acc, device=dev)
        for r0, x in blocks:
            r1 = r0 + x.shape[0]
            z = _logits_tile(x, w, b)
            dz = backend.fold_grad(z, v0, 1.0 / inp.temperature, rows.rows(r0, r1), grad_dtype)
            del z
            if need_x:
                matmul_fp32(dz, w, acc=dx[r0:r1])
            if need_w:
                matmul_fp32(dz.t(), x, acc=dw_acc)
            if need_b:
                db[v0:v1] += dz.sum(0, dtype=acc)
        if need_w and dw.dtype != acc:
            dw[v0:v1].copy_(dw_acc)
    return dx, dw, db
