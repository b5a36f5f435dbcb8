"""The Triton row kernels of the logits path: per (b, t) row, ℓ, H and ∂logits with one read of the logits.

One program walks one row of V logits in BLOCK_V tiles with an online (max, Σe, Σe·z) recurrence in fp32; the
fused kernel then forms the per-token GRPO coefficient in registers and re-reads the row (from L2) to write the
gradient. A `RowBackend` (ops/backend.py) with the one-read fused pass; the kernels work in log2 units (exp2), the
launchers convert the row state to the shared natural-log layout.

The per-token coefficient of the token-level losses is written here in registers (`_token_coef`), because the fused
pass must form g = ∂loss/∂ℓ between its two reads of a row: one of three copies, with `loss_math.per_token_terms`
and `token_coef` in csrc/cpu_rows.c (ops/coef.py manages the set and lays out the scalars the kernel takes).
tests/ops/test_triton_rows.py holds the kernels to the float64 oracle in reference/, tests/ops/test_token_coef.py
the three copies to loss_math.

Over 400 lines on purpose: one file per algorithm (the logits path), its four kernels sharing the row scan and the
gradient store, next to the launchers that size their grids.

Precision (docs/loss.md: fp32 results within 1e-5 of float64, bf16/fp16 gradients within one ulp):
- every logit is taken relative to the raw row maximum m, z' = (x − m)/τ, never as x/τ − lse: for logits of size
  1e4 an fp32 lse alone is off by 1e-3, which would shift every probability by 1e-3;
- the target's probability mass is kept apart: the loop sums e_v over v ≠ y only, so 1 − p_y = Σ_{v≠y} e_v / Σe
  is exact for a peaked row (1 − p_y formed as a difference loses everything below 6e-8);
- H = log Σe − Σe·z'/Σe adds two non-negative terms (z' <= 0), so no cancellation either.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from ..config import LossConfig
from .backend import ROW_STATE_WIDTH, SHARD_PARTIALS_WIDTH, empty_row_state
from .coef import coef_flags, coef_scalars

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # kernels see globals only as constexpr


def _tile_shape(block_v: int, elem_bytes: int) -> tuple[int, int]:
    """(SLOTS, VEC) of a BLOCK_V tile (`_tile_offsets`): VEC logits in one 16-byte vector per slot."""
    vec = min(16 // elem_bytes, block_v)
    return block_v // vec, vec


_TILE_HEURISTICS = {
    "SLOTS": lambda a: _tile_shape(a["BLOCK_V"], a["x_ptr"].element_size())[0],
    "VEC": lambda a: _tile_shape(a["BLOCK_V"], a["x_ptr"].element_size())[1],
    "TAIL_SLOTS": lambda a: 0 if _tail_tile(a) else _tail_slots(a),
    "VECTORS": lambda a: _vectors(a),  # (defined below)
    "FMA_FRAME": lambda a: _fma_frame(a),
}


def _group(args: dict) -> int:
    """GROUP of a scan (`_scan_tile`): the slots of a tile one thread holds (SLOTS over the program's threads; at
    least 1), which its running statistics combine, so that each tile rescales one accumulator per thread."""
    slots = _tile_shape(args["BLOCK_V"], args["x_ptr"].element_size())[0]
    return max(1, slots // (32 * args.get("num_warps", 4)))


def _tail_tile(args: dict) -> bool:
    """Rows that end in a full tile overlapping the one before (TAIL_SLOTS = 0): ALIGNED rows of V >= BLOCK_V,
    V a multiple of 16, so that the last tile [V − BLOCK_V, V) is made of 16-byte vectors too. Their every tile,
    the last one included, goes through the pipelined loop; the other rows end in one masked tile of TAIL_SLOTS
    slots (`_tail_slots`, `_load_tail`), loaded before the loop and reduced after it (scalar rows: in chunks after
    it)."""
    return _ends_in_full_tile(bool(args["ALIGNED"]), args["V"], args["BLOCK_V"])


def _ends_in_full_tile(aligned: bool, vocab: int, block_v: int) -> bool:
    """`_tail_tile` from its parts: 16-byte aligned row strides, V a multiple of 16 and at least a tile."""
    return aligned and vocab % 16 == 0 and vocab >= block_v


@triton.jit
def _overlapped_start(i, n, BLOCK_V: tl.constexpr):
    """Where tile i of a row that ends in a full tile overlapping the one before (`_tail_tile`) starts: i·BLOCK_V,
    and n − BLOCK_V for the last (still a multiple of 16: n is)."""
    return tl.multiple_of(tl.minimum(i * BLOCK_V, n - BLOCK_V), 16)


def _vectors(args: dict) -> bool:
    """Rows on 16-byte vectors (ALIGNED or HEAD) of logits that start on 16 bytes: their tail tile may read the
    whole vector that holds a tail logit (`_load_tail`)."""
    return bool(args["ALIGNED"] or args["HEAD"]) and args["x_ptr"].data_ptr() % 16 == 0


def _fma_frame(args: dict) -> bool:
    """16-bit rows on 16-byte vectors take z2 = x·k2 − r as one FFMA from a per-slot fp32 reference r
    (`_scan_tile`, `_grad_tile`): one instruction less per logit where issue binds, for a register more per slot.
    fp32 rows (issue far from binding, 64-register plans) and scalar rows (16 slots per thread) keep
    z2 = (x − m)·k2. Both are exact to the same fp32 roundings."""
    return _vectors(args) and args["x_ptr"].element_size() == 2


def _tail_slots(args: dict) -> int:
    """Slots of the masked tail tile of a row that does not end in an overlapping full tile (`_tail_tile`). On
    16-byte vectors: as many vectors as its ragged tail [V − V % BLOCK_V, V) can span from a row start realigned
    down to its 16-element boundary (`HEAD`), to a power of two, so that one tile covers it (loaded before the
    loop). Scalar rows: a quarter tile, their tail scanned in chunks. At least one slot per thread (fewer would
    lay a slot's vector across lanes, and the tile's reductions would pay shuffles), at most a full tile. A
    constexpr from V: one compile per vocabulary class, not per length."""
    slots, vec = _tile_shape(args["BLOCK_V"], args["x_ptr"].element_size())
    if not _vectors(args):
        need = slots // 4
    elif args["V"] > args["BLOCK_V"]:
        need = triton.next_power_of_2(-(-(args["V"] % args["BLOCK_V"] + 15) // vec))
    else:
        need = slots
    return min(slots, max(need, 32 * args.get("num_warps", 4)))


def _words(args: dict) -> bool:
    """bf16 rows on 16-byte vectors: full tiles are read as 32-bit words (`_load_tile`). Only where the logits
    start on 16 bytes (`_vectors`): ALIGNED strides alone leave a view like x[..., 1:] 2 bytes off, and a word read
    there would be a misaligned access."""
    return args["x_ptr"].dtype == torch.bfloat16 and _vectors(args)


# ------------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _load_bt(p, i_b, i_t, stride_b, stride_t):
    """One fp32 value of a (B, T) tensor with arbitrary strides (stride 0 for an expanded per-sequence value)."""
    return tl.load(p + i_b * stride_b + i_t * stride_t).to(tl.float32)


@triton.jit
def _tile_offsets(SLOTS: tl.constexpr, VEC: tl.constexpr):
    """Offsets of one tile as [SLOTS, VEC]: a slot's VEC consecutive logits are one 16-byte vector, held by one
    thread (a thread holds SLOTS / threads slots). Reductions over axis 1 then stay inside the thread: per-slot
    accumulators, and no shuffle or barrier in the tile loop (the slots are combined once per row)."""
    return tl.arange(0, SLOTS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [SLOTS, VEC]


@triton.jit
def _widen(b_w, SLOTS: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr):
    """A tile as loaded, in fp32. WORDS (bf16 on 16-byte vectors, read as 32-bit words [SLOTS, VEC / 2]): widened
    with one shift or mask per logit (bf16 is the top half of an fp32), which the plain conversion spends more
    instructions on."""
    if WORDS:
        b_lo = (b_w << 16).to(tl.float32, bitcast=True)  # the even logit of each pair
        b_hi = (b_w & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(b_lo, b_hi), [SLOTS, VEC])
    else:
        return b_w.to(tl.float32)


@triton.jit
def _word_ptrs(p, SLOTS: tl.constexpr, VEC: tl.constexpr):
    """A tile of 2-byte logits from `p` as 32-bit word pointers [SLOTS, VEC / 2] (`_widen` splits each word)."""
    return p.to(tl.pointer_type(tl.int32), bitcast=True) + (
        tl.arange(0, SLOTS)[:, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, :]
    )


@triton.jit
def _load_tile(p, o_b, EVICT: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr):
    """One full tile [SLOTS, VEC] in fp32, unmasked; WORDS: as 32-bit words (`_widen`)."""
    if WORDS:
        b_w = tl.load(_word_ptrs(p, SLOTS, VEC), eviction_policy=EVICT)
    else:
        b_w = tl.load(p + o_b, eviction_policy=EVICT)
    return _widen(b_w, SLOTS, VEC, WORDS)


@triton.jit
def _load_tail(p, r, EVICT: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr,
               VECTORS: tl.constexpr):  # fmt: skip
    """A row's ragged tail [0, r) from `p` as one tile [SLOTS, VEC], as loaded (`_tail_logits` makes it fp32 and
    masks it). VECTORS (rows on 16-byte vectors): each vector that holds a tail logit is read whole, one instruction per
    vector. The rest of such a vector lies in the same aligned 16 bytes, so on a page the tensor touches: a read
    there cannot fault, whatever follows the row; what it holds at and past r is unspecified. Other rows are read
    logit by logit, up to r (−inf past it)."""
    if VECTORS:
        m_v = (tl.arange(0, SLOTS) * VEC < r)[:, None]  # whole vectors: one predicate per slot
        if WORDS:
            return tl.load(_word_ptrs(p, SLOTS, VEC), mask=m_v, other=0, eviction_policy=EVICT)
        else:
            return tl.load(p + _tile_offsets(SLOTS, VEC), mask=m_v, other=0.0, eviction_policy=EVICT)
    else:
        o_b = _tile_offsets(SLOTS, VEC)
        return tl.load(p + o_b, mask=o_b < r, other=float("-inf"), eviction_policy=EVICT)


@triton.jit
def _tail_logits(b_wt, r, SLOTS: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr, VECTORS: tl.constexpr):
    """A tail tile of `_load_tail` in fp32, −inf at and past the row's end r (whatever a whole vector's read left
    there; the scalar rows' masked loads give −inf there themselves)."""
    if VECTORS:
        return tl.where(_is_before(r, SLOTS, VEC), _widen(b_wt, SLOTS, VEC, WORDS), float("-inf"))
    else:
        return _widen(b_wt, SLOTS, VEC, WORDS)


