"""The few cross-rank reductions the loss needs under torch.distributed, as TRL 1.16 does them.

Each takes the data-parallel group (None: no reduction), so single-process code pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_data_group() -> dist.ProcessGroup | None:
    """The default process group when torch.distributed is initialized, else None."""
    return dist.group.WORLD if is_distributed() else None


def resolve_data_group(data_parallel_group: object, vocab_parallel_group: object) -> object:
    """The group the loss's cross-rank defaults span: the one given; else, without a vocabulary group, the default
    process group when torch.distributed is initialized; with one, none (its ranks hold the same sequences)."""
    if data_parallel_group is not None:
        return data_parallel_group
    return default_data_group() if vocab_parallel_group is None else None


def check_group(name: str, group: object) -> None:
    """A process-group argument must be None or a ProcessGroup of an initialized torch.distributed."""
    if group is None:
        return
    if not is_distributed():
        raise ValueError(f"{name} was given but torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of `x` over the group's ranks (a new tensor; `x` is not modified)."""
    if group is None:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_varlen(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every rank (rank order)."""
    if group is None:
        return x
    n = torch.tensor([x.numel()], device=x.device, dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, device=x.device, dtype=x.dtype)
    padded[: x.numel()] = x
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([c[: int(s.item())] for c, s in zip(chunks, sizes)])


def gather_sharded(x: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor (an FSDP2 / fully_shard parameter, a tensor-parallel shard) as the full local tensor; other tensors
    (and None) as they are. Differentiable: the gradient flows back as Partial("avg"), i.e. reduce-scattered and
    averaged over the mesh, FSDP's data-parallel convention (each rank's gradient is its share of the batch's mean;
    ranks that hold the same batch, as in tensor parallelism, average to that same gradient)."""
    if x is None or not dist.is_available():
        return x
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate
    except ImportError:  # torch < 2.5: no public DTensor, so x cannot be one we know how to gather
        return x
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    full = x.redistribute(mesh, [Replicate()] * mesh.ndim)
    return full.to_local(grad_placements=[Partial("avg")] * mesh.ndim)


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a small bookkeeping collective over `group` (None: the default group) runs for a tensor on `device`:
    NCCL takes CUDA tensors only (a CPU one moves to the current CUDA device), gloo takes CPU ones."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
