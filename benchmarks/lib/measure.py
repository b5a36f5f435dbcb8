"""Timing and peak memory of one call, the device's ceilings, and one contender's row at one shape: warmed up, then
timed, its record complete before the next contender starts."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from . import harness
from .contenders import CONTENDERS, make_step
from .workload import Inputs


class Meter:
    """Times one call and measures its peak memory above what was allocated before it (the inputs)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device == "cuda"
        self.peak_method = (
            "torch.cuda.max_memory_allocated() minus memory_allocated() before the call"
            if self.cuda
            else "peak RSS (VmHWM, reset before the call) minus RSS before the call"
        )

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, step: Callable) -> tuple[float, int, Any]:
        if self.cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), torch.cuda.max_memory_allocated() - before, out
        before = harness.rss_bytes()
        if not harness.reset_peak_rss():
            self.peak_method = "ru_maxrss of a fresh process minus RSS before the call (VmHWM reset unavailable)"
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        ms = (time.perf_counter() - t0) * 1e3
        # CPU time of this process, all threads: less at the mercy of other load on a shared machine than wall-clock
        self.last_cpu_ms = (time.process_time() - c0) * 1e3
        return ms, harness.peak_rss_bytes() - before, out

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def is_oom(self, err: BaseException) -> bool:
        if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
            return True
        text = str(err)
        return "out of memory" in text or "CUDA_ERROR_OUT_OF_MEMORY" in text or "can't allocate memory" in text

    def context_broken(self, err: BaseException) -> bool:
        """After a failure: can this process still use the device? A CUDA context that saw an illegal address or a
        device-side assert fails every later call, which a tiny probe shows."""
        if not self.cuda:
            return "illegal memory access" in str(err)  # only the fake fault (FAULT_ENV) reaches this on a CPU
        try:
            torch.cuda.synchronize()
            torch.ones(1, device="cuda").add_(1).item()
            return False
        except Exception:  # noqa: BLE001
            return True

    def free_bytes(self) -> int | None:
        if self.cuda:
            return torch.cuda.mem_get_info()[0]
        total = harness.total_memory_bytes()
        return None if total is None else total - harness.rss_bytes()


def timed_ms(fn: Callable[[], Any], device: str, reps: int, warmup: int = 3) -> dict[str, float]:
    """Median [p20, p80] of `reps` calls after `warmup` untimed ones (CUDA events on the GPU, wall-clock on the CPU)."""
    meter = Meter(device)
    times = [meter.call(fn)[0] for _ in range(warmup + reps)][warmup:]
    meter.free()
    return harness.summarize_ms(times)


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> dict[str, float]:
    """The device's measured copy bandwidth: one large copy, bytes read + bytes written over the time."""
    bufs = [torch.ones(nbytes // 4, dtype=torch.float32, device=device), torch.empty(nbytes // 4, device=device)]
    stats = timed_ms(lambda: bufs[1].copy_(bufs[0]), device, reps)
    bufs.clear()
    Meter(device).free()
    return {"bytes": nbytes, "median_ms": stats["median"], "GBps": 2 * nbytes / (stats["median"] / 1e3) / 1e9}


def matmul_rate(device: str, n: int, dtype: torch.dtype, reps: int = 10) -> dict[str, Any]:
    """The device's measured matrix-product rate: an n x n x n product of random values, 2·n³ flops per call."""
    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=gen).to(dtype) for _ in range(2))
    stats = timed_ms(lambda: a @ b, device, reps)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "median_ms": stats["median"],
            "TFLOPs": 2 * n**3 / (stats["median"] / 1e3) / 1e12}  # fmt: skip


NOT_REACHED = "not_reached"  # the status of a row the run ended before (a kill, the budget): what a cut leaves


def new_record(name: str, batch: int, length: int, vocab: int, dtype_name: str) -> dict[str, Any]:
    return {
        "contender": name,
        "dtype": dtype_name,
        "V": vocab,
        "BT": batch * length,
        "B": batch,
        "T": length,
        "status": "ok",
        "note": "",
        "time_ms": None,
        "peak_bytes": None,
        "GBps": None,
        "copy_bw_fraction": None,
        "loss": None,
        "grad_norm": None,
    }


def logits_bytes_moved(rec: dict[str, Any], itemsize: int) -> int:
    # Counted: one read of the (B, T, V) logits and one write of their gradient, each in the logits' dtype. That is
    # the least any fused forward+backward can move; extra passes and float32 temporaries show as lower GB/s.
    return 2 * rec["BT"] * rec["V"] * itemsize


def grad_norm(grad: torch.Tensor) -> float:
    """A fingerprint of the gradient to compare contenders by (Liger's has a zero row per sequence more). Chunked:
    a float32 copy of a whole bf16 gradient would not fit beside the largest inputs."""
    batch, length, vocab = grad.shape
    rows = max(1, (1 << 26) // vocab)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for b in range(batch):
        for t in range(0, length, rows):
            total += torch.linalg.vector_norm(grad[b, t : t + rows], dtype=torch.float32).double() ** 2
    return math.sqrt(float(total))


def fail(rec: dict[str, Any], meter: Meter, err: BaseException) -> None:
    rec["status"] = "oom" if meter.is_oom(err) else "error"
    rec["note"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:240] if str(err).strip() else ''}"


class ContextBroken(Exception):
    """A contender left the CUDA context unusable (an illegal address, a device-side assert): this process can run
    nothing more, so it reports which contender did it and exits; the supervisor carries on without that one."""

    def __init__(self, contender: str, note: str) -> None:
        super().__init__(note)
        self.contender, self.note = contender, note


def time_contender(
    name: str, fn: Callable, inp: Inputs, meter: Meter, spec: dict[str, Any], rec: dict[str, Any]
) -> dict[str, Any]:
    """Warm one contender up (its first call records the loss and the gradient's norm), then time its calls, about
    spec["contender_budget_s"] of them (between spec["min_reps"] and spec["reps"]). Fills `rec` and returns it; a
    failure is the record's status and note, and raises ContextBroken when this process can run nothing more."""
    contender = CONTENDERS[name]
    step = make_step(contender, fn, inp)
    times: list[float] = []
    peak = 0
    err: Exception | None = None
    try:
        est_ms = 0.0
        for i in range(spec["warmup"]):
            est_ms, _, (loss, grad) = meter.call(step)
            if i == 0:
                rec["loss"] = float(loss)
                rec["grad_norm"] = grad_norm(grad)
            del loss, grad
            if contender.inplace:
                inp.refill()
        n_reps = max(spec["min_reps"], min(spec["reps"], int(spec["contender_budget_s"] * 1e3 / max(est_ms, 1e-3))))
        for _ in range(n_reps):
            ms, peak_i, out = meter.call(step)
            del out
            times.append(ms)
            peak = max(peak, peak_i)
            if contender.inplace:
                inp.refill()
    except Exception as e:  # noqa: BLE001 - one contender's failure is a row of the table, not the end of the run
        err = e
    if err is not None:
        fail(rec, meter, err)
        broken = meter.context_broken(err)
        del err  # its traceback holds the call's tensors
        if broken:
            raise ContextBroken(name, rec["note"]) from None
        if contender.inplace:
            inp.refill()
        meter.free()
        return rec
    rec["time_ms"] = harness.summarize_ms(times)
    rec["peak_bytes"] = peak
    rec["GBps"] = logits_bytes_moved(rec, inp.full.element_size()) / (rec["time_ms"]["median"] / 1e3) / 1e9
    return rec
