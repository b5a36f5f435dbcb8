"""The few cross-rank reductions the loss needs under torch.distributed, as TRL 1.16 does them.

Every function is the identity without an initialized process group, so single-process code pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over ranks (a new tensor; `x` is not modified)."""
    if not is_distributed():
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather_varlen(x: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every rank (rank order)."""
    if not is_distributed():
        return x
    n = torch.tensor([x.numel()], device=x.device, dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, device=x.device, dtype=x.dtype)
    padded[: x.numel()] = x
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded)
    return torch.cat([c[: int(s.item())] for c, s in zip(chunks, sizes)])
