"""The CPU path: the row kernels' algorithm in chunked PyTorch, for machines without Triton on the device.

At most one chunk of rows (about `CHUNK_ELEMENTS` elements) exists as float32 vocabulary-wide temporaries at a
time; the only full-size allocation is the gradient, in the logits' dtype. Same interface as triton_logits.

Precision: everything is taken relative to the row's raw maximum, z' = (x − max x) / τ, so that logits of size
1e4 lose nothing to an fp32 logsumexp of size 1e4; 1 − p_y is summed over the other tokens rather than formed
as a difference, so a peaked row (p_y → 1) keeps its target gradient exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# 4 Mi float32 elements = 16 MiB per temporary: big enough to amortize op overhead on a CPU, small next to the
# logits (a 4096 x 32000 batch is 131 Mi elements).
CHUNK_ELEMENTS = 1 << 22


def _row_chunks(batch: int, length: int, vocab: int) -> Iterator[tuple[int, slice]]:
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for b in range(batch):
        for start in range(0, length, rows):
            yield b, slice(start, min(start + rows, length))


def _shifted(x: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """z' = (x − max) / τ in float32: the subtraction is exact for the tokens that carry probability."""
    z = x.float() - row_max.unsqueeze(-1)
    return z / temperature if temperature != 1.0 else z


def empty_row_state(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.empty(batch, length, 3, dtype=torch.float32, device=device)


def row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, row_state): logp, entropy [B, T] float32; row_state [B, T, 3] = (raw row max, log Σ e^z',
    1 − p_y)."""
    batch, length, vocab = logits.shape
    logp = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp)
    state = empty_row_state(batch, length, logits.device)
    lowest = torch.finfo(torch.float32).min
    for b, ts in _row_chunks(batch, length, vocab):
        x = logits[b, ts]
        y = ids[b, ts].long().unsqueeze(-1)
        row_max = x.amax(-1).float()
        z = _shifted(x, row_max, temperature).clamp_(min=lowest)  # [rows, V] <= 0; −inf -> lowest keeps e·z at 0
        e = torch.exp(z)
        e_y = e.gather(-1, y).squeeze(-1)
        z_y = z.gather(-1, y).squeeze(-1)
        e.scatter_(-1, y, 0.0)  # the sums below run over v != y: 1 − p_y without cancellation
        others = e.sum(-1)
        total = others + e_y
        log_sum = torch.log(total)
        weighted = torch.linalg.vecdot(e, z) + e_y * z_y  # Σ e·z' without a [rows, V] product
        # ℓ = −log(1 + Σ_{v≠y} e_v / e_y): exact near 0 through log1p; plain z'_y − log Σ where p_y is tiny.
        logp[b, ts] = torch.where(z_y > -20.0, -torch.log1p(others / e_y), z_y - log_sum)
        entropy[b, ts] = log_sum - weighted / total
        state[b, ts, 0] = row_max
        state[b, ts, 1] = log_sum
        state[b, ts, 2] = others / total
    return logp, entropy, state


def row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    state: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
    vocab_offset: int = 0,
) -> None:
    """out = (g·(onehot − p) − h·p·(z − Σ p·z)) / τ, written chunk by chunk; `out` may be `logits` itself.

    `vocab_offset`: the logits are the vocabulary shard [offset, offset + V) of a larger vocabulary (state from
    vocab_parallel.merge_partials); a target outside the shard contributes no one-hot here."""
    batch, length, vocab = logits.shape
    for b, ts in _row_chunks(batch, length, vocab):
        local = ids[b, ts].long().unsqueeze(-1) - vocab_offset
        inside = (local >= 0) & (local < vocab)  # [rows, 1]
        y = local.clamp(0, vocab - 1)
        row_max, log_sum, others = state[b, ts, 0], state[b, ts, 1], state[b, ts, 2]
        g_b = g[b, ts].unsqueeze(-1)
        z = _shifted(logits[b, ts], row_max, temperature)
        target = g_b * others.unsqueeze(-1)  # g·(1 − p_y), exact for a peaked row
        if h is None:
            grad = z.sub_(log_sum.unsqueeze(-1)).exp_().mul_(-g_b)  # −g·p, in place
            grad.scatter_(-1, y, torch.where(inside, target, grad.gather(-1, y)))
        else:
            p = torch.exp(z - log_sum.unsqueeze(-1))
            centered = z.sub_((log_sum - entropy[b, ts]).unsqueeze(-1))  # z' − Σ p·z'
            grad = torch.where(p > 0, p * centered, 0.0).mul_(-h[b, ts].unsqueeze(-1))  # −h·p·(z' − Σpz')
            p.scatter_(-1, y, torch.where(inside, 0.0, p.gather(-1, y)))  # the target's −g·p_y is in `target`
            grad.sub_(g_b * p).scatter_add_(-1, y, torch.where(inside, target, 0.0))
        if temperature != 1.0:
            grad /= temperature
        out[b, ts] = grad
