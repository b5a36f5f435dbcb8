"""The CPU path: the row kernels' algorithm in chunked PyTorch, for machines without Triton on the device.

At most one chunk of rows (about `CHUNK_ELEMENTS` elements) exists as float32 vocabulary-wide temporaries at a
time; the only full-size allocation is the gradient, in the logits' dtype. A `RowBackend` (ops/backend.py) without
the one-read fused pass: the loss runs `row_stats`, the objective, then `row_grad`.

Precision: everything is taken relative to the row's raw maximum, z' = (x − max x) / τ, so that logits of size
1e4 lose nothing to an fp32 logsumexp of size 1e4; 1 − p_y is summed over the other tokens rather than formed
as a difference, so a peaked row (p_y → 1) keeps its target gradient exact. float64 logits are computed in float64
throughout (ℓ, H, the row state and g, h are then float64 too).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .backend import SHARD_PARTIALS_WIDTH, FusedTokenGrad, empty_row_state, logp_from_sums, stats_dtype

# 4 Mi float32 elements = 16 MiB per temporary: big enough to amortize op overhead on a CPU, small next to the
# logits (a 4096 x 32000 batch is 131 Mi elements).
CHUNK_ELEMENTS = 1 << 22


fused_token_grad: FusedTokenGrad | None = None  # no one-read pass here (the RowBackend capability)


def _row_chunks(batch: int, length: int, vocab: int) -> Iterator[tuple[int, slice]]:
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for b in range(batch):
        for start in range(0, length, rows):
            yield b, slice(start, min(start + rows, length))


def _shifted(x: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """z' = (x − max) / τ in `row_max`'s dtype (float32, or float64 for float64 logits): the subtraction is exact for
    the tokens that carry probability."""
    z = x.to(row_max.dtype) - row_max.unsqueeze(-1)
    return z / temperature if temperature != 1.0 else z


def row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, row_state): logp [B, T] float64 (ops/backend.py, "ℓ in float64"), entropy [B, T] float32
    (float64 for float64 logits); row_state [B, T, 4] in the layout of ops/backend.py."""
    batch, length, vocab = logits.shape
    dtype = stats_dtype(logits.dtype)
    logp = torch.empty(batch, length, dtype=torch.float64, device=logits.device)
    entropy = torch.empty(batch, length, dtype=dtype, device=logits.device)
    state = empty_row_state(batch, length, logits.device, logits.dtype)
    lowest = torch.finfo(dtype).min
    for b, ts in _row_chunks(batch, length, vocab):
        x = logits[b, ts]
        y = ids[b, ts].long().unsqueeze(-1)
        row_max = x.amax(-1).to(dtype)
        z = _shifted(x, row_max, temperature).clamp_(min=lowest)  # [rows, V] <= 0; −inf -> lowest keeps e·z at 0
        e = torch.exp(z)
        e.scatter_(-1, y, 0.0)  # the sums below run over v != y: 1 − p_y without cancellation
        # The target's own term in float64, from its raw logit; the others' fp32 exponentials summed in float64.
        z_y = (x.gather(-1, y).squeeze(-1).double() - row_max.double()) / temperature
        e_y = torch.exp(z_y)
        others = e.sum(-1, dtype=torch.float64)
        total = others + e_y
        log_sum = torch.log(total)
        weighted = torch.linalg.vecdot(e, z).double() + torch.where(e_y > 0, e_y * z_y, 0.0)  # Σ e·z'
        logp[b, ts] = logp_from_sums(z_y, e_y, others, log_sum)
        ent = (log_sum - weighted / total).to(dtype)
        entropy[b, ts] = ent
        state[b, ts, 0] = row_max
        state[b, ts, 1] = log_sum.to(dtype)
        state[b, ts, 2] = (others / total).to(dtype)
        state[b, ts, 3] = state[b, ts, 1] - ent  # Σ p·z', formed from the stored H so that s − c is H exactly
    return logp, entropy, state


