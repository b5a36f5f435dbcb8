"""A vocabulary-parallel loss (Megatron-style tensor-parallel lm_head): each rank holds the logits of one
contiguous vocabulary shard. Each rank reduces its shard to per-row partials (its max, Σe, Σe·z', its target
logit); one all-gather of the packed [B, T, 5] partials lets every rank merge the exact full-vocabulary ℓ and H.
The O(B·T) objective then runs identically on every rank, and each rank writes the gradient of its own shard with
no further communication.

The fused-linear form (`fused_linear_grpo_loss(..., vocab_parallel_group=g)`) shards the lm_head weight rows the
same way: each rank folds its own vocabulary tiles into online statistics, one all-gather of [B·T, 4] merges them,
and pass 2 writes the rank's own ∂weight rows. hidden is replicated over the group, so its gradient is the sum of
every shard's part: one all-reduce of the fp32 ∂hidden, inside the forward like the rest of pass 2.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .distributed import comm_device
from .ops.backend import FusedTokenGrad, LinearBackend, LinearInputs, RowBackend, RowCoefficients, logp_from_sums
from .ops.linear_tiles import RowStats


def shard_offset(local_vocab: int, group: dist.ProcessGroup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first vocabulary id of this rank's shard, full vocabulary size), shards in rank order: 0-d int64 tensors on
    the group's communication device, never read back by the host (ids are shifted on the device)."""
    where = comm_device(group, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=where) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.full((1,), local_vocab, dtype=torch.int64, device=where), group=group)
    ends = torch.cat(sizes).cumsum(0)
    rank = dist.get_rank(group)
    return ends[rank] - sizes[rank][0], ends[-1]


def merge_partials(gathered: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[P, B, T, 5] partials of every rank (`RowBackend.shard_partials`) -> (logp, entropy, row_state) of the full
    vocabulary, row_state in the shared layout of ops/backend.py. Merged in float64, so ℓ is float64 as every
    backend's (ops/backend.py, "ℓ in float64"); entropy and row_state in the partials' dtype."""
    dtype = gathered.dtype
    parts = gathered.double()
    m, scale, total, weighted = _merge_sums(parts[..., 0], parts[..., 1], parts[..., 2], 1.0 / temperature)
    z_y = (parts[..., 3].amax(0) - m) / temperature  # the raw target logit is in the one shard that holds it
    e_y = torch.exp(z_y)
    # Σ_{v≠y} e over every shard, with the target's own term in float64 (its shard's fp32 one left out of total)
    others = (scale * parts[..., 4]).sum(0)
    total = others + e_y
    log_sum = torch.log(total)
    logp = logp_from_sums(z_y, e_y, others, log_sum)
    entropy = (log_sum - weighted / total).to(dtype)
    s = log_sum.to(dtype)
    return logp, entropy, torch.stack([m.to(dtype), s, (others / total).to(dtype), s - entropy], dim=-1)


def _merge_sums(
    maxes: torch.Tensor, sums: torch.Tensor, sums_z: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shards' (max, Σ e^{(x−max)·inv_t}, Σ e·(x−max)·inv_t), each [P, ...] -> (global max, each shard's rescale
    factor [P, ...], global Σe, global Σe·z) under the global max. An all −inf shard (max −inf, Σe 0) adds 0."""
    m = maxes.amax(0)
    shift = (maxes - m) * inv_t  # [P, ...]: each shard's max below the global one
    scale = torch.exp(shift)
    total = (scale * sums).sum(0)
    weighted = (scale * (sums_z + torch.where(sums > 0, shift * sums, 0.0))).sum(0)
    return m, scale, total, weighted


class ShardBackend:
    """A `RowBackend` over one contiguous vocabulary shard [offset, offset + V_rank) of the full vocabulary:
    `backend` (the logits backend of this rank) reduces the shard to partials, one all-gather merges them into the
    full vocabulary's ℓ, H and row state, and `backend.row_grad` writes the shard's gradient with shard-local ids.
    `offset` is a 0-d tensor (`shard_offset`): the ids are made shard-local on the device."""

    fused_token_grad: FusedTokenGrad | None = None  # the merge needs every shard's statistics before any gradient

    def __init__(self, group: dist.ProcessGroup, offset: torch.Tensor, backend: RowBackend) -> None:
        self.group, self.offset, self.backend = group, offset, backend

    def row_stats(self, logits, ids, temperature):
        parts = self.backend.shard_partials(logits, ids - self.offset, 0, temperature)  # shard-local ids, offset 0
        gathered = [torch.empty_like(parts) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, parts, group=self.group)
        return merge_partials(torch.stack(gathered), temperature)

    def row_grad(self, logits, ids, state, g, h, temperature, out):
        self.backend.row_grad(logits, ids - self.offset, state, g, h, temperature, out)

    def shard_partials(self, logits, ids, offset, temperature):
        raise NotImplementedError("a vocabulary shard is not sharded again")


def merge_row_stats(st: RowStats, group: dist.ProcessGroup) -> RowStats:
    """The fused-linear pass-1 statistics of one shard -> those of the full vocabulary (one all-gather)."""
    parts = torch.stack([st.max, st.sum_exp, st.sum_exp_z, st.target], dim=-1)  # [N, 4], already divided by τ
    gathered = [torch.empty_like(parts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, parts, group=group)
    every = torch.stack(gathered)  # [P, N, 4]
    m, _, total, weighted = _merge_sums(every[..., 0], every[..., 1], every[..., 2], 1.0)
    return RowStats(m, total, weighted, every[..., 3].amax(0))  # the one shard holding the target has it; else −inf


class LinearShard:
    """A `LinearBackend` over one shard of the lm_head weight rows: `backend` (this rank's tile backend) with
    shard-local ids, the shards' pass-1 statistics merged and the fp32 ∂hidden summed over the group."""

    def __init__(self, backend: LinearBackend, group: dist.ProcessGroup, offset: torch.Tensor) -> None:
        self.backend, self.group, self.offset = backend, group, offset

    def _local(self, inp: LinearInputs) -> LinearInputs:
        return replace(inp, ids=inp.ids - self.offset)

    def stats(self, inp: LinearInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        merge = lambda st: merge_row_stats(st, self.group)
        return self.backend.stats(self._local(inp), merge)

    def grads(self, inp: LinearInputs, coef: RowCoefficients, needs: tuple[bool, bool, bool]) -> tuple:
        reduce_dx = lambda dx: dist.all_reduce(dx, group=self.group)
        return self.backend.grads(self._local(inp), coef, needs, reduce_dx)
