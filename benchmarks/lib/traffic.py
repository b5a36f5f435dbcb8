"""The L2 question, measured on the kernels rather than on calls: does the gradient pass find its row in L2?

At one shape, CUDA events around single launches of the Triton launchers of grpo_kernels/ops/triton_logits.py
(no host sync inside, no float64 objective): `fused_token_grad` on both grids of its run-time switch, `row_stats`,
`row_grad` and the two one after the other, beside a plain copy of the same bytes; and a control in which the
gradient pass reads an L2-sized chunk of rows cold (after a write that flushes L2) or warm (right after the
statistics pass read it). Each row gives its time, the bytes its launches must move at least, the bandwidth that
makes and its fraction of the copy's.

No row is turned into "DRAM traffic": a kernel that waits on something else (the instruction issue rate) takes the
same time whether its bytes come from L2 or from DRAM, so a time says where the bytes came from only when memory
bounds it. The control answers the question directly: the same launch on the same chunk, cold and warm.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import harness
from .measure import Meter
from .workload import DTYPES, LOGIT_STD, Workload, split_tokens

GRIDS = {
    "sms": "one program per SM or more: every SM busy",
    "l2": "the L2-sized grid: the rows in flight fit in half of L2, so pass 2 can find its row there",
}
CPU_CHUNK_ROWS = 4  # the control's chunk where the device reports no L2 (the dry run on a CPU)


def device_caches(device: str) -> dict[str, Any]:
    """The figures the L2 question turns on: SMs and L2 size (CUDA), or nothing to say (CPU)."""
    if device != "cuda":
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"multiprocessors": props.multi_processor_count, "L2_bytes": getattr(props, "L2_cache_size", None)}


def _event_ms(fn: Callable[[], Any], device: str, before: Callable[[], Any] | None = None) -> float:
    """One launch of `fn` timed alone: CUDA events on the GPU (what `before` runs is outside them), wall-clock on
    the CPU."""
    if before is not None:
        before()
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _timed(fn: Callable[[], Any], device: str, reps: int, warmup: int, before: Callable[[], Any] | None = None):
    times = [_event_ms(fn, device, before) for _ in range(warmup + reps)][warmup:]
    return harness.summarize_ms(times)


class _GridProbe:
    """Stands in for the fused kernel while a row is timed, to record the grid each launch used (so a row says which
    grid ran, whatever the switch did), and launches the kernel itself."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.programs = kernel, set()

    def __getitem__(self, grid: Any) -> Any:
        self.programs.add(grid[0] if isinstance(grid, tuple) else None)
        return self.kernel[grid]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


@contextlib.contextmanager
def fused_grid(choice: str | None) -> Iterator[_GridProbe | None]:
    """The fused kernel's grid set to `choice` ("sms", "l2"; None: the package's default) through
    triton_logits.FUSED_GRID, which the launcher reads at every launch; yields the probe of the grids launched."""
    from grpo_kernels.ops import triton_logits

    if choice is not None and not hasattr(triton_logits, "FUSED_GRID"):
        raise NotImplementedError("this checkout's triton_logits has no FUSED_GRID switch: only its default grid")
    kernel = getattr(triton_logits, "fused_token_grad_fwd_kernel", None)
    probe = None if kernel is None else _GridProbe(kernel)
    saved = getattr(triton_logits, "FUSED_GRID", None)
    if choice is not None:
        triton_logits.FUSED_GRID = choice
    if probe is not None:
        triton_logits.fused_token_grad_fwd_kernel = probe
    try:
        yield probe
    finally:
        if choice is not None:
            triton_logits.FUSED_GRID = saved
        if probe is not None:
            triton_logits.fused_token_grad_fwd_kernel = kernel


def measure_shape(dtype_name: str, vocab: int, tokens: int, device: str, reps: int, warmup: int = 2) -> dict[str, Any]:
    """Every row at one shape; a row that fails says why and costs no other."""
    try:
        return _measure(dtype_name, vocab, tokens, device, reps, warmup)
    finally:
        Meter(device).free()  # the shape's buffers are gone with _measure's frame