@triton.jit
def _is_offset(o, SLOTS: tl.constexpr, VEC: tl.constexpr):
    """[SLOTS, VEC] mask of the one tile position `o` (an int scalar), from its (slot, element) coordinates, so
    that no per-logit offset tensor stays live in registers across the tile loop."""
    return (tl.arange(0, SLOTS)[:, None] == o // VEC) & (tl.arange(0, VEC)[None, :] == o % VEC)


@triton.jit
def _is_before(o, SLOTS: tl.constexpr, VEC: tl.constexpr):
    """[SLOTS, VEC] mask of the tile positions before `o` (an int scalar), in the separable form
    element < o − slot·VEC: VEC + SLOTS values per thread, not one index per logit held live."""
    return tl.arange(0, VEC)[None, :] < o - tl.arange(0, SLOTS)[:, None] * VEC


@triton.jit
def _scan_tile(
    b_x, v0, y, shift, b_m, b_r, b_s, b_t, k2,
    BLOCK_V: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr, HEAD: tl.constexpr, FMA_FRAME: tl.constexpr,
    GROUP: tl.constexpr = 1,
):  # fmt: skip
    """Fold one tile of fp32 logits [SLOTS, VEC] into the online (max m, reference r, Σe, Σe·z2) of its
    SLOTS / GROUP accumulators: accumulator j takes slots j, j + SLOTS / GROUP, ... (`_group`: a thread's own slots,
    so that a tile rescales one accumulator per thread, not one per slot).
    FMA_FRAME (`_fma_frame`): the sums are relative to the accumulator's reference r = m·k2 rounded to fp32 (log2
    units, `b_r`: 0 while it has seen only −inf, −inf before its first tile), so that z2 = x·k2 − r is one FFMA per
    logit, rounded once. The old sums move to a new reference by 2^(r_old − r_new): r comes out of a select, never
    a product, so no contraction (an FFMA that skips the product's rounding) can reach it, even across an unrolled
    trip, and both sides of the rescale use the same fp32 reference. Otherwise
    z2 = (x − m)·k2 and `b_r` is unused. About 7 (FMA_FRAME) or 8 instructions per logit: no select outside the
    target's tile, no -inf guard per logit (a NaN-propagating clamp of z2 at -256 instead: 2^-256 is 0 in fp32, so
    e·z2 is 0 where z2 is -inf)."""
    if HEAD:  # noqa: SIM102 (a constexpr test, then a run-time one: `and` would make both run-time)
        if v0 < shift:  # a HEAD row's first tile (or tail chunks) only: logits before the row are not the row's
            # (shift − v0, not shift: a loop-invariant mask would be hoisted and held in registers across the loop)
            b_x = tl.where(_is_before(shift - v0, SLOTS, VEC), float("-inf"), b_x)
    if (y >= v0) & (y < v0 + BLOCK_V):  # the target's own tile only: its logit is left out of the sums
        b_x = tl.where(_is_offset(y - v0, SLOTS, VEC), float("-inf"), b_x)
    b_x = tl.reshape(b_x, [GROUP, SLOTS // GROUP, VEC])  # the slots of each accumulator: a thread's own (a view)
    b_mn = tl.maximum(b_m, tl.max(tl.max(b_x, 2), 0))  # [SLOTS // GROUP]
    # How far the accumulator's old sums sink under its new reference; clamped so that an accumulator with empty
    # sums (old reference -inf) gets α = 0 and 0·d, never 0·(-inf). One that has seen only -inf has no scale yet (0).
    if FMA_FRAME:
        b_ref = b_mn * k2
        b_ref = tl.where(b_ref == float("-inf"), 0.0, b_ref)  # a select: what is carried is never a product
        b_d = tl.minimum(tl.maximum(b_r - b_ref, -256.0), 0.0)  # <= 0 but from an empty one's reference 0
        b_z = tl.fma(b_x, k2, -b_ref[None, :, None])
        b_rn = b_ref
    else:  # (x − m)·k2, relative to the accumulator's max itself
        b_rn = b_r
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_d = tl.maximum((b_m - b_ref) * k2, -256.0)
        b_z = (b_x - b_ref[None, :, None]) * k2
    b_a = tl.exp2(b_d)
    b_t = b_a * (b_t + b_d * b_s)  # Σ α e (z2 + d) = α (t + d·s)
    b_z = tl.maximum(b_z, -256.0, propagate_nan=tl.PropagateNan.ALL)
    b_e = tl.exp2(b_z)
    b_s = b_a * b_s + tl.sum(tl.sum(b_e, 2), 0)  # a NaN logit reaches the sums here and propagates
    b_t = b_t + tl.sum(tl.sum(b_e * b_z, 2), 0)
    return b_mn, b_rn, b_s, b_t


@triton.jit
def _add_pair(a0, a1, b0, b1):
    """The combine of a reduction of two sums at once (`tl.reduce` over a pair)."""
    return a0 + b0, a1 + b1


@triton.jit
def _to_row_max(b_m, b_r, b_mx, k2, FMA_FRAME: tl.constexpr):
    """log2 of the factor that takes a slot's sums (max m, reference r: `_scan_tile`) to the row's max; -inf for an
    empty slot (its sums are 0)."""
    if FMA_FRAME:
        return tl.where(b_m == float("-inf"), float("-inf"), tl.fma(-b_mx, k2, b_r))
    return (b_m - b_mx) * k2


@triton.jit
def _row_scan(
    p_a,
    y_a,
    n,
    shift,
    k2,
    BLOCK_V: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVICT: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    TARGET_FIRST: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    GROUP: tl.constexpr = 1,
):
    """Pass 1 over one row. Returns (m, log2 Σe, z2_y, q, c2, so, x_y) with z2 = (x − m)·log2(e)/τ (log2 units,
    <= 0), e = 2^z2, q = 1 − p_y = Σ_{v≠y} e / Σe, c2 = Σ p·z2 (= Σ p z' / ln 2), so = Σ_{v≠y} e (`_exact_logp`)
    and x_y the raw target logit in fp32. TARGET_FIRST: x_y is loaded before the scan (the id is in registers
    already), else after it.
    The row is [shift, n) from the aligned base `p_a` (see `_row_index`), its target at y_a. Full tiles load
    unmasked; the ragged tail is the last full tile, overlapping (`_tail_tile`), or one masked tile
    (`_load_tail`). `EVICT`: the L2 policy
    ("evict_last" when pass 2 re-reads the row right away)."""
    o_b = _tile_offsets(SLOTS, VEC)
    if TARGET_FIRST:  # the id is in registers already: the target's load waits behind the scan, not in front of it
        x_y = tl.load(p_a + y_a).to(tl.float32)
    b_m = tl.full([SLOTS // GROUP], float("-inf"), tl.float32)  # the full tiles' accumulators (`_scan_tile`)
    b_r = tl.full([SLOTS // GROUP], float("-inf"), tl.float32)  # the accumulator's reference m·k2
    b_s = tl.zeros([SLOTS // GROUP], tl.float32)  # Σ_{v≠y} e of the accumulator, relative to its reference
    b_t = tl.zeros([SLOTS // GROUP], tl.float32)  # Σ_{v≠y} e·z2 of the accumulator
    # NUM_STAGES − 1 tiles in flight (cp.async into shared memory) while one is reduced: see _pipeline.
    if TAIL_SLOTS == 0:
        # Every tile in the pipelined loop: the last one is [n − BLOCK_V, n), and drops the logits the tile before
        # it has seen (the `_scan_tile` head mask, from the tile's nominal start i·BLOCK_V).
        for i in tl.range(0, tl.cdiv(n, BLOCK_V), num_stages=NUM_STAGES):
            v0 = _overlapped_start(i, n, BLOCK_V)
            b_x = _load_tile(p_a + v0, o_b, EVICT, SLOTS, VEC, WORDS)
            b_m, b_r, b_s, b_t = _scan_tile(
                b_x, v0, y_a, i * BLOCK_V, b_m, b_r, b_s, b_t, k2, BLOCK_V, SLOTS, VEC, True, FMA_FRAME, GROUP
            )
    else:
        # A HEAD row's first tile reads the `shift` logits before the row unmasked (they are in the tensor: base >=
        # its start) and drops them in `_scan_tile`. The ragged tail [v_full, n) is one tile more, loaded before the
        # loop and scanned after it, so that its load waits behind the whole loop, not in front of the row's end.
        v_full = tl.multiple_of(n - n % BLOCK_V, BLOCK_V)  # stated: Triton 3.6 cannot tell, and the tail goes scalar
        CHUNK: tl.constexpr = TAIL_SLOTS * VEC
        if VECTORS:
            b_wt = _load_tail(p_a + v_full, n - v_full, EVICT, TAIL_SLOTS, VEC, WORDS, VECTORS)
        for v0 in tl.range(0, v_full, BLOCK_V, num_stages=NUM_STAGES):
            b_x = _load_tile(p_a + v0, o_b, EVICT, SLOTS, VEC, WORDS)
            b_m, b_r, b_s, b_t = _scan_tile(
                b_x, v0, y_a, shift, b_m, b_r, b_s, b_t, k2, BLOCK_V, SLOTS, VEC, HEAD, FMA_FRAME, GROUP
            )
        # into accumulators of the tail tile's own shape (TAIL_SLOTS slots), combined with the others below
        b_mc = tl.full([TAIL_SLOTS], float("-inf"), tl.float32)
        b_rc = tl.full([TAIL_SLOTS], float("-inf"), tl.float32)
        b_sc = tl.zeros([TAIL_SLOTS], tl.float32)
        b_tc = tl.zeros([TAIL_SLOTS], tl.float32)
        if VECTORS:  # one tile covers the tail (`_tail_slots`)
            b_xt = _tail_logits(b_wt, n - v_full, TAIL_SLOTS, VEC, WORDS, VECTORS)
            b_mc, b_rc, b_sc, b_tc = _scan_tile(
                b_xt, v_full, y_a, shift, b_mc, b_rc, b_sc, b_tc, k2, CHUNK, TAIL_SLOTS, VEC, HEAD, FMA_FRAME
            )
        else:  # scalar rows: a load per logit, in chunks loaded after the loop (in registers across it they spill)
            for c0 in tl.range(v_full, n, CHUNK, num_stages=1):
                b_wt = _load_tail(p_a + c0, n - c0, EVICT, TAIL_SLOTS, VEC, WORDS, VECTORS)
                b_xt = _tail_logits(b_wt, n - c0, TAIL_SLOTS, VEC, WORDS, VECTORS)
                b_mc, b_rc, b_sc, b_tc = _scan_tile(
                    b_xt, c0, y_a, shift, b_mc, b_rc, b_sc, b_tc, k2, CHUNK, TAIL_SLOTS, VEC, HEAD, FMA_FRAME
                )
    if not TARGET_FIRST:
        # The target's logit, read after the scan (the row is in cache): issued before the tile loop, its address
        # would wait on the id's load, and in-order issue would hold the first tile's copies behind it.
        x_y = tl.load(p_a + y_a).to(tl.float32)
    # The slots combined, once per row; the target joins the max here (its e is added back below).
    b_mr = tl.maximum(tl.max(b_m, 0), x_y)
    if TAIL_SLOTS > 0:
        b_mr = tl.maximum(b_mr, tl.max(b_mc, 0))
    b_mx = tl.where(b_mr == float("-inf"), 0.0, b_mr)
    # Each slot's sums, from its reference to the row's max: with FMA_FRAME d = r − m·k2 in one rounding (an
    # FFMA), so that the sums below are relative to the exact m·k2 whatever the slots' references rounded to.
    b_d = tl.maximum(_to_row_max(b_m, b_r, b_mx, k2, FMA_FRAME), -256.0)
    b_w = tl.exp2(b_d)
    # Σ_{v≠y} e and Σ_{v≠y} e·z2, relative to the row max: one reduction of the pair (one exchange between warps)
    b_so, b_to = tl.reduce((b_w * b_s, b_w * (b_t + b_d * b_s)), 0, _add_pair)
    if FMA_FRAME:  # the references need m·k2 in fp32: a row whose max is beyond it (|x|/τ above ~2e38) is NaN
        b_so = tl.where(tl.abs(b_mx * k2) == float("inf"), float("nan"), b_so)
    if TAIL_SLOTS > 0:
        b_dc = tl.maximum(_to_row_max(b_mc, b_rc, b_mx, k2, FMA_FRAME), -256.0)
        b_wc = tl.exp2(b_dc)
        b_soc, b_toc = tl.reduce((b_wc * b_sc, b_wc * (b_tc + b_dc * b_sc)), 0, _add_pair)
        b_so += b_soc
        b_to += b_toc
    return _with_target(b_mx, b_so, b_to, x_y, k2)


@triton.jit
def _with_target(b_mx, b_so, b_to, x_y, k2):
    """`_row_scan`'s result from the row max m, the sums over v ≠ y relative to it (Σe, Σe·z2) and the raw target
    logit x_y: its e joins the sums here."""
    b_zy = (x_y - b_mx) * k2
    b_ey = tl.exp2(b_zy)
    b_s = b_so + b_ey
    b_t = b_to + b_ey * tl.where(b_ey > 0, b_zy, 0.0)
    return b_mx, tl.log2(b_s), b_zy, b_so / b_s, b_t / b_s, b_so, x_y


@triton.jit
def _slice_scan(
    p_a, y_a, n, t0, t1, k2, BLOCK_V: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, WORDS: tl.constexpr, FMA_FRAME: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """Pass 1 over tiles [t0, t1) of a row that ends in an overlapping full tile (`_tail_tile`), as `_row_scan`
    scans them: (max m_q of the slice's logits but the target, Σ_{v≠y} e and Σ_{v≠y} e·z2 relative to m_q). A
    slice with no logit but −inf (or none at all) gives (−inf, 0, 0)."""
    o_b = _tile_offsets(SLOTS, VEC)
    b_m = tl.full([SLOTS // GROUP], float("-inf"), tl.float32)
    b_r = tl.full([SLOTS // GROUP], float("-inf"), tl.float32)
    b_s = tl.zeros([SLOTS // GROUP], tl.float32)
    b_t = tl.zeros([SLOTS // GROUP], tl.float32)
    for i in tl.range(t0, t1, num_stages=NUM_STAGES):
        v0 = _overlapped_start(i, n, BLOCK_V)
        b_x = _load_tile(p_a + v0, o_b, "evict_last", SLOTS, VEC, WORDS)
        b_m, b_r, b_s, b_t = _scan_tile(
            b_x, v0, y_a, i * BLOCK_V, b_m, b_r, b_s, b_t, k2, BLOCK_V, SLOTS, VEC, True, FMA_FRAME, GROUP
        )
    b_mq = tl.max(b_m, 0)
    b_ref = tl.where(b_mq == float("-inf"), 0.0, b_mq)
    b_d = tl.maximum(_to_row_max(b_m, b_r, b_ref, k2, FMA_FRAME), -256.0)
    b_w = tl.exp2(b_d)
    b_sq, b_tq = tl.reduce((b_w * b_s, b_w * (b_t + b_d * b_s)), 0, _add_pair)
    return b_mq, b_sq, b_tq


@triton.jit
def _stamp(b_v):
    """An fp32 value as the int64 word a row split exchanges: its bits, and 1 above them (the workspace starts at
    0, so a word is either whole or absent: one 64-bit atomic store, one 64-bit volatile load)."""
    return b_v.to(tl.uint32, bitcast=True).to(tl.int64) | 4294967296


@triton.jit
def _unstamp(w):
    return (w & 4294967295).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _split_row_scan(
    p_a, y_a, n, ws, part, k2, BLOCK_V: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, WORDS: tl.constexpr, FMA_FRAME: tl.constexpr, SPLIT: tl.constexpr,
    SPIN: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """`_row_scan` (TAIL_SLOTS = 0 rows) for one of the SPLIT programs that share a row, `part` of them: it scans
    its own slice of the row's tiles (`_slice_scan`) and publishes the slice's (m_q, Σe, Σe·z2) at `ws` (3 int64
    words per slice, `_stamp`), then reads every other slice's from there at once, polling up to SPIN more times.
    The slices not there by then (their program not resident yet; or the interpreter, which runs the programs one
    after the other) it scans itself, one by one, and publishes too: the same code on the same tiles gives the same
    bits, so the row's statistics do not depend on who computed what, and every program of the row combines the
    slices in one order, so all of them store the same gradient and none waits on a program that cannot run."""
    x_y = tl.load(p_a + y_a).to(tl.float32)  # first, as `_row_scan`'s TARGET_FIRST: awaited after the exchange
    nt = tl.cdiv(n, BLOCK_V)
    SP2: tl.constexpr = triton.next_power_of_2(SPLIT)
    o_q = tl.arange(0, SP2)
    b_pm = tl.full([SP2], float("-inf"), tl.float32)  # each slice's (m_q, Σe, Σe·z2), once known
    b_ps = tl.zeros([SP2], tl.float32)
    b_pt = tl.zeros([SP2], tl.float32)
    b_done = o_q >= SPLIT
    polled = part < 0  # a run-time False
    q = part
    while q >= 0:  # its own slice, then those nobody published (none, when the programs are resident together)
        b_mq, b_sq, b_tq = _slice_scan(
            p_a, y_a, n, q * nt // SPLIT, (q + 1) * nt // SPLIT, k2, BLOCK_V, SLOTS, VEC, NUM_STAGES, WORDS,
            FMA_FRAME, GROUP,
        )  # fmt: skip
        # relaxed atomic stores (strong, as the other programs' polls; no order among them) of a 4-word block, one
        # thread per word, where a scalar atomic would be issued by every thread
        o_w = tl.arange(0, 4)
        w_q = tl.where(o_w == 0, _stamp(b_mq), tl.where(o_w == 1, _stamp(b_sq), _stamp(b_tq)))
        tl.atomic_xchg(ws + q * 3 + o_w, w_q, mask=o_w < 3, sem="relaxed")
        b_pm = tl.where(o_q == q, b_mq, b_pm)
        b_ps = tl.where(o_q == q, b_sq, b_ps)
        b_pt = tl.where(o_q == q, b_tq, b_pt)
        b_done = b_done | (o_q == q)
        if not polled:  # the other slices, all at once: one L2 round trip when they are there
            p_w = ws + o_q * 3
            w_m = tl.load(p_w, mask=~b_done, other=0, volatile=True)
            w_s = tl.load(p_w + 1, mask=~b_done, other=0, volatile=True)
            w_t = tl.load(p_w + 2, mask=~b_done, other=0, volatile=True)
            b_in = ((w_m >> 32) + (w_s >> 32) + (w_t >> 32) == 3) | b_done
            spins = 0
            while (tl.min(b_in.to(tl.int32), 0) == 0) & (spins < SPIN):
                w_m = tl.load(p_w, mask=~b_done, other=0, volatile=True)
                w_s = tl.load(p_w + 1, mask=~b_done, other=0, volatile=True)
                w_t = tl.load(p_w + 2, mask=~b_done, other=0, volatile=True)
                b_in = ((w_m >> 32) + (w_s >> 32) + (w_t >> 32) == 3) | b_done
                spins += 1
            b_got = b_in & ~b_done
            b_pm = tl.where(b_got, _unstamp(w_m), b_pm)
            b_ps = tl.where(b_got, _unstamp(w_s), b_ps)
            b_pt = tl.where(b_got, _unstamp(w_t), b_pt)
            b_done = b_in
            polled = part >= 0
        q = tl.min(tl.where(b_done, SP2, o_q), 0)
        q = tl.where(q < SP2, q, -1)
    # The slices combined as `_row_scan` combines its slots (one order in every program of the row)
    b_mr = tl.maximum(tl.max(b_pm, 0), x_y)
    b_mx = tl.where(b_mr == float("-inf"), 0.0, b_mr)
    b_d = tl.maximum((b_pm - b_mx) * k2, -256.0)
    b_w = tl.exp2(b_d)
    b_so, b_to = tl.reduce((b_w * b_ps, b_w * (b_pt + b_d * b_ps)), 0, _add_pair)
    if FMA_FRAME:
        b_so = tl.where(tl.abs(b_mx * k2) == float("inf"), float("nan"), b_so)
    return _with_target(b_mx, b_so, b_to, x_y, k2)


@triton.jit
def _grad_tile(b_x, v0, y, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
               SLOTS: tl.constexpr, VEC: tl.constexpr, FMA_FRAME: tl.constexpr):  # fmt: skip
    """∂logits of one tile, already divided by τ: p·(gn + hn·z2) with gn = (h·ln2·c2 − g)/τ and hn = −h·ln2/τ,
    and the target's own value `b_dy` (a scalar of the row) in the target's tile only. z2 is relative to the row's
    reference `b_rx`, and p = 2^(z2 − L) with L = log2 Σe relative to it: `_grad_constants` gives gn·2^−L `b_gr` and
    hn·2^−L `b_hr`, so that a logit's gradient is 2^z2·(b_gr + b_hr·z2), no subtraction per logit. With FMA_FRAME
    z2 = x·k2 − r, one FFMA; else z2 = (x − m)·k2."""
    b_z = tl.fma(b_x, k2, -b_rx) if FMA_FRAME else (b_x - b_rx) * k2
    if HAS_ENT:
        # Where p == 0 (z2 below -149, -inf padding) the centered term is p·(…) = 0, not 0·(−inf); NaN stays NaN.
        b_z = tl.maximum(b_z, -256.0, propagate_nan=tl.PropagateNan.ALL)
        b_d = tl.exp2(b_z) * (b_gr + b_hr * b_z)
    else:
        b_d = tl.exp2(b_z) * b_gr
    if (y >= v0) & (y < v0 + BLOCK_V):  # the target's own tile only
        b_d = tl.where(_is_offset(y - v0, SLOTS, VEC), b_dy, b_d)
    return b_d


@triton.jit
def _grad_constants(b_mx, b_log2s, b_gn, b_hn, k2, FMA_FRAME: tl.constexpr):
    """(reference r, gn·2^−L, hn·2^−L) of a row for `_grad_tile`, L = log2 Σe relative to r (2^−L is at least 1/V:
    Σe counts the max's 1). FMA_FRAME: r = m·k2 in fp32; the sums of pass 1 are relative to the exact m·k2 = r + δ,
    δ exact from one FFMA. Else r is the max m itself."""
    b_rx, b_lr, b_gr = b_mx, b_log2s, b_gn
    if FMA_FRAME:
        b_rx = b_mx * k2
        b_dl = tl.fma(b_mx, k2, -b_rx)  # δ = m·k2 − r, exact
        b_lr = b_log2s + b_dl
        b_gr = b_gn - b_hn * b_dl
    b_c = tl.exp2(-b_lr)
    return b_rx, b_gr * b_c, b_hn * b_c


@triton.jit
def _pass2_tile(j, first, nt, ROTATE: tl.constexpr):
    """Which of the row's nt tiles pass 2 takes j-th. ROTATE: from tile `first` to the row's last, then from its
    first (`pass2_window`: the tiles pass 1 read last are re-read first, while L2 still holds them); else tile j."""
    if ROTATE:
        i = j + first
        return tl.where(i >= nt, i - nt, i)
    return j


@triton.jit
def _grad_tile_store(p_a, p_oa, o_b, v0, head, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT: tl.constexpr,
                     BLOCK_V: tl.constexpr, SLOTS: tl.constexpr, VEC: tl.constexpr, HEAD: tl.constexpr,
                     WORDS: tl.constexpr, FMA_FRAME: tl.constexpr):  # fmt: skip
    """One full tile of pass 2 at v0: read, its gradient (`_grad_tile`), stored but for the positions before `head`
    where HEAD (`_store_tile`)."""
    b_x = _load_tile(p_a + v0, o_b, "evict_first", SLOTS, VEC, WORDS)
    b_d = _grad_tile(b_x, v0, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, BLOCK_V, SLOTS, VEC, FMA_FRAME)
    _store_tile(p_oa + v0 + o_b, b_d.to(p_oa.dtype.element_ty), v0, head, SLOTS, VEC, HEAD)


@triton.jit
def _row_grad_store(
    p_a,
    p_oa,
    y_a,
    n,
    shift,
    window,
    k2,
    inv_tau,
    b_mx,
    b_log2s,
    b_zy,
    b_q,
    b_c2,
    b_g,
    b_h,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    ROTATE: tl.constexpr,
    part=0,
    SPLIT: tl.constexpr = 1,
):
    """Pass 2: out[v] = (g·(onehot − p) − h·p·(z' − Σpz')) / τ, tile by tile, over [shift, n) from the aligned
    bases `p_a` (logits) and `p_oa` (out) as in `_row_scan` (the stores leave [0, shift) alone). Each tile is
    read before it is written, so the out may be the logits themselves. A row with g = h = 0 (a masked token) takes one
    uniform branch that stores zeros without reading its logits, so a NaN row stays out of the gradient (the RowBackend
    contract). Loads and stores stream past L2 (evict_first): nothing reads them again soon. ROTATE: the full tiles
    in the order of `_pass2_tile`, the row's last `window` of them first (the ragged tail tile stays where it is).
    SPLIT > 1 (rows ending in an overlapping tile only): the tiles of slice `part` of the row (`_split_row_scan`),
    the window of them from the slice's end."""
    o_b = _tile_offsets(SLOTS, VEC)
    b_live = b_g != 0.0
    if HAS_ENT:
        b_live = b_live | (b_h != 0.0)
    if TAIL_SLOTS > 0:  # the ragged tail as in `_row_scan`: one tile loaded before the loop, or scalar chunks
        v_full = tl.multiple_of(n - n % BLOCK_V, BLOCK_V)  # stated: Triton 3.6 cannot tell, else scalar tails
        CHUNK: tl.constexpr = TAIL_SLOTS * VEC
    if b_live:
        b_hs = b_h * LN2 * inv_tau
        b_gn = b_hs * b_c2 - b_g * inv_tau
        b_hn = -b_hs
        # The target: (g·q − h·p_y·(z'_y − Σpz'))/τ, with q = 1 − p_y exact from pass 1
        b_dy = b_g * b_q * inv_tau
        if HAS_ENT:
            b_zyc = tl.maximum(b_zy, -256.0, propagate_nan=tl.PropagateNan.ALL)
            b_dy -= tl.exp2(b_zyc - b_log2s) * (b_hs * (b_zyc - b_c2))
        b_rx, b_gr, b_hr = _grad_constants(b_mx, b_log2s, b_gn, b_hn, k2, FMA_FRAME)
        if TAIL_SLOTS == 0:  # every tile pipelined, the last one overlapping: its head is not stored again
            nt = tl.cdiv(n, BLOCK_V)
            t0 = 0
            if SPLIT > 1:
                t0 = part * nt // SPLIT
                nt = (part + 1) * nt // SPLIT - t0
            first = tl.maximum(nt - window, 0)
            for j in tl.range(0, nt, num_stages=NUM_STAGES):
                i = t0 + _pass2_tile(j, first, nt, ROTATE)
                _grad_tile_store(
                    p_a, p_oa, o_b, _overlapped_start(i, n, BLOCK_V), i * BLOCK_V, y_a, b_rx, b_dy, b_gr, b_hr,
                    k2, HAS_ENT, BLOCK_V, SLOTS, VEC, True, WORDS, FMA_FRAME,
                )  # fmt: skip
        else:
            if VECTORS:
                b_wt = _load_tail(p_a + v_full, n - v_full, "evict_first", TAIL_SLOTS, VEC, WORDS, VECTORS)
            if ROTATE:
                nt = v_full // BLOCK_V
                first = tl.maximum(nt - window, 0)
                for j in tl.range(0, nt, num_stages=NUM_STAGES):
                    v0 = tl.multiple_of(_pass2_tile(j, first, nt, ROTATE) * BLOCK_V, BLOCK_V)
                    _grad_tile_store(
                        p_a, p_oa, o_b, v0, shift, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, BLOCK_V, SLOTS,
                        VEC, HEAD, WORDS, FMA_FRAME,
                    )  # fmt: skip
            else:  # this loop's form: with the index loop above, row_grad_kernel's plain path spills at 255 registers
                for v0 in tl.range(0, v_full, BLOCK_V, num_stages=NUM_STAGES):
                    _grad_tile_store(
                        p_a, p_oa, o_b, v0, shift, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, BLOCK_V, SLOTS,
                        VEC, HEAD, WORDS, FMA_FRAME,
                    )  # fmt: skip
            if VECTORS:
                _tail_grad_store(
                    b_wt, p_oa, v_full, n, shift, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, TAIL_SLOTS, VEC,
                    WORDS, FMA_FRAME,
                )  # fmt: skip
            else:
                for c0 in tl.range(v_full, n, CHUNK, num_stages=1):
                    b_wt = _load_tail(p_a + c0, n - c0, "evict_first", TAIL_SLOTS, VEC, WORDS, VECTORS)
                    _tail_grad_store(
                        b_wt, p_oa, c0, n, shift, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, TAIL_SLOTS, VEC,
                        WORDS, FMA_FRAME,
                    )  # fmt: skip
    else:
        b_zero = tl.zeros([SLOTS, VEC], p_oa.dtype.element_ty)
        if TAIL_SLOTS == 0:  # zeros over the overlap again: nothing else is written there
            nt = tl.cdiv(n, BLOCK_V)
            t0 = 0
            t1 = nt
            if SPLIT > 1:
                t0 = part * nt // SPLIT
                t1 = (part + 1) * nt // SPLIT
            for i in tl.range(t0, t1, num_stages=1):
                v0 = _overlapped_start(i, n, BLOCK_V)
                tl.store(p_oa + v0 + o_b, b_zero, eviction_policy="evict_first")
        else:
            for v0 in tl.range(0, v_full, BLOCK_V, num_stages=1):
                _store_tile(p_oa + v0 + o_b, b_zero, v0, shift, SLOTS, VEC, HEAD)
            b_zt = tl.zeros([TAIL_SLOTS, VEC], p_oa.dtype.element_ty)
            for c0 in tl.range(v_full, n, CHUNK, num_stages=1):  # one trip on 16-byte vectors
                m_t = _is_before(n - c0, TAIL_SLOTS, VEC) & ~_is_before(shift - c0, TAIL_SLOTS, VEC)
                tl.store(p_oa + c0 + _tile_offsets(TAIL_SLOTS, VEC), b_zt, mask=m_t, eviction_policy="evict_first")


@triton.jit
def _tail_grad_store(
    b_wt, p_oa, c0, n, shift, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT: tl.constexpr,
    TAIL_SLOTS: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr, FMA_FRAME: tl.constexpr,
):  # fmt: skip
    """The gradient of a tail tile at c0 (as `_load_tail` loaded it), stored up to the row's end n, and not over
    a HEAD row's head [0, shift)."""
    b_d = _grad_tile(
        _widen(b_wt, TAIL_SLOTS, VEC, WORDS), c0, y_a, b_rx, b_dy, b_gr, b_hr, k2, HAS_ENT, TAIL_SLOTS * VEC,
        TAIL_SLOTS, VEC, FMA_FRAME,
    )  # fmt: skip
    m_t = _is_before(n - c0, TAIL_SLOTS, VEC) & ~_is_before(shift - c0, TAIL_SLOTS, VEC)
    tl.store(p_oa + c0 + _tile_offsets(TAIL_SLOTS, VEC), b_d.to(p_oa.dtype.element_ty), mask=m_t,
             eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _store_tile(p, b, v0, shift, SLOTS: tl.constexpr, VEC: tl.constexpr, HEAD: tl.constexpr):
    """One full tile's streaming store; a HEAD row's first tile leaves the `shift` positions before the row alone."""
    if HEAD:
        if v0 < shift:
            tl.store(p, b, mask=~_is_before(shift - v0, SLOTS, VEC), eviction_policy="evict_first")
        else:
            tl.store(p, b, eviction_policy="evict_first")
    else:
        tl.store(p, b, eviction_policy="evict_first")


@triton.jit
def _load_row_value(p, i_b, i_t, stride_b, stride_t, live):
    return tl.load(p + i_b * stride_b + i_t * stride_t, mask=live, other=0).to(tl.float32)


@triton.jit
def _load_row_inputs(
    i_r, N, T, y_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rho_ptr, hw_ptr, stride_yb, stride_yt, stride_ab, stride_at,
    stride_wb, stride_wt, stride_oldb, stride_oldt, stride_refb, stride_reft, stride_rhob, stride_rhot, stride_hwb,
    stride_hwt, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_RATIO: tl.constexpr, HAS_ENT: tl.constexpr,
):  # fmt: skip
    """The fused kernel's inputs of row i_r: the target id (int32) and the per-token values in fp32 (advantage,
    weight, ℓ_old, ℓ_ref, ρ, entropy weight; the defaults where a flag is off); zeros for a row past the last."""
    i_b = tl.cast(i_r, tl.int64) // T
    i_t = tl.cast(i_r, tl.int64) % T
    live = i_r < N
    y = tl.load(y_ptr + i_b * stride_yb + i_t * stride_yt, mask=live, other=0).to(tl.int32)
    b_adv = _load_row_value(adv_ptr, i_b, i_t, stride_ab, stride_at, live)
    b_w = _load_row_value(w_ptr, i_b, i_t, stride_wb, stride_wt, live)
    b_old = 0.0
    if HAS_OLD:
        b_old = _load_row_value(old_ptr, i_b, i_t, stride_oldb, stride_oldt, live)
    b_lref = 0.0
    if HAS_REF:
        b_lref = _load_row_value(ref_ptr, i_b, i_t, stride_refb, stride_reft, live)
    b_rho = 1.0
    if HAS_RATIO:
        b_rho = _load_row_value(rho_ptr, i_b, i_t, stride_rhob, stride_rhot, live)
    b_h = 0.0
    if HAS_ENT:
        b_h = _load_row_value(hw_ptr, i_b, i_t, stride_hwb, stride_hwt, live)
    return y, b_adv, b_w, b_old, b_lref, b_rho, b_h


@triton.jit
def _row_index(i_r, T):
    """(row, b, t), all int64 (B·T·V exceeds 2^31)."""
    i_row = tl.cast(i_r, tl.int64)
    return i_row, i_row // T, i_row % T


# The tiles of a row at offset o start at o − shift, a multiple of 16 elements, so that their loads and stores
# are 16-byte vectors (strides are not specialized: the multiple_of hint is ours). ALIGNED rows have shift 0; a
# HEAD row (a vocabulary that is no multiple of 16, V = 50257) starts `shift` elements into its first tile, which
# is masked; otherwise (neither) the loads are scalar. Written out in each kernel: the hint does not survive a
# helper's return.


@triton.heuristics(
    {
        "ALIGNED": lambda a: _aligned(a["stride_xb"], a["stride_xt"]),
        "HEAD": lambda a: _realigns(a, "x_ptr"),
        "WORDS": _words,
        **_TILE_HEURISTICS,
        "GROUP": _group,
        "NUM_STAGES": lambda a: _launch_plan(a, two_pass=False)[0],
        "maxnreg": lambda a: _launch_plan(a, two_pass=False)[1],
    }
)
@triton.jit(do_not_specialize=["N", "T", "stride_xb", "stride_xt", "stride_yb", "stride_yt"])
def row_stats_fwd_kernel(
    x_ptr,  # [B, T, V] logits
    y_ptr,  # [B, T] ids
    logp_ptr,  # [B, T] fp64, contiguous
    ent_ptr,  # [B, T] fp32, contiguous
    state_ptr,  # [B, T, 4] fp32, contiguous
    N,  # B·T
    T,
    V,
    stride_xb,
    stride_xt,
    stride_yb,
    stride_yt,
    k2,  # log2(e) / τ
    inv_tau,  # fp32(1/τ)
    inv_tau_lo,  # 1/τ − fp32(1/τ): with inv_tau, 1/τ to about 48 bits for the fp64 ℓ
    BLOCK_V: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    for i_r in range(tl.program_id(0), N, tl.num_programs(0)):  # persistent: rows i, i + grid, ...
        i_row, i_b, i_t = _row_index(i_r, T)
        o_x = i_b * stride_xb + i_t * stride_xt  # here, not in a helper: Triton 3.6 drops a hint on a call's result
        shift = 0
        o_a = o_x
        if ALIGNED:
            o_a = tl.multiple_of(o_x, 16)
        if HEAD:
            shift = (o_x % 16).to(tl.int32)  # int32: the row's indices and masks stay 32-bit
            o_a = tl.multiple_of(o_x - shift, 16)
        y = tl.load(y_ptr + i_b * stride_yb + i_t * stride_yt).to(tl.int32)
        b_mx, b_log2s, _, b_q, b_c2, b_so, x_y = _row_scan(
            x_ptr + o_a,
            y + shift,
            V + shift,
            shift,
            k2,
            BLOCK_V,
            SLOTS,
            VEC,
            TAIL_SLOTS,
            VECTORS,
            NUM_STAGES,
            "evict_first",
            HEAD,
            WORDS,
            False,
            FMA_FRAME,
            GROUP,
        )  # read once
        tl.store(logp_ptr + i_row, _exact_logp(x_y, b_mx, b_so, inv_tau, inv_tau_lo))  # fp64
        tl.store(ent_ptr + i_row, (b_log2s - b_c2) * LN2)
        p_s = state_ptr + i_row * 4
        tl.store(p_s, b_mx)
        tl.store(p_s + 1, b_log2s)
        tl.store(p_s + 2, b_q)
        tl.store(p_s + 3, b_c2)


@triton.heuristics(
    {
        "HAS_ENT": lambda a: a["h_ptr"] is not None,
        "ALIGNED": lambda a: _aligned(a["stride_xb"], a["stride_xt"], a["stride_ob"], a["stride_ot"]),
        "HEAD": lambda a: _realigns(a, "x_ptr", "out_ptr"),
        "WORDS": _words,
        **_TILE_HEURISTICS,
        "NUM_STAGES": lambda a: _launch_plan(a, two_pass=False)[0],
        "maxnreg": lambda a: _launch_plan(a, two_pass=False)[1],
    }
)
@triton.jit(
    do_not_specialize=[
        "N", "T", "stride_xb", "stride_xt", "stride_ob", "stride_ot", "stride_yb", "stride_yt",
        "stride_gb", "stride_gt", "stride_hb", "stride_ht",
    ]
)  # fmt: skip
def row_grad_kernel(
    x_ptr,  # [B, T, V] logits
    y_ptr,  # [B, T] ids
    state_ptr,  # [B, T, 4] from row_stats_fwd_kernel
    g_ptr,  # [B, T] ∂/∂ℓ
    h_ptr,  # [B, T] ∂/∂H, or None
    out_ptr,  # [B, T, V], may alias x_ptr
    N,
    T,
    V,
    stride_xb,
    stride_xt,
    stride_ob,
    stride_ot,
    stride_yb,
    stride_yt,
    stride_gb,
    stride_gt,
    stride_hb,
    stride_ht,
    k2,
    inv_tau,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    for i_r in range(tl.program_id(0), N, tl.num_programs(0)):  # persistent: rows i, i + grid, ...
        i_row, i_b, i_t = _row_index(i_r, T)
        o_x = i_b * stride_xb + i_t * stride_xt  # here, not in a helper: Triton 3.6 drops a hint on a call's result
        shift = 0
        o_a = o_x
        if ALIGNED:
            o_a = tl.multiple_of(o_x, 16)
        if HEAD:
            shift = (o_x % 16).to(tl.int32)  # int32: the row's indices and masks stay 32-bit
            o_a = tl.multiple_of(o_x - shift, 16)
        o_oa = i_b * stride_ob + i_t * stride_ot  # the same shift as the logits' (`_realigns`)
        if ALIGNED:
            o_oa = tl.multiple_of(o_oa, 16)
        if HEAD:
            o_oa = tl.multiple_of(o_oa - shift, 16)
        y = tl.load(y_ptr + i_b * stride_yb + i_t * stride_yt).to(tl.int32)
        p_s = state_ptr + i_row * 4
        b_mx = tl.load(p_s)
        b_log2s = tl.load(p_s + 1)
        b_q = tl.load(p_s + 2)
        b_c2 = tl.load(p_s + 3)
        b_g = _load_bt(g_ptr, i_b, i_t, stride_gb, stride_gt)
        b_h = 0.0
        b_zy = 0.0
        if HAS_ENT:
            b_h = _load_bt(h_ptr, i_b, i_t, stride_hb, stride_ht)
            # z2 of the target for its entropy term; a shard-local id outside [0, V) has none (p_y = 0)
            b_xy = tl.load(x_ptr + o_x + y, mask=(y >= 0) & (y < V), other=float("-inf")).to(tl.float32)
            b_zy = (b_xy - b_mx) * k2
        _row_grad_store(
            x_ptr + o_a, out_ptr + o_oa, y + shift, V + shift, shift, 0, k2, inv_tau, b_mx, b_log2s, b_zy, b_q,
            b_c2, b_g, b_h, HAS_ENT, BLOCK_V, SLOTS, VEC, TAIL_SLOTS, VECTORS, NUM_STAGES, HEAD, WORDS,
            FMA_FRAME, False,
        )  # fmt: skip


@triton.heuristics(
    {
        "ALIGNED": lambda a: _aligned(a["stride_xb"], a["stride_xt"]),
        "HEAD": lambda a: _realigns(a, "x_ptr"),
        "WORDS": _words,
        **_TILE_HEURISTICS,
        "GROUP": _group,
        "NUM_STAGES": lambda a: _launch_plan(a, two_pass=False)[0],
        "maxnreg": lambda a: _launch_plan(a, two_pass=False)[1],
    }
)
@triton.jit(do_not_specialize=["N", "T", "offset", "stride_xb", "stride_xt", "stride_yb", "stride_yt"])
def shard_partials_fwd_kernel(
    x_ptr,  # [B, T, V] logits of one vocabulary shard [offset, offset + V)
    y_ptr,  # [B, T] global ids
    parts_ptr,  # [B, T, 5] fp32, contiguous: see shard_partials
    N,
    T,
    V,
    offset,
    stride_xb,
    stride_xt,
    stride_yb,
    stride_yt,
    k2,
    BLOCK_V: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    for i_r in range(tl.program_id(0), N, tl.num_programs(0)):  # persistent: rows i, i + grid, ...
        i_row, i_b, i_t = _row_index(i_r, T)
        o_x = i_b * stride_xb + i_t * stride_xt  # here, not in a helper: Triton 3.6 drops a hint on a call's result
        shift = 0
        o_a = o_x
        if ALIGNED:
            o_a = tl.multiple_of(o_x, 16)
        if HEAD:
            shift = (o_x % 16).to(tl.int32)  # int32: the row's indices and masks stay 32-bit
            o_a = tl.multiple_of(o_x - shift, 16)
        y = tl.load(y_ptr + i_b * stride_yb + i_t * stride_yt).to(tl.int64) - offset
        inside = (y >= 0) & (y < V)
        # A target outside the shard: scan with column 0 as a stand-in target. The scan's max, Σe and Σp·z2 cover
        # every column either way; only its ℓ and 1 − p_y refer to the target, and those are not used then.
        y_in = tl.where(inside, y, 0).to(tl.int32)
        b_mx, b_log2s, _, b_q, b_c2, _, x_y = _row_scan(
            x_ptr + o_a,
            y_in + shift,
            V + shift,
            shift,
            k2,
            BLOCK_V,
            SLOTS,
            VEC,
            TAIL_SLOTS,
            VECTORS,
            NUM_STAGES,
            "evict_first",
            HEAD,
            WORDS,
            False,
            FMA_FRAME,
            GROUP,
        )  # read once
        b_s = tl.exp2(b_log2s)
        b_live = b_s > 0  # False for an all −inf shard row (padded vocabulary): it must add nothing to the merge
        p_p = parts_ptr + i_row * 5
        tl.store(p_p, tl.where(b_live, b_mx, float("-inf")))
        tl.store(p_p + 1, b_s)
        tl.store(p_p + 2, tl.where(b_live, b_s * b_c2 * LN2, 0.0))  # Σ e·z', z' = (x − m)/τ
        tl.store(p_p + 3, tl.where(inside, x_y, float("-inf")))
        tl.store(p_p + 4, tl.where(inside, tl.where(b_live, b_q * b_s, 0.0), b_s))  # Σ_{v≠y} e


@triton.jit
def _target_z64(x_y, b_mx, inv_tau, inv_tau_lo):
    """z'_y = (x_y − m)/τ in fp64 from the raw target logit (`_row_scan`'s, fp32: exact for every logits dtype)."""
    b_xy = x_y.to(tl.float64)
    b_inv = tl.cast(inv_tau, tl.float64) + tl.cast(inv_tau_lo, tl.float64)
    return (b_xy - tl.cast(b_mx, tl.float64)) * b_inv


@triton.jit
def _exact_logp(x_y, b_mx, b_so, inv_tau, inv_tau_lo):
    """ℓ in fp64 (ops/backend.py, "ℓ in float64"): z'_y = (x_y − m)/τ and e_y = exp(z'_y) from the raw target logit
    and the raw max m, then ℓ = z'_y − log(Σ_{v≠y} e + e_y). Exact to the
    rounding of the fp32 sum `b_so` of the other tokens (a few 1e-8 absolute) for any |ℓ|; near ℓ = 0 (a peaked row)
    the fp64 log keeps 1e-16 absolute. 1/τ = inv_tau + inv_tau_lo."""
    b_zy = _target_z64(x_y, b_mx, inv_tau, inv_tau_lo)
    return b_zy - tl.log(tl.cast(b_so, tl.float64) + tl.exp(b_zy))


@triton.jit
def _exact_logp_from_log2s(x_y, b_mx, b_log2s, inv_tau, inv_tau_lo):
    """The fused kernel's ℓ in fp64: (x_y − m)/τ − s with s = ln 2 · log2 Σe taken from its fp32 value, so exact to
    s's fp32 rounding (about 5e-7 absolute at s ≈ 10) for any |ℓ|. `_exact_logp`'s fp64 exp and log would cost the
    8-warp fused kernel (V <= 32768) 8 bytes of spills at its 80-register cap on sm_90a."""
    b_zy = _target_z64(x_y, b_mx, inv_tau, inv_tau_lo)
    return b_zy - tl.cast(b_log2s, tl.float64) * 0.6931471805599453


# One of the coefficient's three copies (ops/coef.py): loss_math.per_token_terms defines it, token_coef in
# csrc/cpu_rows.c is the C one. Any change to loss_math's token-level math is made in all three.
@triton.jit
def _token_coef(
    b_lp,
    b_adv,
    b_old,
    b_lref,
    b_rho,
    b_w,
    lo,
    hi,
    delta,
    eps_high,
    beta,
    sapo_pos,
    sapo_neg,
    LOSS: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_RATIO: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BIAS_KL: tl.constexpr,
):
    """g = ∂loss/∂ℓ of w·(ρ·L + β·kl) for one token, with torch autograd's tie rules (clamp passes the gradient
    on the closed interval, minimum splits ties). Selects are written so that a NaN ratio stays NaN.

    `b_lp` is the fp64 ℓ of `_exact_logp_from_log2s`: ℓ − ℓ_old and ℓ_ref − ℓ are formed in fp64 (exact for any |ℓ|,
    where an fp32 ℓ of size 1e3 would carry 6e-5 of rounding into exp), then rounded to fp32, whose relative rounding
    of a difference of size d costs exp only d·6e-8; the rest stays in fp32 registers."""
    b_r = tl.exp((b_lp - b_old).to(tl.float32))  # old = ℓ itself when not given: exactly 1 (NaN for a NaN ℓ)
    if LOSS == 0:  # grpo, bnpo, dr_grpo, dapo, luspo: −min(r·A, clamp(r, lo, hi)·A)
        b_rc = tl.where(b_r < lo, lo, tl.where(b_r > hi, hi, b_r))
        b_db = b_adv * b_r * ((b_r >= lo) & (b_r <= hi)).to(tl.float32)
        if HAS_DELTA:
            b_r1 = tl.where(b_r > delta, delta, b_r)
            b_da = b_adv * b_r * (b_r <= delta).to(tl.float32)
        else:
            b_r1 = b_r
            b_da = b_adv * b_r
        b_a = b_r1 * b_adv
        b_b = b_rc * b_adv
        b_dl = -tl.where(b_a < b_b, b_da, tl.where(b_b < b_a, b_db, 0.5 * (b_da + b_db)))
    elif LOSS == 1:  # cispo: −sg(min(r, ε_high))·A·ℓ
        b_dl = -tl.where(b_r > eps_high, eps_high, b_r) * b_adv
    else:  # sapo: −(4/τs)·σ(τs(r − 1))·A; σ(1 − σ) = e/(1 + e)² with e = exp(−|x|), no cancellation
        b_ts = tl.where(b_adv > 0, sapo_pos, sapo_neg)
        b_e = tl.exp(-tl.abs(b_ts * (b_r - 1.0)))
        b_dl = -4.0 * (b_e / ((1.0 + b_e) * (1.0 + b_e))) * b_r * b_adv
    if HAS_RATIO:
        b_dl = b_dl * b_rho
    if HAS_REF:  # k3 estimator exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1
        b_diff = (b_lref - b_lp).to(tl.float32)
        b_ed = tl.exp(b_diff)
        b_dkl = 1.0 - b_ed
        if BIAS_KL:  # kl·r, r before any delta clamp
            b_dkl = (b_dkl + (b_ed - b_diff - 1.0)) * b_r
        b_dl = b_dl + beta * b_dkl
    return tl.where(b_w == 0, 0.0, b_w * b_dl)  # a masked token contributes nothing, even with inf inputs


@triton.heuristics(
    {
        "HAS_OLD": lambda a: a["old_ptr"] is not None,
        "HAS_REF": lambda a: a["ref_ptr"] is not None,
        "HAS_RATIO": lambda a: a["rho_ptr"] is not None,
        "HAS_ENT": lambda a: a["hw_ptr"] is not None,
        "ALIGNED": lambda a: _aligned(a["stride_xb"], a["stride_xt"], a["stride_ob"], a["stride_ot"]),
        "HEAD": lambda a: _realigns(a, "x_ptr", "out_ptr"),
        "WORDS": _words,
        **_TILE_HEURISTICS,
        # realigned rows keep one accumulator per slot: grouped, Triton 3.9's ptxas spills the 8-warp plan of V =
        # 50257 (its tail tile held across the loop) at its 128 registers
        "GROUP": lambda a: 1 if a["HEAD"] else _group(a),
        "SPLIT": lambda a: 1 if a["ws_ptr"] is None else a["ws_ptr"].shape[1],  # the launcher's (`_fused_split`)
        "NUM_STAGES": lambda a: _launch_plan(a, two_pass=True)[0],
        "maxnreg": lambda a: _launch_plan(a, two_pass=True)[1],
        "ROTATE": lambda a: _rotates(a["window"], -(-a["V"] // a["SPLIT"]), a["BLOCK_V"]),
    }
)
@triton.jit(
    do_not_specialize=[
        "N", "T", "window", "stride_xb", "stride_xt", "stride_ob", "stride_ot", "stride_yb", "stride_yt",
        "stride_ab", "stride_at", "stride_oldb", "stride_oldt", "stride_refb", "stride_reft",
        "stride_rhob", "stride_rhot", "stride_wb", "stride_wt", "stride_hwb", "stride_hwt",
    ]
)  # fmt: skip
def fused_token_grad_fwd_kernel(
    x_ptr,  # [B, T, V] logits
    y_ptr,  # [B, T] ids
    out_ptr,  # [B, T, V] ∂loss/∂logits, may alias x_ptr
    logp_ptr,  # [B, T] fp64, contiguous
    ent_ptr,  # [B, T] fp32, contiguous
    adv_ptr,  # [B, T] advantages (stride 0 along T for per-sequence values)
    old_ptr,  # [B, T] or None
    ref_ptr,  # [B, T] or None (None when β == 0)
    rho_ptr,  # [B, T] or None
    w_ptr,  # [B, T] aggregation weight (mask included)
    hw_ptr,  # [B, T] entropy-bonus weight or None
    ws_ptr,  # [N, SPLIT, 3] int64 zeros where SPLIT > 1 (`_split_row_scan`), else None
    N,
    T,
    V,
    window,  # pass 2 starts with the last `window` full tiles of the row (of its slice: SPLIT) (`pass2_window`)
    stride_xb,
    stride_xt,
    stride_ob,
    stride_ot,
    stride_yb,
    stride_yt,
    stride_ab,
    stride_at,
    stride_oldb,
    stride_oldt,
    stride_refb,
    stride_reft,
    stride_rhob,
    stride_rhot,
    stride_wb,
    stride_wt,
    stride_hwb,
    stride_hwt,
    k2,
    inv_tau,
    inv_tau_lo,  # 1/τ − fp32(1/τ): with inv_tau, 1/τ to about 48 bits for the fp64 ℓ
    lo,  # 1 − ε_low
    hi,  # 1 + ε_high
    delta,
    eps_high,  # cispo's absolute cap
    beta,
    sapo_pos,
    sapo_neg,
    LOSS: tl.constexpr,  # 0: clipped family, 1: cispo, 2: sapo
    HAS_DELTA: tl.constexpr,
    BIAS_KL: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_RATIO: tl.constexpr,
    HAS_ENT: tl.constexpr,
    ALIGNED: tl.constexpr,
    HEAD: tl.constexpr,
    WORDS: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    TAIL_SLOTS: tl.constexpr,
    VECTORS: tl.constexpr,
    FMA_FRAME: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ROTATE: tl.constexpr,
    SPLIT: tl.constexpr = 1,  # programs per row (`row_split`): each scans and writes a slice of the row's tiles
    SPIN: tl.constexpr = 0,  # polls for a slice another program has not published yet (`_split_row_scan`)
):
    # SPLIT > 1: program p is part p mod SPLIT of group p div SPLIT, and group g takes rows g, g + grid / SPLIT, ...
    tl.static_assert(SPLIT == 1 or TAIL_SLOTS == 0, "a row split needs rows that end in an overlapping tile")
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    part = 0
    if SPLIT > 1:
        group = tl.program_id(0) // SPLIT
        groups = tl.num_programs(0) // SPLIT
        part = tl.program_id(0) % SPLIT
    # Each row's id and per-token inputs are loaded a row ahead, just before the previous row's pass 2, where
    # nothing waits on a load (in the SASS the first use of a load waits for every load issued before it), so
    # that no load waits at the row's start, in front of its first tile copies: the target's address and load
    # (`_row_scan`'s TARGET_FIRST) use an id already in registers.
    # (On 16-byte vectors: the scalar rows' plan has no registers to carry them across a row, nor copies to hold.)
    if VECTORS:
        y_n, adv_n, w_n, old_n, lref_n, rho_n, h_n = _load_row_inputs(
            group, N, T, y_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rho_ptr, hw_ptr, stride_yb, stride_yt,
            stride_ab, stride_at, stride_wb, stride_wt, stride_oldb, stride_oldt, stride_refb, stride_reft,
            stride_rhob, stride_rhot, stride_hwb, stride_hwt, HAS_OLD, HAS_REF, HAS_RATIO, HAS_ENT,
        )  # fmt: skip
    for i_r in range(group, N, groups):  # persistent: rows i, i + grid, ... (grid / SPLIT)
        if VECTORS:
            y, b_adv, b_w, b_old, b_lref, b_rho, b_h = y_n, adv_n, w_n, old_n, lref_n, rho_n, h_n
        else:
            y, b_adv, b_w, b_old, b_lref, b_rho, b_h = _load_row_inputs(
                i_r, N, T, y_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rho_ptr, hw_ptr, stride_yb, stride_yt,
                stride_ab, stride_at, stride_wb, stride_wt, stride_oldb, stride_oldt, stride_refb, stride_reft,
                stride_rhob, stride_rhot, stride_hwb, stride_hwt, HAS_OLD, HAS_REF, HAS_RATIO, HAS_ENT,
            )  # fmt: skip
        i_row, i_b, i_t = _row_index(i_r, T)
        o_x = i_b * stride_xb + i_t * stride_xt  # here, not in a helper: Triton 3.6 drops a hint on a call's result
        shift = 0
        o_a = o_x
        if ALIGNED:
            o_a = tl.multiple_of(o_x, 16)
        if HEAD:
            shift = (o_x % 16).to(tl.int32)  # int32: the row's indices and masks stay 32-bit
            o_a = tl.multiple_of(o_x - shift, 16)
        o_oa = i_b * stride_ob + i_t * stride_ot  # the same shift as the logits' (`_realigns`)
        if ALIGNED:
            o_oa = tl.multiple_of(o_oa, 16)
        if HEAD:
            o_oa = tl.multiple_of(o_oa - shift, 16)
        if SPLIT > 1:
            b_mx, b_log2s, b_zy, b_q, b_c2, _, x_y = _split_row_scan(
                x_ptr + o_a, y + shift, V + shift, ws_ptr + i_row * (3 * SPLIT), part, k2, BLOCK_V, SLOTS, VEC,
                NUM_STAGES, WORDS, FMA_FRAME, SPLIT, SPIN, GROUP,
            )  # fmt: skip
        else:
            b_mx, b_log2s, b_zy, b_q, b_c2, _, x_y = _row_scan(
                x_ptr + o_a,
                y + shift,
                V + shift,
                shift,
                k2,
                BLOCK_V,
                SLOTS,
                VEC,
                TAIL_SLOTS,
                VECTORS,
                NUM_STAGES,
                "evict_last",
                HEAD,
                WORDS,
                VECTORS,  # TARGET_FIRST (the scalar rows' plan has no register to spare across the scan)
                FMA_FRAME,
                GROUP,
            )  # pass 2 re-reads the row from L2
        b_lp = _exact_logp_from_log2s(x_y, b_mx, b_log2s, inv_tau, inv_tau_lo)  # fp64
        if part == 0:  # every program of the row has the same ℓ and H: one stores them
            tl.store(logp_ptr + i_row, b_lp)  # a float64 buffer
            tl.store(ent_ptr + i_row, (b_log2s - b_c2) * LN2)
        if not HAS_OLD:
            b_old = b_lp  # ℓ_old = sg(ℓ): the ratio is exactly 1
        b_g = _token_coef(
            b_lp, b_adv, b_old, b_lref, b_rho, b_w, lo, hi, delta, eps_high, beta, sapo_pos, sapo_neg,
            LOSS, HAS_REF, HAS_RATIO, HAS_DELTA, BIAS_KL,
        )  # fmt: skip
        if VECTORS:
            y_n, adv_n, w_n, old_n, lref_n, rho_n, h_n = _load_row_inputs(
                i_r + groups, N, T, y_ptr, adv_ptr, w_ptr, old_ptr, ref_ptr, rho_ptr, hw_ptr, stride_yb,
                stride_yt, stride_ab, stride_at, stride_wb, stride_wt, stride_oldb, stride_oldt, stride_refb,
                stride_reft, stride_rhob, stride_rhot, stride_hwb, stride_hwt, HAS_OLD, HAS_REF, HAS_RATIO, HAS_ENT,
            )  # fmt: skip
        _row_grad_store(
            x_ptr + o_a, out_ptr + o_oa, y + shift, V + shift, shift, window, k2, inv_tau, b_mx, b_log2s, b_zy,
            b_q, b_c2, b_g, b_h, HAS_ENT, BLOCK_V, SLOTS, VEC, TAIL_SLOTS, VECTORS, NUM_STAGES, HEAD, WORDS,
            FMA_FRAME, ROTATE, part, SPLIT,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Launch configuration


def _realigns(args: dict, *ptrs: str) -> bool:
    """A row that is not ALIGNED can still be tiled on 16-byte vectors from the 16-element boundary before it
    (HEAD), where the tensors start on 16 bytes and every tensor's rows sit at the same offset from such a
    boundary (x and out of the same layout: a contiguous (B, T, 50257) pair, or the in-place gradient)."""
    if args["ALIGNED"]:
        return False
    tensors = [args[p] for p in ptrs]
    if any(t.data_ptr() % 16 for t in tensors):
        return False
    first = tensors[0]
    return all(t.stride(0) % 16 == first.stride(0) % 16 and t.stride(1) % 16 == first.stride(1) % 16 for t in tensors)


def _aligned(*strides: int) -> bool:
    """Row starts are multiples of 16 elements: the tile loads/stores can use 16-byte vectors."""
    return all(s % 16 == 0 for s in strides)


def _scalar_rows(*tensors: torch.Tensor) -> bool:
    """Rows that are neither ALIGNED nor HEAD (the kernels' heuristics): the plain path with scalar loads."""
    args = {"ALIGNED": _aligned(*(s for t in tensors for s in (t.stride(0), t.stride(1))))}
    return not args["ALIGNED"] and not _realigns(args | {f"t{i}": t for i, t in enumerate(tensors)},
                                                 *(f"t{i}" for i in range(len(tensors))))  # fmt: skip


def _narrow_plan(logits: torch.Tensor, kernel: str) -> str:
    """`_block_config`'s `narrow` for `kernel` ("scan" or "fused") over these logits: the kernel over 2-byte logits
    while `narrow_16bit()` holds, else "" (fp32 rows keep the wide plan)."""
    return kernel if logits.element_size() == 2 and narrow_16bit() else ""


def narrow_16bit() -> bool:
    """Whether 16-bit rows get the narrow plans (`_block_config`): `NARROW_16BIT`, else the GRPO_KERNELS_NARROW_16BIT
    variable ("1" or "0", so that a GPU can time both plans), else on."""
    value = NARROW_16BIT if NARROW_16BIT is not None else os.environ.get(NARROW_16BIT_VARIABLE)
    if value is None or value == "":
        return True
    if value not in (True, False, "1", "0", 1, 0):
        raise ValueError(f"{NARROW_16BIT_VARIABLE} (or triton_logits.NARROW_16BIT) must be 1 or 0, got {value!r}")
    return value in (True, "1", 1)


def _block_config(vocab: int, scalar_rows: bool = False, narrow: str = "") -> tuple[int, int]:
    """(BLOCK_V, num_warps) keyed on V: 8-16 elements per thread, one or two 16-byte vectors of bf16. The loads in
    flight come from pipelining the tile loop (`_pipeline`), not from wider tiles, so registers stay low: 0 spills
    on sm_90a for every row here, dtype and flag set (tests/ops/test_hopper_compile.py, Triton 3.5 to 3.9).

    `narrow`: "scan" for the statistics or shard-partials kernel over 2-byte logits, "fused" for the fused kernel
    over them (`_narrow_plan`), planned at 32 logits per thread on fewer warps per program and more programs per
    SM (`_programs_per_sm`): at 16384 < V <= 65536 tiles of 4096 over 4 warps (the row's serial start, reductions
    and per-row code run by half the warps, and overlapped by 3-4 rows per SM), for the fused kernel only up to
    V = 32768: above, three rows per SM would not fit L2 in pass 2, and two programs of 8 warps in tiles of 8192 (16
    warps per SM) hide more than two of 4. Above 65536 the scans keep 8 warps and the fused kernel takes tiles of
    16384 over 16, each tile's fixed work (its barriers, max, rescale, loop control) shared by twice the logits of
    16 (docs/performance.md)."""
    if vocab <= 256:  # toy vocabularies: one warp is plenty
        return max(16, triton.next_power_of_2(vocab)), 1
    if vocab <= 1024:
        return triton.next_power_of_2(vocab), 4
    if vocab <= 4096:  # whole row in one tile
        return triton.next_power_of_2(vocab), 8
    if vocab <= 16384:  # 2-4 tiles of 4096
        return 4096, 8
    if vocab <= (32768 if narrow == "fused" else 65536) and narrow and not scalar_rows:
        return 4096, 4  # 5-16 tiles of 4096 (the fused kernel: 5-8), 32 logits per thread, 4 warps
    if vocab <= 65536:  # Llama-2 (32000), Mistral (32768): 4 tiles of 8192, 32 logits per thread; GPT-2 (50257): 7
        return 8192, 8  # (the fused kernel over 16-bit logits: two programs per SM, `_programs_per_sm`)
    if scalar_rows or narrow == "scan":  # the plain path's scalar loads: 16 warps leave too few
        return 8192, 8
    if narrow == "fused":  # one program per SM: each tile's barriers and fixed work shared by 32 logits per thread
        return 16384, 16
    return 8192, 16  # Llama-3 (128256), Qwen2.5/3 (151936), Gemma-3 (262144): 16-32 tiles of 8192, 512 threads


def _fused_block_config(vocab: int, scalar_rows: bool, narrow: str, realigned: bool, arch: int) -> tuple[int, int]:
    """`_block_config` of the fused kernel on a device of compute capability `arch` (`_device_arch`): on sm_100 the
    realigned (HEAD) 16-bit rows it gives the 8-warp plan (32768 < V <= 65536, two programs per SM) keep the 4-warp
    plan (tiles of 4096, three programs per SM), since sm_100a's ptxas spills that 8-warp plan at the 128 registers
    two programs per SM leave (tests/ops/test_performance_model.py prints both on the B200 model)."""
    plan = _block_config(vocab, scalar_rows, narrow)
    if narrow == "fused" and realigned and arch >= 100 and plan == (8192, 8):
        return 4096, 4
    return plan


# The latency model (docs/performance.md). Little's law: a memory system delivering bandwidth W at latency L needs
# W·L bytes in flight. Reference devices: H100 SXM (132 SMs, 50 MiB L2) and H200 (132 SMs, 60 MiB L2 as torch
# reports it), 4.3 TB/s copy rate, ~0.7 µs loaded DRAM latency: 4.3e12 B/s x 0.7e-6 s = 3.0 MB, 22.8 KB per SM.
# The target adds 40 % for latency under load.
REFERENCE_SMS = 132
REFERENCE_L2_BYTES = 50 << 20  # also the fallback when the device does not report its L2 size
REFERENCE_ARCH = 90  # the compute capability a launch plan is made for off CUDA (the AOT compiles set 100 too)
IN_FLIGHT_PER_SM = 32 << 10  # bytes of loads in flight per SM, averaged over all SMs
L2_FRACTION = 0.5  # share of L2 the rows in flight of a two-pass kernel may fill (the gradient streams beside them)
# Tiles in flight per program, at least. The compiled loop issues a tile's copies after the barrier that frees its
# buffer, late in the body, so k tiles in flight lead the wait for them by k + 1 − (that fraction) tiles: 3 keep
# every copy at least 2 tiles ahead of its use (tests/ops/test_performance_model.py reads the lead off the SASS).
TILES_IN_FLIGHT: int | None = None  # None: the variable GRPO_KERNELS_TILES_IN_FLIGHT, else DEFAULT_TILES_IN_FLIGHT
DEFAULT_TILES_IN_FLIGHT = 3
TILES_IN_FLIGHT_VARIABLE = "GRPO_KERNELS_TILES_IN_FLIGHT"
MAX_PIPELINE_BYTES = 192 << 10  # shared memory for the tiles in flight of one program (227 KiB per block on sm_90)
# The fused kernel's two grids (`_fused_grid`). "sms": every SM busy (its resident programs), whatever the rows in
# flight; "l2": no more programs than rows that fit L2_FRACTION of L2, so pass 2 re-reads from L2. By default the
# faster of the two by `_fused_time`: the issue rate of the SMs the L2-sized grid leaves idle against the DRAM
# traffic of the full grid's pass-2 misses (tests/ops/test_performance_model.py checks the choice against the
# compiled model at every vocabulary it lists, on both reference devices).
COPY_BANDWIDTH = 4.3e12  # B/s: the copy rate measured on an H200
ISSUE_MARGIN = 1.25  # instruction issue is planned at 80 % efficiency
# Floor bytes per second (logits read + gradient written) that one busy SM's instruction issue allows the fused
# kernel, by element size: 4 warp instructions per cycle at 1.98 GHz over the SASS instructions per row of the
# sm_90a compile, in the L2-sized grid's plan, the one it decides on (its deeper pipeline costs a few more
# instructions per tile); tests/ops/test_performance_model.py holds these to every compiled plan within 20 % (the
# 16-bit figure rose from 47 with the grouped accumulators of `_scan_tile` and pass 2's folded constants).
FUSED_ISSUE_BYTES_PER_SM = {2: 51e9, 4: 85e9}
L2_GRID_IDLE = 0.05  # the most of the SMs the default fused grid leaves idle to keep pass 2 in L2
FUSED_GRID: str | None = None  # "sms" or "l2" forces a grid (a GPU can time both); None: the variable, else default
FUSED_GRID_VARIABLE = "GRPO_KERNELS_FUSED_GRID"
NARROW_16BIT: bool | None = None  # False: 16-bit rows keep the wide plans; None: the variable, else on
NARROW_16BIT_VARIABLE = "GRPO_KERNELS_NARROW_16BIT"
# The fused kernel's pass 2 starts with the last `pass2_window` share of the row's tiles, the ones pass 1 read last,
# then wraps to the row's start (`_pass2_tile`). 1 is plain row order. None: the variable, else the rows in flight's
# share that L2 keeps.
PASS2_WINDOW: float | None = None
PASS2_WINDOW_VARIABLE = "GRPO_KERNELS_PASS2_WINDOW"
# The fused kernel's row split (`_split_row_scan`): SPLIT programs share each row, one slice of its tiles each, so
# that grid / SPLIT rows are in flight and pass 2 finds more of them in L2 (`_default_split` picks it). A GPU can
# time other splits with the variable.
ROW_SPLIT: int | None = None  # None: the variable GRPO_KERNELS_ROW_SPLIT (1 to MAX_ROW_SPLIT), else the default
ROW_SPLIT_VARIABLE = "GRPO_KERNELS_ROW_SPLIT"
MAX_ROW_SPLIT = 16
SPLIT_MISS = 0.0  # the share of pass-2 reads a default split lets miss L2: none
# The least tiles a slice of the default split keeps: each slice pays the row's fixed code (its pass starts,
# reductions, coefficient, the exchange) in instructions, while its waits overlap the SM's other program.
MIN_SLICE_TILES = 4
# The split plan (`_split_plan`): the fused kernel's rows above V = 65536 on Hopper, split by default, as two
# programs of 8 warps per SM (`SPLIT_PROGRAMS_PER_SM`), 64 bytes of logits per thread per tile (16 fp32, 32
# 16-bit: the registers of the one-program plans, 128). One program's serial phases (pass starts, reductions, the
# exchange) overlap the other's tiles, and the split keeps the rows in flight within L2 (docs/performance.md,
# section 4).
SPLIT_BLOCK_CONFIG = {2: (8192, 8), 4: (4096, 8)}  # element bytes: (BLOCK_V, num_warps)
SPLIT_PROGRAMS_PER_SM = 2
# The one-program plan's pass-2 miss share above which the split plan is the default: below it that plan's DRAM
# bound (at least 4.3 / 1.025 = 4.2 TB/s) is within a few percent of the split plan's issue bound over 16-bit
# logits (4.36-4.54 TB/s at V = 128256-152064), which a split's exchange and per-slice code then need not buy. The
# listed vocabularies miss more (bf16 128256-129280: 7-8 % on an H200, 23 % on an H100).
SPLIT_PLAN_MISS = 0.05
# Polls for a slice another program of the row has not published yet, before a program scans it itself. A poll is
# an L2 round trip (about 0.5-1 µs under load), so on a GPU 64 of them wait some 30-60 µs: several times a slice's
# own scan (6 µs for a third of an fp32 row of 151936 at the copy rate) and far more than a resident partner lags
# (a tile's time, ~1 µs). A partner that late is not running (another kernel holds its SM), and scanning its slice
# costs less than waiting on. Under the interpreter, which runs the programs one after another, two (the wait
# loop runs, then the scan).
SPLIT_SPIN = 64
INTERPRETER_SPIN = 2


def fused_grid_mode() -> str | None:
    """The forced fused grid: `FUSED_GRID`, else the GRPO_KERNELS_FUSED_GRID variable, else None (the default)."""
    mode = FUSED_GRID if FUSED_GRID is not None else (os.environ.get(FUSED_GRID_VARIABLE) or None)
    if mode not in (None, "sms", "l2"):
        raise ValueError(f"{FUSED_GRID_VARIABLE} (or triton_logits.FUSED_GRID) must be 'sms' or 'l2', got {mode!r}")
    return mode


def pass2_window(rows_in_flight: int, row_bytes: int, l2_bytes: int) -> float:
    """The share of a row's tiles the fused kernel's pass 2 takes first, from the row's end: `PASS2_WINDOW`, else
    the GRPO_KERNELS_PASS2_WINDOW variable (a number in (0, 1], so that a GPU can time the orders), else the
    model's: min(1, 2·L2_FRACTION·L2 / rows in flight). A tile pass 1 read at share q of its row and pass 2
    re-reads at share p of its pass waits for (1 − q + p) half-rows of every program's pass-1 reads. Those the
    window takes first wait the window's share of them, all alike, so under LRU every one of them still finds its
    line while that fits the L2 budget: 1 (row order) where the rows in flight fit L2, a share of the row where
    they do not (row order would find none of them there). docs/performance.md has the trade."""
    value = PASS2_WINDOW if PASS2_WINDOW is not None else os.environ.get(PASS2_WINDOW_VARIABLE)
    if value is None or value == "":
        return min(1.0, 2 * L2_FRACTION * l2_bytes / max(1, rows_in_flight * row_bytes))
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0 < share <= 1:
        raise ValueError(f"{PASS2_WINDOW_VARIABLE} (or triton_logits.PASS2_WINDOW) must be in (0, 1], got {value!r}")
    return share


def row_split() -> int | None:
    """The forced row split of the fused kernel (`_fused_split`): `ROW_SPLIT`, else the GRPO_KERNELS_ROW_SPLIT
    variable (1 to MAX_ROW_SPLIT; 1 is no split), else None (`_default_split`)."""
    value = ROW_SPLIT if ROW_SPLIT is not None else os.environ.get(ROW_SPLIT_VARIABLE)
    if value is None or value == "":
        return None
    try:
        split = int(value)
    except (TypeError, ValueError):
        split = 0
    if not 1 <= split <= MAX_ROW_SPLIT or str(value).strip() != str(split):
        raise ValueError(
            f"{ROW_SPLIT_VARIABLE} (or triton_logits.ROW_SPLIT) must be an integer from 1 to {MAX_ROW_SPLIT}, "
            f"got {value!r}"
        )
    return split


def _split_plan(vocab: int, elem_bytes: int, sms: int, l2_bytes: int,
                arch: int | None = None) -> tuple[int, int] | None:  # fmt: skip
    """(BLOCK_V, num_warps) of the split plan (SPLIT_BLOCK_CONFIG) where the fused kernel's rows take it: V > 65536
    on Hopper, where a split above 1 is forced (`row_split`), else by default where the one-program plan's rows in
    flight (`_grid_size`) would miss more than SPLIT_PLAN_MISS of pass 2's reads in L2; None elsewhere: a forced
    split of 1, a forced grid (`fused_grid_mode`: a GPU timing the grids), and sm_100 (`arch` >= 100), where the
    B200 model puts the split rows' latency bound below the unsplit rows' DRAM bound (its copy rate nearly doubles
    the cost of a row's fixed waits: docs/performance.md, section 5)."""
    arch = REFERENCE_ARCH if arch is None else arch
    if vocab <= 65536 or arch >= 100 or elem_bytes not in SPLIT_BLOCK_CONFIG or fused_grid_mode() is not None:
        return None
    forced = row_split()
    if forced is not None:
        return SPLIT_BLOCK_CONFIG[elem_bytes] if forced > 1 else None
    in_flight = _grid_size(1 << 30, vocab, elem_bytes, True, sms, l2_bytes, 16, None, False, arch)
    miss = 1.0 - L2_FRACTION * l2_bytes / (in_flight * vocab * elem_bytes)
    return SPLIT_BLOCK_CONFIG[elem_bytes] if miss > SPLIT_PLAN_MISS else None


def _default_split(vocab: int, elem_bytes: int, block_v: int, num_warps: int, sms: int, l2_bytes: int,
                   arch: int | None = None) -> int:  # fmt: skip
    """The row split of a fused launch in the split plan (`_split_plan`) on every SM (`_split_grid`): the least
    that keeps pass 2's misses within SPLIT_MISS of its reads (the rows in flight within L2_FRACTION of L2, as
    `_fused_time` counts them), but no more than leaves each slice MIN_SLICE_TILES tiles; 1 in any other plan."""
    if (block_v, num_warps) != _split_plan(vocab, elem_bytes, sms, l2_bytes, arch):
        return 1
    tiles = -(-vocab // block_v)
    best = 1
    for split in range(1, MAX_ROW_SPLIT + 1):
        if -(-tiles // split) < MIN_SLICE_TILES:
            break
        best = split
        in_flight = _split_in_flight(split, elem_bytes, block_v, num_warps, sms, arch)
        if 1.0 - L2_FRACTION * l2_bytes / (in_flight * vocab * elem_bytes) <= SPLIT_MISS:
            break
    return best


def _fused_split(logits: torch.Tensor, out: torch.Tensor, block_v: int, num_warps: int, scalar: bool) -> int:
    """SPLIT of `fused_token_grad`'s launch in this block config (`_launch_split` on the logits' device). Never
    where the output shares the logits' storage (the in-place gradient): a program of a split row reads the
    target's logit, and may scan a slice for a partner that is not running, while the row's other programs write
    their gradient over the logits."""
    if _shares_storage(logits, out):
        return 1
    aligned = _aligned(logits.stride(0), logits.stride(1), out.stride(0), out.stride(1))
    return _launch_split(logits.shape[-1], logits.element_size(), block_v, num_warps, aligned, scalar,
                         *_device_caps_of(logits.device), _device_arch(logits.device))  # fmt: skip


def _shares_storage(logits: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the output is (a view of) the logits' storage: the in-place gradient."""
    return out.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()


def _launch_split(vocab: int, elem_bytes: int, block_v: int, num_warps: int, aligned: bool, scalar: bool, sms: int,
                  l2_bytes: int, arch: int | None = None) -> int:  # fmt: skip
    """SPLIT of a fused launch whose output has its own storage: `row_split()`, else `_default_split`, for rows
    that end in an overlapping full tile (16-byte `aligned` strides, V a multiple of 16 and at least a tile:
    `_tail_tile`), else 1 (and for `scalar` rows)."""
    if scalar or not _ends_in_full_tile(aligned, vocab, block_v):
        return 1
    return row_split() or _default_split(vocab, elem_bytes, block_v, num_warps, sms, l2_bytes, arch)


def _fused_layout(vocab: int, elem_bytes: int, scalar: bool, narrow: str, realigned: bool, aligned: bool, sms: int,
                  l2_bytes: int, arch: int | None = None) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_V, num_warps, SPLIT) of a fused launch whose output has its own storage: the split plan
    (`_split_plan`) where it applies and the rows split (`_launch_split`), else `_fused_block_config`'s, split
    where one is forced. `_fused_plan` takes it for its launch, tests/ops/hopper_aot.py for its compiles."""
    arch = REFERENCE_ARCH if arch is None else arch
    wide = _split_plan(vocab, elem_bytes, sms, l2_bytes, arch)
    if wide is not None:
        split = _launch_split(vocab, elem_bytes, *wide, aligned, scalar, sms, l2_bytes, arch)
        if split > 1:
            return *wide, split
    block_v, num_warps = _fused_block_config(vocab, scalar, narrow, realigned, arch)
    return block_v, num_warps, _launch_split(vocab, elem_bytes, block_v, num_warps, aligned, scalar, sms, l2_bytes,
                                             arch)  # fmt: skip


def _split_launch(rows: int, split: int, logits: torch.Tensor, block_v: int, num_warps: int) -> int:
    """The grid of a launch whose rows are split in `split`: one program per (row, slice) under the interpreter, on
    a GPU every SM's resident programs to a multiple of `split` (`_split_grid`)."""
    if not logits.is_cuda:
        return rows * split
    sms = _device_caps_of(logits.device)[0]
    return _split_grid(rows, split, logits.element_size(), block_v, num_warps, sms, _device_arch(logits.device))


def _split_per_sm(elem_bytes: int, block_v: int, num_warps: int, arch: int | None = None) -> int:
    """Resident programs per SM of a split launch: SPLIT_PROGRAMS_PER_SM in the split plan (SPLIT_BLOCK_CONFIG),
    else the fused kernel's (`_programs_per_sm`: a split forced on another plan)."""
    if SPLIT_BLOCK_CONFIG.get(elem_bytes) == (block_v, num_warps):
        return SPLIT_PROGRAMS_PER_SM
    return _programs_per_sm(num_warps, True, elem_bytes, False, arch)


def _split_grid(rows: int, split: int, elem_bytes: int, block_v: int, num_warps: int, sms: int,
                arch: int | None = None) -> int:  # fmt: skip
    """The persistent grid of a split launch: every SM's resident programs (`_split_per_sm`) to a multiple of
    `split`, at most `split` per row."""
    full = sms * _split_per_sm(elem_bytes, block_v, num_warps, arch)
    return max(split, min(full, rows * split) // split * split)


def _split_in_flight(split: int, elem_bytes: int, block_v: int, num_warps: int, sms: int,
                     arch: int | None = None) -> int:  # fmt: skip
    """Rows in flight of a launch split in `split` on every SM: its programs (`_split_grid`) / split."""
    return _split_grid(1 << 30, split, elem_bytes, block_v, num_warps, sms, arch) // split


def _split_window(vocab: int, elem_bytes: int, block_v: int, num_warps: int, split: int, sms: int, l2_bytes: int,
                  arch: int | None = None) -> int:  # fmt: skip
    """The pass-2 window (`pass2_window`) in tiles of a slice of a row split in `split`, for the rows in flight of a
    launch on every SM (`_split_in_flight`): `_pass2_tiles` of a split launch."""
    tiles = -(-vocab // block_v)
    slice_tiles = -(-tiles // split)
    in_flight = _split_in_flight(split, elem_bytes, block_v, num_warps, sms, arch)
    return max(1, math.floor(pass2_window(in_flight, vocab * elem_bytes, l2_bytes) * slice_tiles))


def _split_workspace(rows: int, split: int, device: torch.device) -> torch.Tensor:
    """The exchange of a split launch (`_split_row_scan`): per row and slice three int64 words, all 0 (unpublished)."""
    return torch.zeros(rows, split, 3, dtype=torch.int64, device=device)


def _pass2_tiles(vocab: int, elem_bytes: int, block_v: int, num_warps: int, sms: int, l2_bytes: int,
                 scalar: bool = False, arch: int | None = None, head: bool = False) -> int:  # fmt: skip
    """The fused kernel's pass-2 window (`pass2_window`) in whole tiles, within the share: for the rows in flight
    of its grid on this device (the interpreter's one program per row plans as the GPU would)."""
    in_flight = _grid_size(1 << 30, vocab, elem_bytes, True, sms, l2_bytes, num_warps, fused_grid_mode(), scalar,
                           arch, head)  # fmt: skip
    share = pass2_window(in_flight, vocab * elem_bytes, l2_bytes)
    return max(1, math.floor(share * -(-vocab // block_v)))


def _rotates(window: int, vocab: int, block_v: int) -> bool:
    """Whether pass 2 starts within the row (`window` tiles shorter than the row): only then is the wrapped tile
    index (`ROTATE`) compiled, else row order without the index's cost."""
    return window < -(-vocab // block_v)


def _fused_plan(logits: torch.Tensor, out: torch.Tensor) -> tuple[bool, int, int, int, bool, int]:
    """(scalar rows, BLOCK_V, num_warps, pass-2 window in tiles of a row or, SPLIT > 1, of its slice, realigned
    rows: the kernel's HEAD, SPLIT) of `fused_token_grad`'s launch on the logits' device (`_fused_layout`; the
    in-place gradient unsplit, `_fused_split`)."""
    vocab, elem = logits.shape[-1], logits.element_size()
    scalar = _scalar_rows(logits, out)
    aligned = _aligned(logits.stride(0), logits.stride(1), out.stride(0), out.stride(1))
    realigned = not scalar and not aligned
    narrow = _narrow_plan(logits, "fused")
    arch = _device_arch(logits.device)
    caps = _device_caps_of(logits.device)
    if _shares_storage(logits, out):
        block_v, num_warps, split = *_fused_block_config(vocab, scalar, narrow, realigned, arch), 1
    else:
        block_v, num_warps, split = _fused_layout(vocab, elem, scalar, narrow, realigned, aligned, *caps, arch)
    if split > 1:
        window = _split_window(vocab, elem, block_v, num_warps, split, *caps, arch)
    else:
        window = _pass2_tiles(vocab, elem, block_v, num_warps, *caps, scalar, arch, realigned)
    return scalar, block_v, num_warps, window, realigned, split


def tiles_in_flight() -> int:
    """The least tiles in flight per program: `TILES_IN_FLIGHT`, else the GRPO_KERNELS_TILES_IN_FLIGHT variable (so
    that a GPU can time the schedules), else DEFAULT_TILES_IN_FLIGHT."""
    value = TILES_IN_FLIGHT if TILES_IN_FLIGHT is not None else os.environ.get(TILES_IN_FLIGHT_VARIABLE)
    if value is None or value == "":
        return DEFAULT_TILES_IN_FLIGHT
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if not 1 <= count <= 8:
        raise ValueError(f"{TILES_IN_FLIGHT_VARIABLE} (or triton_logits.TILES_IN_FLIGHT) must be 1 to 8, got {value!r}")
    return count


def _programs_per_sm(num_warps: int, two_pass: bool, elem_bytes: int = 4, scalar: bool = False,
                     arch: int | None = None, head: bool = False) -> int:  # fmt: skip
    """Resident programs per SM the plan counts on. Single-pass kernels: 16 warps' worth, at least two (a third
    program of 8 or 16 warps would cap registers below what a pipelined tile of 16 or 32 logits per thread needs
    without spilling; four of 4 warps in the 16-bit scans' plan, whose rows in flight overlap each other's serial
    start and reductions). The fused kernel, few rows in flight keeping its L2 working set small: over fp32
    logits 12 warps' worth, at least one (its two tile loops and float64 log-ratio scalars need more than 128
    registers at 32 fp32 logits per thread: one program of 8 or 16 warps); over 16-bit logits 16 warps' worth, at
    most three (32 logits per thread are 16 registers of words: two programs of 8 warps fit 128 registers, three
    of 4 warps at most 170), but for `scalar` rows, read logit by logit, which spill at 128 (as fp32). On sm_100
    (`arch` >= 100; None: REFERENCE_ARCH, the device a plan off CUDA is made for) the fused kernel's realigned
    16-bit rows (`head`: the tail tile held across the pass) spill at 128 registers (two 8-warp programs per SM,
    the wide plan of V = 50257: the default keeps 4 warps there, `_fused_block_config`): one program per SM there,
    which `_launch_plan` gives its registers and `_grid_size` its grid."""
    if not two_pass:
        return max(2, 16 // num_warps)
    if elem_bytes != 2 or scalar:
        return max(1, 12 // num_warps)
    per_sm = max(1, min(3, 16 // num_warps))
    arch = REFERENCE_ARCH if arch is None else arch
    return 1 if arch >= 100 and head and _max_registers(num_warps, per_sm) <= 128 else per_sm


def _fused_grid(
    rows: int, row_bytes: int, elem_bytes: int, per_sm: int, sms: int, l2_bytes: int, mode: str | None = None
) -> int:
    """The fused kernel's persistent grid (each program loops over rows i, i + grid, ...): `mode` "sms" (every
    SM's resident programs), "l2" (no more rows in flight than fit L2_FRACTION of L2), None the launcher's model's
    choice (`_fused_time`). A bf16 row of 151936 logits is 297 KiB: 86 rows fill 24.9 MiB of a
    50 MiB L2, 132 (one per SM) fill 38.3 MiB."""
    full = max(1, min(rows, sms * per_sm))
    fit = max(1, min(full, int(l2_bytes * L2_FRACTION) // max(1, row_bytes)))
    if mode is None:
        # The L2-sized grid only where its issue still clears the copy rate by ISSUE_MARGIN (else it would be
        # issue-bound by construction), it is predicted no slower than the full grid with its misses, and it
        # leaves at most L2_GRID_IDLE of the SMs idle: an idle SM's share of the latency the rows in flight hide is
        # lost too, which this trade does not count (the full row model in test_performance_model.py does).
        issue_ok = min(fit, sms) * FUSED_ISSUE_BYTES_PER_SM[elem_bytes] >= ISSUE_MARGIN * COPY_BANDWIDTH
        busy = min(fit, sms) >= (1 - L2_GRID_IDLE) * min(full, sms)
        faster = _fused_time(fit, row_bytes, elem_bytes, sms, l2_bytes) <= _fused_time(
            full, row_bytes, elem_bytes, sms, l2_bytes
        )
        mode = "l2" if issue_ok and busy and faster else "sms"
    return fit if mode == "l2" else full


def _fused_time(grid: int, row_bytes: int, elem_bytes: int, sms: int, l2_bytes: int) -> float:
    """Predicted seconds per floor byte (one read and one write of the logits) of the fused kernel on `grid`
    programs: DRAM time, where a pass-2 read that misses L2 (the rows in flight beyond L2_FRACTION of it, assumed
    linear) is a second read of the row, against issue time at 1 / ISSUE_MARGIN efficiency on the busy SMs."""
    miss = max(0.0, 1.0 - L2_FRACTION * l2_bytes / (grid * row_bytes))
    dram = (1 + miss / 2) / COPY_BANDWIDTH
    issue = ISSUE_MARGIN / (min(grid, sms) * FUSED_ISSUE_BYTES_PER_SM[elem_bytes])
    return max(dram, issue)


def _grid_size(rows: int, vocab: int, elem_bytes: int, two_pass: bool, sms: int, l2_bytes: int, num_warps: int = 16,
               mode: str | None = None, scalar: bool = False, arch: int | None = None,
               head: bool = False) -> int:  # fmt: skip
    """Programs to launch. Single pass: one program per row (the hardware keeps as many resident as registers and
    shared memory allow). Two passes: `_fused_grid` (`scalar`: rows read logit by logit; `arch`, `head`: the
    device and realigned rows; `_programs_per_sm`)."""
    if not two_pass:
        return max(1, rows)
    per_sm = _programs_per_sm(num_warps, True, elem_bytes, scalar, arch, head)
    return _fused_grid(rows, vocab * elem_bytes, elem_bytes, per_sm, sms, l2_bytes, mode)


def _pipeline(
    block_v: int, elem_bytes: int, vocab: int, two_pass: bool, sms: int, l2_bytes: int, num_warps: int = 16,
    mode: str | None = None, arch: int | None = None, head: bool = False, per_sm: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(NUM_STAGES, resident programs per SM planned) of one launch.

    NUM_STAGES − 1 tiles are in flight (cp.async into shared memory) while one is reduced; 1 is no pipeline (a
    one-tile row). The resident programs together carry IN_FLIGHT_PER_SM x SMs: where the fused grid leaves SMs
    idle (the L2-sized grid of large rows), each program gets a deeper pipeline (in-row parallelism in place of
    rows). `per_sm`: a split launch's programs per SM (`_split_per_sm`), else the plan's (`_programs_per_sm`)."""
    tiles = -(-vocab // block_v)
    tile_bytes = block_v * elem_bytes
    if per_sm is None:
        per_sm = _programs_per_sm(num_warps, two_pass, elem_bytes, arch=arch, head=head)
    resident = per_sm * sms
    if two_pass:
        resident = _fused_grid(1 << 30, vocab * elem_bytes, elem_bytes, per_sm, sms, l2_bytes, mode)
        per_sm = -(-resident // sms)
    if tiles <= 1:  # the whole row is one tile: only more programs put more loads in flight
        return 1, min(per_sm, -(-IN_FLIGHT_PER_SM // tile_bytes))
    want = -(-IN_FLIGHT_PER_SM * sms // (resident * tile_bytes))  # tiles in flight per program
    want = max(want, tiles_in_flight())
    return 1 + max(1, min(want, tiles, MAX_PIPELINE_BYTES // tile_bytes)), per_sm


def _max_registers(num_warps: int, per_sm: int) -> int:
    """ptxas' register ceiling (maxnreg) for `per_sm` resident programs of `num_warps` warps: 64 Ki registers per
    SM, allocated in multiples of 8 per thread. Without it ptxas picks its own occupancy target, and may spill."""
    return min(255, 65536 // (32 * num_warps * per_sm) // 8 * 8)


def _launch_plan(args: dict, two_pass: bool) -> tuple[int, int]:
    """(NUM_STAGES, maxnreg) of a row kernel from its launch arguments, ALIGNED included (the kernels' heuristics):
    `_pipeline` on the launch's device, the reference device off CUDA (where the interpreter ignores both)."""
    x = args["x_ptr"]
    num_warps = args.get("num_warps", 4)  # 4: Triton's default
    mode = fused_grid_mode() if two_pass else None
    arch = _device_arch(x.device)
    split_per_sm = None
    if two_pass and args.get("SPLIT", 1) > 1:  # a split row's launch: every SM's programs (`_split_launch`)
        mode, split_per_sm = "sms", _split_per_sm(x.element_size(), args["BLOCK_V"], num_warps, arch)
    stages, per_sm = _pipeline(
        args["BLOCK_V"], x.element_size(), args["V"], two_pass, *_device_caps_of(x.device), num_warps, mode, arch,
        bool(args.get("HEAD")), split_per_sm,
    )  # fmt: skip
    if not (args["ALIGNED"] or args.get("HEAD")):  # scalar loads: no cp.async to pipeline, one program per SM
        return 1, _max_registers(num_warps, 1)
    maxnreg = _max_registers(num_warps, per_sm)
    if arch >= 100 and maxnreg <= 64 and x.element_size() == 4:
        # sm_100's ptxas spills a pipelined fp32 row at 64 registers (two 16-warp programs per SM): one program
        # per SM there, its tiles in flight (96 KiB) more than two programs' would be (test_performance_model.py).
        maxnreg = _max_registers(num_warps, 1)
    return stages, maxnreg


@functools.cache
def _device_caps(index: int) -> tuple[int, int]:
    """(SM count, L2 bytes) of a CUDA device; REFERENCE_L2_BYTES where torch does not report the L2 size."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, int(getattr(props, "L2_cache_size", 0) or REFERENCE_L2_BYTES)


def _device_arch(device: torch.device) -> int:
    """Compute capability as 10 x major + minor (90: sm_90); REFERENCE_ARCH off CUDA."""
    if device.type != "cuda":
        return REFERENCE_ARCH
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _device_caps_of(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return REFERENCE_SMS, REFERENCE_L2_BYTES
    return _device_caps(device.index if device.index is not None else torch.cuda.current_device())


def _num_programs(rows: int, logits: torch.Tensor, two_pass: bool, num_warps: int = 16, scalar: bool = False,
                  head: bool = False) -> int:  # fmt: skip
    """Grid size on the logits' device (`_grid_size`; `head`: realigned rows); under the interpreter one program per
    row."""
    if logits.device.type != "cuda":
        return rows
    mode = fused_grid_mode() if two_pass else None
    caps = _device_caps_of(logits.device)
    return _grid_size(rows, logits.shape[-1], logits.element_size(), two_pass, *caps, num_warps, mode, scalar,
                      _device_arch(logits.device), head)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Launch helpers (inputs were validated at the public boundary; the launchers assert shapes only)


def _assert_rows(logits: torch.Tensor, ids: torch.Tensor, *bt: torch.Tensor | None) -> tuple[int, int, int]:
    batch, length, vocab = logits.shape
    assert logits.stride(-1) == 1 or vocab == 1, logits.stride()
    assert ids.shape == (batch, length), (ids.shape, logits.shape)
    for x in bt:
        assert x is None or (x.shape == (batch, length) and x.dtype == torch.float32), (x.shape, x.dtype)
    return batch, length, vocab


def _assert_out(out: torch.Tensor, logits: torch.Tensor) -> None:
    assert out.shape == logits.shape and out.dtype == logits.dtype, (out.shape, out.dtype)
    assert out.stride(-1) == 1 or out.shape[-1] == 1, out.stride()


def _strides(x: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if x is None else (x.stride(0), x.stride(1))


# ------------------------------------------------------------------------------------------------------------------
# The launchers: the RowBackend interface (ops/backend.py)


def row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ℓ, H of each row with one read of the logits.

    Args:
        logits: [B, T, V] float32/bfloat16/float16, unit vocabulary stride, any batch/time strides (read in place).
        ids: [B, T] int32/int64 in [0, V), any strides.
        temperature: τ > 0.
    Returns:
        (logp, entropy, row_state): logp = z_y − logsumexp(z), [B, T] float64 (`_exact_logp`), and entropy =
        lse − Σ softmax(z)·z, [B, T] float32, with z = logits/τ; row_state [B, T, 4] float32 in the shared layout
        of ops/backend.py (m, log Σe, 1 − p_y, Σ p·z'). An fp32 lse alone cannot give exact probabilities for large
        logits, hence the wider state.

    Example:
        >>> logp, entropy, state = row_stats(logits, ids, 1.0)
    """
    batch, length, vocab = _assert_rows(logits, ids)
    logp = torch.empty(batch, length, dtype=torch.float64, device=logits.device)
    entropy = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    state = empty_row_state(batch, length, logits.device)
    rows = batch * length
    block_v, num_warps = _block_config(vocab, _scalar_rows(logits), _narrow_plan(logits, "scan"))
    grid = (_num_programs(rows, logits, False),)
    inv_tau = float(np.float32(1.0 / temperature))
    row_stats_fwd_kernel[grid](
        logits, ids, logp, entropy, state, rows, length, vocab,
        logits.stride(0), logits.stride(1), ids.stride(0), ids.stride(1),
        LOG2E / temperature, inv_tau, 1.0 / temperature - inv_tau,
        BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    state[..., 1::2] *= LN2.value  # the kernel's log2 Σe and Σ p·z2 -> the shared layout's natural units
    return logp, entropy, state


def shard_partials(logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
    """The per-row partials of one vocabulary shard, [B, T, 5] float32, as torch_rows.shard_partials computes
    them in torch ops: (raw max m, Σ e, Σ e·z', raw target logit or −inf, Σ_{v≠y} e), e = exp(z'),
    z' = (x − m)/τ. One read of the shard; `ids` are global, the shard holds [offset, offset + V)."""
    batch, length, vocab = _assert_rows(logits, ids)
    parts = torch.empty(batch, length, SHARD_PARTIALS_WIDTH, dtype=torch.float32, device=logits.device)
    rows = batch * length
    block_v, num_warps = _block_config(vocab, _scalar_rows(logits), _narrow_plan(logits, "scan"))
    grid = (_num_programs(rows, logits, False),)
    shard_partials_fwd_kernel[grid](
        logits, ids, parts, rows, length, vocab, offset,
        logits.stride(0), logits.stride(1), ids.stride(0), ids.stride(1),
        LOG2E / temperature,
        BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    return parts


def row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    row_state: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """out[b, t, :] = (g·(onehot(y) − p) − h·p·(z − Σ p·z)) / τ in out.dtype, p = softmax(logits/τ).

    Args:
        row_state: the third output of `row_stats` on the same logits (or the merged state of a vocabulary shard,
            with shard-local ids: a target outside [0, V) gets no one-hot).
        g, h: [B, T] float32 (any strides, broadcast views included); h None drops the entropy term.
        out: [B, T, V] in the logits' dtype, unit vocabulary stride; may be `logits` itself (in-place gradient:
            each tile is read before it is overwritten).
    """
    batch, length, vocab = _assert_rows(logits, ids, g, h)
    assert row_state.shape == (batch, length, ROW_STATE_WIDTH) and row_state.dtype == torch.float32, row_state.shape
    _assert_out(out, logits)
    kernel_state = row_state.contiguous().clone()
    kernel_state[..., 1::2] /= LN2.value  # natural units -> the kernel's log2 ones
    rows = batch * length
    block_v, num_warps = _block_config(vocab, _scalar_rows(logits, out))
    grid = (_num_programs(rows, logits, False),)  # one read per row
    row_grad_kernel[grid](
        logits, ids, kernel_state, g, h, out, rows, length, vocab,
        logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), ids.stride(0), ids.stride(1),
        *_strides(g), *_strides(h),
        LOG2E / temperature, 1.0 / temperature,
        BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip


def fused_token_grad(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of each row for the token-level losses: ℓ, H, the token coefficient g = ∂loss/∂ℓ, and ∂logits.

    loss = Σ w·(ρ·L + β·kl) + Σ entropy_weight·H (docs/loss.md), for a config with `cfg.is_fused`. Writes
    out = (g·(onehot − p) − h·p·(z − Σpz))/τ, h = entropy_weight.

    Args:
        advantages, weight: [B, T] float32 (broadcast views with stride 0 are read in place).
        old_logp: [B, T] or None (None: ℓ_old = sg(ℓ), ratio exactly 1).
        ref_logp: [B, T], given iff cfg.beta != 0 (None at β = 0, so an inf there cannot become 0·inf).
        rho: [B, T] ρ, the importance-sampling ratio, or None. entropy_weight: [B, T] or None.
        out: [B, T, V] in the logits' dtype; may be `logits` itself.
    Returns:
        (logp, entropy): logp [B, T] float64 (`_exact_logp_from_log2s`), entropy [B, T] float32.
    """
    batch, length, vocab = _assert_rows(logits, ids, advantages, old_logp, ref_logp, rho, weight, entropy_weight)
    assert cfg.is_fused and (ref_logp is not None) == (cfg.beta != 0.0), (cfg, ref_logp is None)
    _assert_out(out, logits)
    logp = torch.empty(batch, length, dtype=torch.float64, device=logits.device)
    entropy = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    rows = batch * length
    scalar, block_v, num_warps, window, realigned, split = _fused_plan(logits, out)
    workspace, spin = None, 0
    if split > 1:
        programs = _split_launch(rows, split, logits, block_v, num_warps)
        workspace = _split_workspace(rows, split, logits.device)
        spin = SPLIT_SPIN if logits.is_cuda else INTERPRETER_SPIN
    else:
        programs = _num_programs(rows, logits, True, num_warps, scalar, realigned)
    inv_tau = float(np.float32(1.0 / temperature))
    flags = coef_flags(cfg)
    fused_token_grad_fwd_kernel[(programs,)](
        logits, ids, out, logp, entropy, advantages, old_logp, ref_logp, rho, weight, entropy_weight, workspace,
        rows, length, vocab, window,
        logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), ids.stride(0), ids.stride(1),
        *_strides(advantages), *_strides(old_logp), *_strides(ref_logp), *_strides(rho),
        *_strides(weight), *_strides(entropy_weight),
        LOG2E / temperature, inv_tau, 1.0 / temperature - inv_tau, *coef_scalars(cfg).values(),
        LOSS=flags.loss, HAS_DELTA=flags.has_delta, BIAS_KL=flags.bias_kl,
        BLOCK_V=block_v, SPIN=spin, num_warps=num_warps,
    )  # fmt: skip
    return logp, entropy
