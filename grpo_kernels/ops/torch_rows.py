"""The CPU path: the row kernels' algorithm in chunked PyTorch, for machines without Triton on the device.

At most one chunk of rows (about `CHUNK_ELEMENTS` elements) exists as float32 vocabulary-wide temporaries at a
time; the only full-size allocation is the gradient, in the logits' dtype. Same interface as triton_logits.
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


def _softmax_parts(
    logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """z, lse, p and Σ p·z for a [rows, V] block, in float32; p·z where p == 0 counts 0 (−inf padding)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)  # [rows]
    p = torch.exp(z - lse.unsqueeze(-1))
    pz = torch.where(p > 0, p * z, 0.0).sum(-1)  # NaN logits still reach lse, so nothing is hidden
    return z, lse, p, pz


def row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse), each [B, T] float32."""
    batch, length, vocab = logits.shape
    logp = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp)
    lse_out = torch.empty_like(logp)
    for b, ts in _row_chunks(batch, length, vocab):
        z, lse, _, pz = _softmax_parts(logits[b, ts], temperature)
        logp[b, ts] = z.gather(-1, ids[b, ts].long().unsqueeze(-1)).squeeze(-1) - lse
        entropy[b, ts] = lse - pz
        lse_out[b, ts] = lse
    return logp, entropy, lse_out


def row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """out = (g·(onehot − p) − h·p·(z − Σ p·z)) / τ, written chunk by chunk; `out` may be `logits` itself."""
    batch, length, vocab = logits.shape
    for b, ts in _row_chunks(batch, length, vocab):
        z = logits[b, ts].float()
        if temperature != 1.0:
            z = z / temperature
        p = torch.exp(z - lse[b, ts].unsqueeze(-1))
        grad = -g[b, ts].unsqueeze(-1) * p
        if h is not None:
            mean_z = (lse[b, ts] - entropy[b, ts]).unsqueeze(-1)  # Σ p·z
            grad -= h[b, ts].unsqueeze(-1) * torch.where(p > 0, p * (z - mean_z), 0.0)
        grad.scatter_add_(-1, ids[b, ts].long().unsqueeze(-1), g[b, ts].unsqueeze(-1))
        if temperature != 1.0:
            grad /= temperature
        out[b, ts] = grad.to(out.dtype)
