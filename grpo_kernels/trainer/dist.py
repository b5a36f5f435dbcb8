"""Data-parallel processes for the trainer: join torchrun's group, gather and reduce small tensors, wrap in DDP,
and fail together.

A single process is rank 0 of a world of 1, and every helper here is then the identity.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..distributed import comm_device
from .errors import USER_ERRORS, PeerError
from .preempt import ending_with_error


@dataclass
class World:
    """The processes of a data-parallel run and this one's place among them: rank 0 of 1 when single-process."""

    rank: int = 0
    size: int = 1  # the number of processes
    owns_group: bool = False  # this run called init_process_group, so it also tears it down

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def multi_process(self) -> bool:
        return self.size > 1


def init_distributed(device: torch.device) -> World:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA); else a single process.
    A group someone else initialized (the caller of `train`) is used as it is and left alone."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return World()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size(), owns_group=True)


def rank_device(device: torch.device, world: World) -> torch.device:
    """The device of this rank: under torchrun a bare "cuda" becomes the rank's own GPU (LOCAL_RANK)."""
    if world.multi_process and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", world.rank % torch.cuda.device_count())))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def barrier(world: World) -> None:
    if world.multi_process:
        dist.barrier()


def gather_cat(x: torch.Tensor, world: World) -> torch.Tensor:
    """The ranks' equally shaped tensors concatenated along dim 0 in rank order (x itself when single-process)."""
    if not world.multi_process:
        return x
    y = x.contiguous().to(comm_device(None, x.device))
    parts = [torch.empty_like(y) for _ in range(world.size)]
    dist.all_gather(parts, y)
    return torch.cat(parts).to(x.device)


def all_reduce_(x: torch.Tensor, world: World, op: Any = None) -> torch.Tensor:
    """x reduced over the ranks (sum unless `op`), in place where the backend allows; x when single-process."""
    if not world.multi_process:
        return x
    y = x.to(comm_device(None, x.device))
    dist.all_reduce(y, op=dist.ReduceOp.SUM if op is None else op)
    return y.to(x.device)


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank when `flag` is true on any (so that all ranks stop at the same step)."""
    return bool(max_over_ranks(int(flag), world))


def max_over_ranks(value: int, world: World) -> int:
    """The largest of the ranks' `value`s, on every rank."""
    op = dist.ReduceOp.MAX if world.multi_process else None
    return int(all_reduce_(torch.tensor(float(value)), world, op).item())


def wrap_ddp(model: Any, device: torch.device, world: World) -> Any:
    """The model that the policy update runs: a DistributedDataParallel wrapper when multi-process, else the model
    itself. Sampling, old/ref log-probs and saving keep using the unwrapped model.

    DDP's construction broadcasts rank 0's parameters and buffers, the frozen base weights included (a one-time
    copy of the model), so every rank starts from the same adapter whatever its own initialization or checkpoint
    did; its reducer then all-reduces and averages the trainable, LoRA, gradients only."""
    if not world.multi_process:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def settle(error: Exception | None, world: World) -> None:
    """Every rank calls this at the same point, with the error it met since the last such point, if any. When any
    rank has one, every rank raises: a failed rank its own error, the others a `PeerError` with the message of the
    first failed rank. So no rank is left waiting in a collective for one that has gone (gloo's "Connection closed
    by peer"), and every rank ends with the same exit code. One scalar all-reduce when no rank failed."""
    if not world.multi_process:
        if error is not None:
            raise error
        return
    if not any_rank(error is not None, world):
        return
    mine = None
    if error is not None:
        mine = (world.rank, 2 if isinstance(error, USER_ERRORS) else 1, str(error))
    reports: list[Any] = [None] * world.size
    dist.all_gather_object(reports, mine)
    ending_with_error()  # the launcher's SIGTERM, sent once a rank has exited, must not cut rank 0's report short
    if error is not None:
        raise error
    rank, code, message = next(r for r in reports if r is not None)
    raise PeerError(f"rank {rank}: {message}", code)


@contextlib.contextmanager
def together(world: World) -> Iterator[None]:
    """`with together(world): ...` on every rank: an error in the block, on any rank, is raised on every rank at its
    end (`settle`). The block may differ between ranks (rank 0 alone writes files) but must not hold collectives."""
    error = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - settled below, raised again on this rank
        error = err
    settle(error, world)
