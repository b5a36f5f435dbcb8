"""A vocabulary-parallel loss (Megatron-style tensor-parallel lm_head): each rank holds the logits of one
contiguous vocabulary shard. Each rank reduces its shard to per-row partials (its max, Σe, Σe·z', its target
logit); one all-gather of the packed [B, T, 4] partials lets every rank merge the exact full-vocabulary ℓ and H.
The O(B·T) objective then runs identically on every rank, and each rank writes the gradient of its own shard with
no further communication.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .ops.torch_rows import _row_chunks, _shifted


def shard_offset(local_vocab: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """(first vocabulary id of this rank's shard, full vocabulary size), shards in rank order."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([local_vocab], dtype=torch.int64), group=group)
    sizes = [int(s) for s in sizes]
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes)


def shard_partials(logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
    """[B, T, 4] float32 per row of the shard: (raw max m, Σ e, Σ e·z', raw target logit or −inf), e = exp(z'),
    z' = (x − m)/τ."""
    batch, length, vocab = logits.shape
    parts = torch.empty(batch, length, 4, dtype=torch.float32, device=logits.device)
    for b, ts in _row_chunks(batch, length, vocab):
        x = logits[b, ts]
        row_max = x.amax(-1).float()
        # A shard row that is all −inf (padded vocabulary) contributes nothing; shift it by 0, not by −inf.
        z = _shifted(x, torch.where(row_max == -math.inf, 0.0, row_max), temperature)
        e = torch.exp(z)
        local = ids[b, ts].long() - offset
        inside = (local >= 0) & (local < vocab)
        x_y = x.float().gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        parts[b, ts, 0] = row_max
        parts[b, ts, 1] = e.sum(-1)
        parts[b, ts, 2] = torch.where(e > 0, e * z, 0.0).sum(-1)
        parts[b, ts, 3] = torch.where(inside, x_y, -math.inf)
    return parts


def merge_partials(gathered: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[P, B, T, 4] partials of every rank -> (logp, entropy, state [B, T, 2] = (global raw max, log Σe))."""
    m = gathered[..., 0].amax(0)  # [B, T]
    scale = torch.exp((gathered[..., 0] - m) / temperature)  # [P, B, T]: each shard's sums under the global max
    total = (scale * gathered[..., 1]).sum(0)
    shift = (gathered[..., 0] - m) / temperature
    weighted = (scale * (gathered[..., 2] + torch.where(gathered[..., 1] > 0, shift * gathered[..., 1], 0.0))).sum(0)
    log_sum = torch.log(total)
    x_y = gathered[..., 3].amax(0)
    logp = (x_y - m) / temperature - log_sum
    entropy = log_sum - weighted / total
    return logp, entropy, torch.stack([m, log_sum], dim=-1)


def shard_row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, group: dist.ProcessGroup, offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = shard_partials(logits, ids, offset, temperature)
    gathered = [torch.empty_like(parts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, parts, group=group)
    return merge_partials(torch.stack(gathered), temperature)


def shard_row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    state: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
    offset: int,
) -> None:
    """This shard's part of (g·(onehot − p) − h·p·(z − Σpz)) / τ; no communication."""
    batch, length, vocab = logits.shape
    for b, ts in _row_chunks(batch, length, vocab):
        row_max, log_sum = state[b, ts, 0], state[b, ts, 1]
        z = _shifted(logits[b, ts], row_max, temperature)
        p = torch.exp(z - log_sum.unsqueeze(-1))
        grad = -g[b, ts].unsqueeze(-1) * p
        local = ids[b, ts].long() - offset
        inside = (local >= 0) & (local < vocab)
        onehot = torch.zeros_like(p).scatter_(-1, local.clamp(0, vocab - 1).unsqueeze(-1), inside.float().unsqueeze(-1))
        grad += g[b, ts].unsqueeze(-1) * onehot
        if h is not None:
            centered = z - (log_sum - entropy[b, ts]).unsqueeze(-1)
            grad -= h[b, ts].unsqueeze(-1) * torch.where(p > 0, p * centered, 0.0)
        if temperature != 1.0:
            grad /= temperature
        out[b, ts] = grad.to(out.dtype)


class ShardBackend:
    """The row-backend interface over one vocabulary shard (api.forward_rows drives it like torch_rows)."""

    def __init__(self, group: dist.ProcessGroup, offset: int, vocab: int) -> None:
        self.group, self.offset, self.vocab = group, offset, vocab

    def row_stats(self, logits, ids, temperature):
        return shard_row_stats(logits, ids, temperature, self.group, self.offset)

    def row_grad(self, logits, ids, state, entropy, g, h, temperature, out):
        shard_row_grad(logits, ids, state, entropy, g, h, temperature, out, self.offset)
