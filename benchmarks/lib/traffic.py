"""The L2 question, measured: does the gradient pass of the two-kernel schedule (row statistics, then the gradient)
re-read the logits from L2 or from DRAM?

At one shape, each schedule is timed beside a plain copy of the same bytes. With S = B·T·V·itemsize, the copy moves
2·S (one read, one write) at the device's copy rate R; a schedule that takes t is worth t·R bytes at that rate, its
implied DRAM traffic, an upper bound (a kernel that waits on something else looks as if it moved more). The floors:

| schedule | reads + writes of the logits | floor |
| --- | --- | --- |
| read (amax over V) | 1 read | 1·S |
| stats only (no gradient) | 1 read | 1·S |
| fused one-read forward + backward (token-level loss) | 1 read, 1 write | 2·S |
| stats + grad (sequence-level loss) | 2 reads, 1 write | 2·S if the re-read hits L2, 3·S if not |

The difference of the last two, (t_two − t_fused)·R / S, is the share of the second read that came from DRAM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from grpo_kernels import grpo_loss

from .contenders import Contender, make_step, ours_backend
from .measure import Meter, timed_ms
from .workload import DTYPES, Inputs, Workload, make_inputs, split_tokens

SCHEDULES = {  # name: (floor in units of S, what it runs)
    "copy": (2.0, "x.clone(): one read, one write"),
    "read": (1.0, "x.amax(-1): one read"),
    "stats_only": (1.0, "grpo_loss without a gradient: the row-statistics pass alone"),
    "fused_one_read": (2.0, "grpo_loss forward + backward, token-level: one read of each row, gradient written"),
    "stats_then_grad": (2.0, "grpo_loss forward + backward, sequence-level: statistics pass, then gradient pass"),
}


def _loss_fn(w: Workload, device: str, level: str) -> Callable[[torch.Tensor, Inputs], torch.Tensor]:
    backend = ours_backend(device)
    opts = {**asdict(w), "importance_sampling_level": level}

    def fn(logits: torch.Tensor, inp: Inputs) -> torch.Tensor:
        return grpo_loss(logits, *inp.tensors, backend=backend, **opts).loss

    return fn


def _time_schedules(inp: Inputs, device: str, reps: int) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    x = inp.full[:, :-1]  # the shifted view trainers pass
    w = Workload()
    stats_fn = _loss_fn(w, device, "token")

    def stats_only() -> torch.Tensor:
        with torch.no_grad():
            return stats_fn(x, inp)

    ours = Contender("ours", "", None)  # type: ignore[arg-type]  # what make_step reads: name, in place, buffer
    steps = {
        "copy": lambda: x.clone(),
        "read": lambda: x.amax(-1),
        "stats_only": stats_only,
        "fused_one_read": make_step(ours, _loss_fn(w, device, "token"), inp),
        "stats_then_grad": make_step(ours, _loss_fn(w, device, "sequence"), inp),
    }
    times, errors = {}, {}
    for name in SCHEDULES:
        try:
            times[name] = timed_ms(steps[name], device, reps, warmup=2)
        except Exception as e:  # noqa: BLE001 - a schedule that fails is a row that says why
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return times, errors


def measure_shape(dtype_name: str, vocab: int, tokens: int, device: str, reps: int) -> dict[str, Any]:
    """Every schedule of SCHEDULES at one shape, with the implied traffic of each."""
    batch, length = split_tokens(tokens)
    inp = make_inputs(batch, length, vocab, DTYPES[dtype_name], device)
    size = batch * length * vocab * inp.full.element_size()
    times, errors = _time_schedules(inp, device, reps)
    inp = None
    Meter(device).free()
    out: dict[str, Any] = {"dtype": dtype_name, "V": vocab, "BT": tokens, "B": batch, "T": length, "S_bytes": size}
    if errors:
        out["errors"] = errors
    rate = 2 * size / (times["copy"]["median"] / 1e3) if "copy" in times else None  # bytes/s
    out["copy_GBps"] = rate / 1e9 if rate else None
    out["schedules"] = {
        name: {
            "time_ms": t,
            "floor_S": SCHEDULES[name][0],
            "implied_S": rate * t["median"] / 1e3 / size if rate else None,
        }
        for name, t in times.items()
    }
    fused, two = times.get("fused_one_read"), times.get("stats_then_grad")
    if rate and fused and two:
        out["reread_from_dram"] = (two["median"] - fused["median"]) / 1e3 * rate / size
    return out


def device_caches(device: str) -> dict[str, Any]:
    """The figures the L2 question turns on: SMs and L2 size (CUDA), or nothing to say (CPU)."""
    if device != "cuda":
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"multiprocessors": props.multi_processor_count, "L2_bytes": getattr(props, "L2_cache_size", None)}