def row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    state: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """out = (g·(onehot − p) − h·p·(z − Σ p·z)) / τ, written chunk by chunk; `out` may be `logits` itself. A row
    with g = h = 0 is exactly 0, even when its logits are NaN (the RowBackend contract).

    An id outside [0, V) (the logits are one vocabulary shard, `ids` shard-local, `state` the merged full-vocabulary
    one of vocab_parallel.merge_partials) contributes no one-hot."""
    batch, length, vocab = logits.shape
    for b, ts in _row_chunks(batch, length, vocab):
        local = ids[b, ts].long().unsqueeze(-1)
        inside = (local >= 0) & (local < vocab)  # [rows, 1]
        y = local.clamp(0, vocab - 1)
        row_max, log_sum, others, mean_z = state[b, ts, 0], state[b, ts, 1], state[b, ts, 2], state[b, ts, 3]
        g_b = g[b, ts].unsqueeze(-1)
        z = _shifted(logits[b, ts], row_max, temperature)
        target = g_b * others.unsqueeze(-1)  # g·(1 − p_y), exact for a peaked row
        if h is None:
            grad = z.sub_(log_sum.unsqueeze(-1)).exp_().mul_(-g_b)  # −g·p, in place
            grad.scatter_(-1, y, torch.where(inside, target, grad.gather(-1, y)))
        else:
            p = torch.exp(z - log_sum.unsqueeze(-1))
            centered = z.sub_(mean_z.unsqueeze(-1))  # z' − Σ p·z'
            grad = torch.where(p > 0, p * centered, 0.0).mul_(-h[b, ts].unsqueeze(-1))  # −h·p·(z' − Σpz')
            p.scatter_(-1, y, torch.where(inside, 0.0, p.gather(-1, y)))  # the target's −g·p_y is in `target`
            grad.sub_(g_b * p).scatter_add_(-1, y, torch.where(inside, target, 0.0))
        # A row with g = h = 0 (a masked token) is exactly 0 whatever its logits hold (NaN · 0 would be NaN).
        absent = g_b == 0 if h is None else (g_b == 0) & (h[b, ts].unsqueeze(-1) == 0)
        grad.masked_fill_(absent, 0.0)
        if temperature != 1.0:
            grad /= temperature
        out[b, ts] = grad


def shard_partials(logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
    """[B, T, 5] float32 (float64 for float64 logits) per row of the shard: (raw max m, Σ e, Σ e·z', raw target
    logit or −inf, Σ_{v≠y} e), e = exp(z'), z' = (x − m)/τ; the last sum leaves the target out, so 1 − p_y stays
    exact for peaked rows.
    `ids` are global; the shard holds [offset, offset + V)."""
    batch, length, vocab = logits.shape
    dtype = stats_dtype(logits.dtype)
    parts = torch.empty(batch, length, SHARD_PARTIALS_WIDTH, dtype=dtype, device=logits.device)
    for b, ts in _row_chunks(batch, length, vocab):
        x = logits[b, ts]
        row_max = x.amax(-1).to(dtype)
        # A shard row that is all −inf (padded vocabulary) contributes nothing; shift it by 0, not by −inf.
        z = _shifted(x, torch.where(row_max == -math.inf, 0.0, row_max), temperature)
        e = torch.exp(z)
        local = ids[b, ts].long().unsqueeze(-1) - offset
        inside = (local >= 0) & (local < vocab)
        y = local.clamp(0, vocab - 1)
        total = e.sum(-1)
        parts[b, ts, 0] = row_max
        parts[b, ts, 1] = total
        parts[b, ts, 2] = torch.where(e > 0, e * z, 0.0).sum(-1)
        parts[b, ts, 3] = torch.where(inside, x.to(dtype).gather(-1, y), -math.inf).squeeze(-1)
        parts[b, ts, 4] = torch.where(inside.squeeze(-1), e.scatter(-1, y, 0.0).sum(-1), total)
    return parts