def _measure(dtype_name: str, vocab: int, tokens: int, device: str, reps: int, warmup: int) -> dict[str, Any]:
    from grpo_kernels.ops import triton_logits as tk

    batch, length = split_tokens(tokens)
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device).manual_seed(0)
    x = torch.empty(batch, length, vocab, dtype=dtype, device=device).normal_(0.0, LOGIT_STD, generator=gen)
    size = x.numel() * x.element_size()
    ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    logp, _, state = tk.row_stats(x, ids, 1.0)
    logp = logp.float()
    mask = (torch.rand(batch, length, generator=gen, device=device) > 0.1).float()
    fused_args = {
        "advantages": torch.randn(batch, 1, generator=gen, device=device).expand(batch, length),
        "old_logp": logp + 0.2 * torch.randn(batch, length, generator=gen, device=device),
        "ref_logp": logp + 0.1 * torch.randn(batch, length, generator=gen, device=device),
        "rho": None,
        "weight": mask / mask.sum(),
        "entropy_weight": None,
        "cfg": Workload().config(),  # the headline's loss: dapo with a KL term, the one-read fused pass
    }
    g = torch.randn(batch, length, generator=gen, device=device)
    out, copy = torch.empty_like(x), torch.empty_like(x)
    caches = device_caches(device)
    l2 = caches.get("L2_bytes")
    row_bytes = vocab * x.element_size()
    chunk_rows = CPU_CHUNK_ROWS if not l2 else max(1, (l2 // 2) // row_bytes)
    chunk_rows = min(chunk_rows, batch * length)
    flat = (1, batch * length)
    x1, ids1, state1, g1, out1 = x.view(*flat, vocab), ids.view(flat), state.view(*flat, -1), g.view(flat), out.view(
        *flat, vocab)  # fmt: skip
    flush = torch.empty(max(2 * (l2 or 0), 1 << 20), dtype=torch.uint8, device=device)
    chunk = {"at": 0}

    def rows() -> slice:
        start = chunk["at"] * chunk_rows % (batch * length - chunk_rows + 1)
        return slice(start, start + chunk_rows)

    def next_chunk_cold() -> None:
        chunk["at"] += 1
        flush.fill_(chunk["at"] % 255)  # a write twice L2's size: none of the chunk's lines stays there

    def next_chunk_warm() -> None:
        chunk["at"] += 1
        r = rows()
        tk.row_stats(x1[:, r], ids1[:, r], 1.0)  # pass 1 reads the chunk: it is in L2 now

    def grad_chunk() -> None:
        r = rows()
        tk.row_grad(x1[:, r], ids1[:, r], state1[:, r], g1[:, r], None, 1.0, out1[:, r])

    def stats_then_grad() -> None:
        _, _, st = tk.row_stats(x, ids, 1.0)
        tk.row_grad(x, ids, st, g, None, 1.0, out)

    chunk_bytes = chunk_rows * row_bytes
    # name: (bytes the launch must move at least, what it runs, the launch, untimed work before each launch, grid)
    plan: list[tuple[str, int, str, Callable[[], Any], Callable[[], Any] | None, str | None]] = [
        ("copy", 2 * size, "out.copy_(logits): one read, one write", lambda: copy.copy_(x), None, None),
    ]
    for grid, what in GRIDS.items():
        plan.append((f"fused_token_grad [{grid}]", 2 * size, f"one read, gradient written; {what}",
                     lambda: tk.fused_token_grad(x, ids, 1.0, out=out, **fused_args), None, grid))  # fmt: skip
    plan += [
        ("row_stats", size, "the statistics pass: one read", lambda: tk.row_stats(x, ids, 1.0), None, None),
        ("row_grad", 2 * size, "the gradient pass: one read, one write (the buffer is far larger than L2)",
         lambda: tk.row_grad(x, ids, state, g, None, 1.0, out), None, None),
        ("row_stats + row_grad", 3 * size, "both passes, one after the other: two reads, one write",
         stats_then_grad, None, None),
        ("row_grad, chunk cold", 2 * chunk_bytes, f"{chunk_rows} rows after a write of 2x L2: read from DRAM",
         grad_chunk, next_chunk_cold, None),
        ("row_grad, chunk warm", 2 * chunk_bytes, f"the same {chunk_rows} rows right after row_stats read them",
         grad_chunk, next_chunk_warm, None),
    ]  # fmt: skip
    shape: dict[str, Any] = {"dtype": dtype_name, "V": vocab, "BT": tokens, "B": batch, "T": length, "S_bytes": size,
                             "chunk_rows": chunk_rows, "rows": []}  # fmt: skip
    for name, nbytes, what, fn, before, grid in plan:
        row: dict[str, Any] = {"name": name, "what": what, "bytes": nbytes, "status": "ok", "note": ""}
        try:
            with fused_grid(grid) if name.startswith("fused") else contextlib.nullcontext() as probe:
                t = _timed(fn, device, reps, warmup, before)
            row.update(time_ms=t, GBps=nbytes / (t["median"] / 1e3) / 1e9)
            if probe is not None:
                row["programs"] = sorted(probe.programs, key=str)
        except NotImplementedError as e:
            row.update(status="unsupported", note=str(e))
        except Exception as e:  # noqa: BLE001 - a row that fails says why, the others still run
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
        shape["rows"].append(row)
    if not any(r["name"].startswith("fused") and r["status"] == "ok" for r in shape["rows"]):
        row = {"name": "fused_token_grad [default]", "what": "one read, gradient written; the package's default grid",
               "bytes": 2 * size, "status": "ok", "note": ""}  # fmt: skip
        try:
            with fused_grid(None) as probe:
                t = _timed(lambda: tk.fused_token_grad(x, ids, 1.0, out=out, **fused_args), device, reps, warmup)
            row.update(time_ms=t, GBps=2 * size / (t["median"] / 1e3) / 1e9)
            row["programs"] = None if probe is None else sorted(probe.programs, key=str)
        except Exception as e:  # noqa: BLE001
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
        shape["rows"].append(row)
    copy_row = shape["rows"][0]
    shape["copy_GBps"] = copy_row.get("GBps")
    for row in shape["rows"]:
        if row.get("GBps") and shape["copy_GBps"]:
            row["copy_fraction"] = row["GBps"] / shape["copy_GBps"]
    return shape


def time_ratio(shape: dict[str, Any], a: str, b: str) -> float | None:
    """Median time of row `a` over row `b`'s, where both ran."""
    by = {r["name"]: r for r in shape["rows"] if r["status"] == "ok"}
    if a not in by or b not in by:
        return None
    return by[a]["time_ms"]["median"] / by[b]["time_ms"]["median"]
