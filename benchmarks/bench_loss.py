"""Forward+backward of the GRPO loss from logits, side by side: eager PyTorch, torch.compile, TRL 1.16, Liger-Kernel
0.8.5 and grpo_kernels, on the same inputs in one run. Results land in benchmarks/results/<device>.{json,md,png}.

    python benchmarks/bench_loss.py --device cuda     # the GPU table (benchmarks/gpu_check.sh wraps it)
    python benchmarks/bench_loss.py --device cpu      # the CPU table: each contender in a fresh process
    python benchmarks/bench_loss.py --dry-run         # the GPU code path on the CPU at toy sizes (the smoke test)

Every contender computes the same thing: the per-token log-probs and the entropy (as trainers do, for the entropy
metric; with --entropy-coef != 0 the entropy bonus too), the loss of TRL's GRPOTrainer._compute_loss for the
workload below, and the gradient w.r.t. the logits. A contender that is not installed, or can't run here, gets a
row that says so; none is dropped silently.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

# harness.py, and grpo_kernels / reference from this checkout (installed or not), when run from anywhere
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import harness

# ----------------------------------------------------------------------------------------------------------------
# The workload and the shapes

LOGIT_STD = 2.0  # random logits with the spread of a real LM head's: softmax neither flat nor one-hot
SEQ_LEN = 1024  # T: B·T is split as B sequences of (up to) 1024 completion tokens
GPU_VOCABS = (32000, 151936, 262144)  # Llama-2 / Qwen2.5-3 / Gemma-3
GPU_TOKENS = (2048, 16384, 65536)  # B·T
CPU_VOCABS = (32000,)
CPU_TOKENS = (1024, 2048, 4096)  # fits the 2-core, 23 GiB machine with every contender, in a few minutes
DRY_VOCABS = (1000,)
DRY_TOKENS = (64, 128)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class Workload:
    """The loss every contender computes: TRL 1.16's default loss type with a KL term, so that each contender reads
    old and reference log-probs too (a trainer with num_iterations > 1 or vLLM, and beta > 0)."""

    loss_type: str = "dapo"  # GRPOConfig's default
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28  # DAPO's clip-higher
    temperature: float = 1.0
    entropy_coef: float = 0.0  # GRPOConfig's default: the entropy is computed (a metric), no gradient through it


@dataclass
class Inputs:
    """One batch. `full` is the (B, T+1, V) buffer a model's forward returns; contenders that take logits already
    shifted get the view full[:, :-1] (no copy), Liger gets `full` itself, as its kernel requires."""

    full: torch.Tensor  # [B, T+1, V]
    ids: torch.Tensor  # [B, T] int64
    advantages: torch.Tensor  # [B] float32
    mask: torch.Tensor  # [B, T] int64, tail padding as in a batch of completions of varied lengths
    old_logp: torch.Tensor  # [B, T] float32
    ref_logp: torch.Tensor  # [B, T] float32
    seed: int
    pristine: torch.Tensor | None = None  # a copy to restore from, where memory is cheaper than regenerating

    def refill(self) -> None:
        """Rewrite the logits with the values they started with: in-place contenders overwrite them with gradients."""
        with torch.no_grad():
            if self.pristine is not None:
                self.full.copy_(self.pristine)
                return
            gen = torch.Generator(self.full.device).manual_seed(self.seed)
            self.full.normal_(0.0, LOGIT_STD, generator=gen)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the loss takes besides the logits, in eager_loss's order."""
        return self.ids, self.advantages, self.mask, self.old_logp, self.ref_logp

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.full, self.ids, self.advantages, self.mask, self.old_logp, self.ref_logp)
        )


def split_tokens(tokens: int) -> tuple[int, int]:
    length = min(SEQ_LEN, tokens)
    return max(1, tokens // length), length


def make_inputs(batch: int, length: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Deterministic inputs (the same in every process for a seed), built without a full-size temporary."""
    full = torch.empty(batch, length + 1, vocab, dtype=dtype, device=device)
    inp = Inputs(full, *(torch.empty(0),) * 5, seed=seed)  # type: ignore[arg-type]
    inp.refill()
    gen = torch.Generator(device).manual_seed(seed + 1)
    inp.ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    inp.advantages = torch.randn(batch, generator=gen, device=device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen, device=device)
    inp.mask = (torch.arange(length, device=device) < lengths.unsqueeze(1)).long()
    logp = _true_logp(full[:, :-1], inp.ids)
    # Near-on-policy old/ref log-probs: ratios around 1, some of them past the clip range.
    inp.old_logp = logp + 0.2 * torch.randn(logp.shape, generator=gen, device=device)
    inp.ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=gen, device=device)
    return inp


@torch.no_grad()
def _true_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    batch, length, vocab = logits.shape
    rows = max(1, (1 << 26 if logits.is_cuda else 1 << 20) // vocab)  # float32 temporaries of 256 MiB / 4 MiB
    out = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    for b in range(batch):
        for t in range(0, length, rows):
            z = logits[b, t : t + rows].float()
            out[b, t : t + rows] = z.gather(-1, ids[b, t : t + rows, None]).squeeze(-1) - z.logsumexp(-1)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The loss math, transcribed from TRL 1.16's GRPOTrainer._compute_loss (token-level importance sampling, the clipped
# loss types, the k3 KL, the entropy bonus), so that eager, torch.compile and TRL's log-prob kernel all finish the
# same way. The metrics TRL logs beside it are O(B·T) and left out of every contender alike.


def trl_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    w: Workload,
) -> torch.Tensor:
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - w.epsilon_low, 1 + w.epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if w.beta != 0.0:
        per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token_loss = per_token_loss + w.beta * per_token_kl
    if w.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif w.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif w.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * per_token_loss.size(1))
    elif w.loss_type == "dapo":  # num_items_in_batch = the active tokens of this batch, one process
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        raise ValueError(f"the benchmark's loss math covers grpo, bnpo, dr_grpo and dapo, got {w.loss_type!r}")
    if w.entropy_coef != 0.0:
        loss = loss - w.entropy_coef * (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return loss


# ----------------------------------------------------------------------------------------------------------------
# The contenders. Each `build` returns fn(logits, inp) -> loss; `full_buffer` says whether fn takes the whole
# (B, T+1, V) buffer rather than the shifted view.


def eager_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    w: Workload,
) -> torch.Tensor:
    """As users write it: TRL's loss math after `logits.float().log_softmax(-1).gather(...)` and the entropy from the
    same log-softmax (written here rather than taken from reference/, which runs in float64 for obviousness)."""
    z = logits.float()
    if w.temperature != 1.0:
        z = z / w.temperature
    logp_all = z.log_softmax(-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and w.entropy_coef != 0.0):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return trl_loss(logp, entropy, advantages, mask, old_logp, ref_logp, w)


@dataclass
class Contender:
    name: str
    description: str
    build: Callable[[Workload, str], Callable[[torch.Tensor, Inputs], torch.Tensor]]
    requires: tuple[str, ...] = ()  # distributions that must be installed; else the row says "missing"
    pinned: dict[str, str] = field(default_factory=dict)  # the versions the issue names
    inplace: bool = False  # overwrites the logits with the gradient
    full_buffer: bool = False
    cuda_only: bool = False

    def availability(self, device: str) -> tuple[str, str]:
        """("ok" | "missing" | "unsupported", why)."""
        for dist in self.requires:
            if importlib.util.find_spec(dist.replace("-", "_")) is None:
                return "missing", f"{dist} is not installed (pip install {dist}=={self.pinned.get(dist, '')})"
        if self.cuda_only and device != "cuda":
            return "unsupported", "its Triton kernel runs on CUDA only"
        return "ok", ""


def _build_eager(w: Workload, device: str) -> Callable:
    return lambda logits, inp: eager_loss(logits, *inp.tensors, w)


def _build_compile(w: Workload, device: str) -> Callable:
    # Default torch.compile, as a user would call it: static shapes at the first shape, automatically dynamic after
    # the first recompile. Compilation happens in the warm-up calls, outside the timing.
    # Tensors only as arguments, so that a new shape or dtype costs at most an automatic-dynamic recompile; the limit
    # is raised so that no shape of the table can silently fall back to eager.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    setattr(config, limit, max(getattr(config, limit), 64))

    def loss(logits, ids, advantages, mask, old_logp, ref_logp):
        return eager_loss(logits, ids, advantages, mask, old_logp, ref_logp, w)

    compiled = torch.compile(loss)
    return lambda logits, inp: compiled(logits, *inp.tensors)


def _build_trl(w: Workload, device: str) -> Callable:
    note = ""
    try:
        from trl.trainer.utils import selective_log_softmax_and_entropy
    except Exception as e:
        # trl.trainer.utils pulls in datasets, dill, multiprocess, accelerate and much of transformers; on CUDA that
        # function only forwards to this kernel, so a machine where that import fails still measures TRL's path.
        if device != "cuda":
            raise
        from trl.kernels import selective_log_softmax_and_entropy as _kernel

        note = f"trl.trainer.utils did not import ({type(e).__name__}); called the trl.kernels function it forwards to"

        def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0):
            logp, entropy = _kernel(logits, index, temperature=temperature)
            return logp, entropy if entropy_requires_grad else entropy.detach()

    def fn(logits: torch.Tensor, inp: Inputs) -> torch.Tensor:
        logp, entropy = selective_log_softmax_and_entropy(
            logits, inp.ids, entropy_requires_grad=w.entropy_coef != 0.0, temperature=w.temperature
        )
        return trl_loss(logp, entropy, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, w)

    fn.note = note  # type: ignore[attr-defined]  # goes into every row of this contender
    return fn


def _build_liger(w: Workload, device: str) -> Callable:
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    if w.entropy_coef != 0.0:
        raise NotImplementedError("Liger's triton_grpo_loss computes no entropy, so no entropy bonus")

    def fn(full: torch.Tensor, inp: Inputs) -> torch.Tensor:
        loss, _metrics = triton_grpo_loss(
            full,
            inp.old_logp,
            inp.ref_logp,
            inp.ids,
            inp.advantages,
            inp.mask,
            temperature=w.temperature,
            beta=w.beta,
            eps_low=w.epsilon_low,
            eps_high=w.epsilon_high,
            inplace=True,  # its default: the gradient overwrites the logits
            loss_type=w.loss_type,
            reduce=True,
        )
        return loss

    return fn


def _build_ours(inplace: bool) -> Callable:
    def build(w: Workload, device: str) -> Callable:
        from grpo_kernels import grpo_loss

        backend = "triton" if device == "cuda" else "torch"  # named, so a missing kernel fails rather than falls back

        def fn(logits: torch.Tensor, inp: Inputs) -> torch.Tensor:
            out = grpo_loss(
                logits,
                inp.ids,
                inp.advantages,
                inp.mask,
                inp.old_logp,
                inp.ref_logp,
                inplace_backward=inplace,
                backend=backend,
                loss_type=w.loss_type,
                beta=w.beta,
                epsilon_low=w.epsilon_low,
                epsilon_high=w.epsilon_high,
                temperature=w.temperature,
                entropy_coef=w.entropy_coef,
            )
            return out.loss

        return fn

    return build


CONTENDERS = {
    c.name: c
    for c in (
        Contender(
            "eager", "PyTorch eager: logits.float().log_softmax(-1).gather + entropy + TRL's loss math", _build_eager
        ),
        Contender("compile", "torch.compile (default options) of the eager function", _build_compile),
        Contender(
            "trl",
            "TRL 1.16 trl.trainer.utils.selective_log_softmax_and_entropy (its Triton kernel on CUDA, chunked torch "
            "on CPU) + its loss math",
            _build_trl,
            requires=("trl",),
            pinned={"trl": "1.16.0"},
        ),
        Contender(
            "liger",
            "Liger-Kernel 0.8.5 triton_grpo_loss on the (B, T+1, V) buffer, inplace=True (its default); it computes "
            "no entropy",
            _build_liger,
            requires=("liger-kernel",),
            pinned={"liger-kernel": "0.8.5"},
            inplace=True,
            full_buffer=True,
            cuda_only=True,
        ),
        Contender("ours", "grpo_kernels.grpo_loss (backend='triton' on CUDA, 'torch' on CPU)", _build_ours(False)),
        Contender(
            "ours_inplace",
            "grpo_kernels.grpo_loss(inplace_backward=True): the gradient overwrites the logits",
            _build_ours(True),
            inplace=True,
        ),
    )
}
BASELINE = "ours"  # ratios in the tables are contender / ours


class _GradSink(torch.autograd.Function):
    """Stands in for the LM head that produced the logits: its backward receives ∂loss/∂logits and keeps it, as the
    head's backward would consume it, and sends nothing further (the logits buffer itself needs no .grad)."""

    @staticmethod
    def forward(ctx, logits, anchor, sink):  # type: ignore[override]
        ctx.sink = sink
        return logits  # returned as is: autograd makes it a view of the buffer, so in-place writes reach the buffer

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.sink.append(grad)
        return None, None, None


def make_step(contender: Contender, fn: Callable, inp: Inputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """One training step's worth of the loss: forward, then backward to the gradient w.r.t. the logits as given.

    The logits enter through `_GradSink`, like a model's output: a non-leaf whose gradient nobody accumulates into a
    `.grad`, so what is timed and measured is the loss alone, returning the gradient the LM head would receive.
    """
    anchor = torch.zeros((), device=inp.full.device, requires_grad=True)  # makes the sink's output require grad

    name, _, at_tokens = os.environ.get(FAULT_ENV, "").partition("@")  # "contender" or "contender@B·T"
    batch, length, _ = inp.full.shape
    fault = name == contender.name and at_tokens in ("", str(batch * (length - 1)))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        if fault:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (fake, from {FAULT_ENV})")
        sink: list[torch.Tensor] = []
        view = inp.full if contender.full_buffer else inp.full[:, :-1]
        logits = _GradSink.apply(view, anchor, sink)
        loss = fn(logits, inp)
        loss.backward()
        return loss.detach(), sink.pop().detach()  # in place, the gradient is the logits buffer itself

    return step


# ----------------------------------------------------------------------------------------------------------------
# Timing and memory, per device


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


def copy_bandwidth(device: str, nbytes: int) -> dict[str, float]:
    """The device's measured copy bandwidth: one large copy, bytes read + bytes written over the time."""
    meter = Meter(device)
    bufs = [torch.ones(nbytes // 4, dtype=torch.float32, device=device), torch.empty(nbytes // 4, device=device)]

    def copy() -> torch.Tensor:
        return bufs[1].copy_(bufs[0])

    times = []
    for i in range(13):
        ms, _, _ = meter.call(copy)
        if i >= 3:  # three warm-ups
            times.append(ms)
    bufs.clear()
    meter.free()
    stats = harness.summarize_ms(times)
    return {"bytes": nbytes, "median_ms": stats["median"], "GBps": 2 * nbytes / (stats["median"] / 1e3) / 1e9}


# ----------------------------------------------------------------------------------------------------------------
# One shape, every contender, in this process (the GPU table, and --dry-run)


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


def _fail(rec: dict[str, Any], meter: Meter, err: BaseException) -> None:
    rec["status"] = "oom" if meter.is_oom(err) else "error"
    rec["note"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:240] if str(err).strip() else ''}"


class ContextBroken(Exception):
    """A contender left the CUDA context unusable (an illegal address, a device-side assert): this process can run
    nothing more, so it reports which contender did it and exits; the supervisor carries on without that one."""

    def __init__(self, contender: str, note: str) -> None:
        super().__init__(note)
        self.contender, self.note = contender, note


# "contender" or "contender@B·T": that contender's calls raise a fake sticky CUDA error (at that shape), to test
# the recovery on a machine without a GPU.
FAULT_ENV = "GRPO_BENCH_FAULT"


def bench_shape(
    names: list[str],
    excluded: dict[str, str],
    shape: tuple[str, int, int],
    w: Workload,
    meter: Meter,
    spec: dict[str, Any],
    built: dict[str, Callable],
) -> list[dict[str, Any]]:
    """Warm every contender up (and record its loss and gradient norm), then time rounds; each round runs every
    contender once, in an order rotated round by round, so drift and clock changes fall on all of them alike."""
    dtype_name, vocab, tokens = shape
    batch, length = split_tokens(tokens)
    device = meter.device
    records = {n: new_record(n, batch, length, vocab, dtype_name) for n in names}
    active: list[str] = []
    for n in names:
        status, why = CONTENDERS[n].availability(device)
        if n in excluded:
            records[n].update(status="error", note=excluded[n])
        elif status != "ok":
            records[n].update(status=status, note=why)
        elif n in built:
            active.append(n)
            records[n]["note"] = getattr(built[n], "note", "")
        else:
            records[n].update(status="error", note=built.get(f"!{n}", "could not be built"))  # type: ignore[arg-type]
    inp = make_inputs(batch, length, vocab, DTYPES[dtype_name], device)
    steps = {n: make_step(CONTENDERS[n], built[n], inp) for n in active}

    def failed(n: str, err: BaseException) -> None:
        _fail(records[n], meter, err)
        if meter.context_broken(err):
            raise ContextBroken(n, records[n]["note"])
        active.remove(n)
        if CONTENDERS[n].inplace:
            inp.refill()

    est_ms: dict[str, float] = {}
    for n in active.copy():  # failed() removes from `active`
        err = None
        try:
            for i in range(spec["warmup"]):
                ms, _, (loss, grad) = meter.call(steps[n])
                if i == 0:
                    records[n]["loss"] = float(loss)
                    records[n]["grad_norm"] = grad_norm(grad)
                del loss, grad
                if CONTENDERS[n].inplace:
                    inp.refill()
                est_ms[n] = ms
        except Exception as e:  # noqa: BLE001 - one contender's failure is a row of the table, not the end of the run
            err = e
        if err is not None:
            failed(n, err)
            del err
            meter.free()
    round_ms = sum(est_ms.get(n, 0.0) for n in active) or 1.0
    n_reps = max(spec["min_reps"], min(spec["reps"], int(spec["shape_budget_s"] * 1e3 / round_ms)))
    times: dict[str, list[float]] = {n: [] for n in active}
    peaks: dict[str, int] = {n: 0 for n in active}
    for r in range(n_reps):
        order = active[r % len(active) :] + active[: r % len(active)] if active else []
        for n in order:
            err = None
            try:
                ms, peak, out = meter.call(steps[n])
                del out
                times[n].append(ms)
                peaks[n] = max(peaks[n], peak)
            except Exception as e:  # noqa: BLE001
                err = e
            if err is not None:
                failed(n, err)
                del err
                meter.free()
            elif CONTENDERS[n].inplace:
                inp.refill()
    itemsize = DTYPES[dtype_name].itemsize
    for n, rec in records.items():
        if rec["status"] == "ok" and times.get(n):
            rec["time_ms"] = harness.summarize_ms(times[n])
            rec["peak_bytes"] = peaks[n]
            rec["GBps"] = logits_bytes_moved(rec, itemsize) / (rec["time_ms"]["median"] / 1e3) / 1e9
    steps.clear()
    inp = None  # free the inputs before the allocator's cache
    meter.free()
    return [records[n] for n in names]


def build_contenders(names: list[str], w: Workload, device: str) -> dict[str, Callable]:
    built: dict[str, Callable] = {}
    for n in names:
        if CONTENDERS[n].availability(device)[0] != "ok":
            continue
        try:
            built[n] = CONTENDERS[n].build(w, device)
        except Exception as e:  # noqa: BLE001
            built[f"!{n}"] = f"{type(e).__name__}: {e}"[:300]  # type: ignore[assignment]
    return built


def _emit(kind: str, data: Any) -> None:
    print(f"@@{kind} {json.dumps(data)}", flush=True)


def shape_worker(spec: dict[str, Any]) -> int:
    """The GPU table's process (also --dry-run's, on the CPU): every remaining shape, every contender, alternating.
    Reports each finished shape to the supervisor on stdout as it goes."""
    device = spec["device"]
    if device == "cpu":
        torch.set_num_threads(spec["threads"])
    w = Workload(**spec["workload"])
    meter = Meter(device)
    excluded: dict[str, str] = spec["excluded"]
    if spec["measure_copy"]:
        _emit("COPY", {"copy_bandwidth": copy_bandwidth(device, spec["copy_bytes"]), "peak_method": meter.peak_method})
    built = build_contenders([n for n in spec["contenders"] if n not in excluded], w, device)
    for dtype_name, vocab, tokens in spec["shapes"]:
        shape = (dtype_name, vocab, tokens)
        batch, length = split_tokens(tokens)
        need = batch * (length + 1) * vocab * DTYPES[dtype_name].itemsize
        free = meter.free_bytes()
        skip = None
        if time.time() > spec["deadline"]:
            skip = f"not run: the run's time budget ({spec['budget_s']:.0f} s) was spent"
        elif free is not None and need > 0.9 * free:
            skip = f"not run: the inputs ({harness.fmt_bytes(need)}) don't fit ({harness.fmt_bytes(free)} free)"
        if skip:
            recs = [new_record(n, batch, length, vocab, dtype_name) for n in spec["contenders"]]
            for r in recs:
                r.update(status="skipped", note=skip)
        else:
            t0 = time.perf_counter()
            try:
                recs = bench_shape(spec["contenders"], excluded, shape, w, meter, spec, built)
            except ContextBroken as e:
                _emit("BROKEN", {"shape": shape, "contender": e.contender, "note": e.note})
                os._exit(3)  # no teardown: it would touch the broken context
            print(f"[{dtype_name} V={vocab} BT={tokens}] {time.perf_counter() - t0:.1f} s", flush=True)
            for r in recs:
                print("   ", _one_line(r), flush=True)
        _emit("SHAPE", {"shape": shape, "records": recs})
    return 0


def run_supervised(args: argparse.Namespace, w: Workload, payload: dict[str, Any], out_stem: Path) -> None:
    """Run the table in a child process, shape by shape. If a contender breaks the CUDA context, a new child goes on
    from that shape without it (its rows say why), so one faulty kernel costs its own rows, not the run."""
    shapes = [(d, v, t) for d in args.dtypes for v in args.vocabs for t in args.tokens]
    done: set[tuple] = set()
    excluded: dict[str, str] = {}
    t_start = time.perf_counter()
    deadline = time.time() + args.budget_s
    while len(done) < len(shapes):
        spec = {
            "device": args.device,
            "contenders": args.contenders,
            "excluded": excluded,
            "shapes": [s for s in shapes if s not in done],
            "workload": asdict(w),
            "measure_copy": "copy_bandwidth" not in payload,
            "copy_bytes": args.copy_bytes,
            "deadline": deadline,
            "budget_s": args.budget_s,
            "reps": args.reps,
            "min_reps": args.min_reps,
            "warmup": args.warmup,
            "shape_budget_s": args.shape_budget_s,
            "threads": args.threads,
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--shape-worker", json.dumps(spec)]
        broken = None
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith("@@"):
                    print(line, end="", flush=True)
                    continue
                kind, data = line[2:].split(" ", 1)
                data = json.loads(data)
                if kind == "COPY":
                    payload["copy_bandwidth"] = data["copy_bandwidth"]
                    payload["peak_memory_method"] = data["peak_method"]
                elif kind == "SHAPE":
                    payload["records"].extend(data["records"])
                    done.add(tuple(data["shape"]))
                    finish(payload, out_stem, png=False)  # a run cut short still leaves every shape done so far
                elif kind == "BROKEN":
                    broken = data
        if broken is not None:
            dtype_name, vocab, tokens = broken["shape"]
            excluded[broken["contender"]] = (
                f"left out from {dtype_name} V={vocab} B·T={tokens} on: it broke the CUDA context there "
                f"({broken['note'][:160]})"
            )
            payload["notes"].append(f"{broken['contender']} broke the CUDA context: {broken['note']}")
            continue
        if proc.returncode != 0 or len(done) < len(shapes):
            note = f"not run: the benchmark process exited with code {proc.returncode} before this shape"
            for dtype_name, vocab, tokens in (s for s in shapes if s not in done):
                batch, length = split_tokens(tokens)
                for n in args.contenders:
                    rec = new_record(n, batch, length, vocab, dtype_name)
                    rec.update(status="error", note=note)
                    payload["records"].append(rec)
            break
    payload["wall_s"] = time.perf_counter() - t_start


# ----------------------------------------------------------------------------------------------------------------
# CPU mode: each contender in a fresh process, so its peak RSS is its own


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one contender at one shape (inside a fresh `--worker` process) and report times and peak RSS."""
    torch.set_num_threads(spec["threads"])
    w = Workload(**spec["workload"])
    name = spec["contender"]
    rec = new_record(name, spec["B"], spec["T"], spec["V"], spec["dtype"])
    meter = Meter("cpu")
    try:
        fn = CONTENDERS[name].build(w, "cpu")
        rec["note"] = getattr(fn, "note", "")
        inp = make_inputs(spec["B"], spec["T"], spec["V"], DTYPES[spec["dtype"]], "cpu")
        if CONTENDERS[name].inplace:
            inp.pristine = inp.full.clone()  # restoring by a copy is 20x faster than regenerating on a CPU
        step = make_step(CONTENDERS[name], fn, inp)
        times, cpu_times, peak = [], [], 0
        for i in range(spec["warmup"] + spec["reps"]):
            ms, peak_i, (loss, grad) = meter.call(step)
            if i == 0:
                rec["loss"] = float(loss)
                rec["grad_norm"] = grad_norm(grad)
            del loss, grad
            if CONTENDERS[name].inplace:
                inp.refill()
            if i >= spec["warmup"]:
                times.append(ms)
                cpu_times.append(meter.last_cpu_ms)
                peak = max(peak, peak_i)
        rec.update(
            times=times, cpu_times=cpu_times, peak_bytes=peak, inputs_bytes=inp.nbytes, peak_method=meter.peak_method
        )
    except Exception as e:  # noqa: BLE001
        _fail(rec, meter, e)
    return rec


def run_cpu(args: argparse.Namespace, w: Workload, payload: dict[str, Any], out_stem: Path) -> None:
    payload["peak_memory_method"] = (
        "each contender in a fresh process: peak RSS (VmHWM, reset before each call) minus RSS before the call"
    )
    payload["copy_bandwidth"] = copy_bandwidth("cpu", args.copy_bytes)
    t_start = time.perf_counter()
    for dtype_name in args.dtypes:
        for vocab in args.vocabs:
            for tokens in args.tokens:
                batch, length = split_tokens(tokens)
                recs = {n: new_record(n, batch, length, vocab, dtype_name) for n in args.contenders}
                runnable = []
                for n in args.contenders:
                    status, why = CONTENDERS[n].availability("cpu")
                    if status != "ok":
                        recs[n].update(status=status, note=why)
                    else:
                        runnable.append(n)
                times: dict[str, list[float]] = {n: [] for n in runnable}
                cpu_times: dict[str, list[float]] = {n: [] for n in runnable}
                # Rounds of fresh processes, contender order rotated each round: background load on a shared machine
                # then falls on every contender alike.
                for r in range(args.rounds):
                    for n in runnable[r % len(runnable) :] + runnable[: r % len(runnable)]:
                        if recs[n]["status"] != "ok":
                            continue
                        spec = {
                            "contender": n,
                            "B": batch,
                            "T": length,
                            "V": vocab,
                            "dtype": dtype_name,
                            "workload": asdict(w),
                            "threads": args.threads,
                            "warmup": args.warmup,
                            "reps": max(1, args.reps // args.rounds),
                        }
                        res = _spawn_worker(spec, args.worker_timeout_s)
                        rec = recs[n]
                        if res.get("status") != "ok":
                            rec.update(status=res.get("status", "error"), note=res.get("note", ""))
                            continue
                        times[n] += res["times"]
                        rec["note"] = res.get("note", "")
                        cpu_times[n] += res["cpu_times"]
                        rec["peak_bytes"] = max(rec["peak_bytes"] or 0, res["peak_bytes"])
                        rec["loss"] = res["loss"] if rec["loss"] is None else rec["loss"]
                        rec["grad_norm"] = res["grad_norm"] if rec["grad_norm"] is None else rec["grad_norm"]
                        rec["inputs_bytes"] = res["inputs_bytes"]
                itemsize = DTYPES[dtype_name].itemsize
                for n in runnable:
                    rec = recs[n]
                    if rec["status"] == "ok" and times[n]:
                        rec["time_ms"] = harness.summarize_ms(times[n])
                        rec["cpu_time_ms"] = harness.summarize_ms(cpu_times[n])
                        rec["GBps"] = logits_bytes_moved(rec, itemsize) / (rec["time_ms"]["median"] / 1e3) / 1e9
                print(f"[{dtype_name} V={vocab} BT={tokens}]", flush=True)
                for n in args.contenders:
                    print("   ", _one_line(recs[n]), flush=True)
                payload["records"].extend(recs[n] for n in args.contenders)
                finish(payload, out_stem, png=False)
    payload["wall_s"] = time.perf_counter() - t_start
    payload["device"]["load_average_end"] = list(os.getloadavg())


def _spawn_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"worker timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        killed = proc.returncode in (-9, 137)
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:240]
        return {"status": "oom" if killed else "error", "note": f"worker exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------------------------------
# Reference check (--dry-run): every contender's loss against the float64 oracle in reference/


def reference_check(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    batch, length = split_tokens(args.tokens[0])
    inp = make_inputs(batch, length, args.vocabs[0], DTYPES[args.dtypes[0]], "cpu")
    try:
        from reference import reference_grpo_loss
    except ImportError as e:
        return {"status": "unavailable", "note": f"{type(e).__name__}: {e}"[:240]}
    try:
        out = reference_grpo_loss(
            inp.full.detach()[:, :-1].double(),
            inp.ids,
            inp.advantages,
            inp.mask,
            inp.old_logp,
            inp.ref_logp,
            loss_type=w.loss_type,
            beta=w.beta,
            epsilon_low=w.epsilon_low,
            epsilon_high=w.epsilon_high,
            temperature=w.temperature,
            entropy_coef=w.entropy_coef,
        )
        loss = out.loss if hasattr(out, "loss") else out["loss"] if isinstance(out, dict) else out[0]
        return {
            "status": "ok",
            "loss": float(loss),
            "B": batch,
            "T": length,
            "V": args.vocabs[0],
            "dtype": args.dtypes[0],
        }
    except Exception as e:  # noqa: BLE001 - the oracle's signature is its own; say what happened
        return {"status": "error", "note": f"{type(e).__name__}: {e}"[:240]}


# ----------------------------------------------------------------------------------------------------------------
# Reporting


def _one_line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['contender']:>13}: {r['status']} {r['note']}"
    t = r["time_ms"]
    return (
        f"{r['contender']:>13}: {t['median']:9.2f} ms [{t['p20']:.2f}, {t['p80']:.2f}]  "
        f"peak +{harness.fmt_bytes(r['peak_bytes']):>10}  {r['GBps']:7.1f} GB/s  loss {r['loss']:.6g}"
    )


def annotate(payload: dict[str, Any]) -> None:
    """Fill the derived figures: fraction of the copy bandwidth, ratios to ours, agreement of the losses."""
    bw = payload.get("copy_bandwidth", {}).get("GBps")
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in payload["records"]:
        by_shape.setdefault((r["dtype"], r["V"], r["BT"]), {})[r["contender"]] = r
    for recs in by_shape.values():
        base = recs.get(BASELINE)
        ref = next((recs[n] for n in ("eager", BASELINE) if n in recs and recs[n]["loss"] is not None), None)
        for r in recs.values():
            if r["status"] == "ok" and r["GBps"] and bw:
                r["copy_bw_fraction"] = r["GBps"] / bw
            if base and base["status"] == "ok" and r["status"] == "ok" and r["time_ms"] and base["time_ms"]:
                r["time_vs_ours"] = r["time_ms"]["median"] / base["time_ms"]["median"]
                if r.get("cpu_time_ms") and base.get("cpu_time_ms"):
                    r["cpu_time_vs_ours"] = r["cpu_time_ms"]["median"] / base["cpu_time_ms"]["median"]
                if base["peak_bytes"]:
                    r["mem_vs_ours"] = r["peak_bytes"] / base["peak_bytes"]
            oracle = payload.get("reference_check") or {}
            if (
                oracle.get("status") == "ok"
                and r["loss"] is not None
                and (r["dtype"], r["V"], r["BT"]) == (oracle["dtype"], oracle["V"], oracle["B"] * oracle["T"])
            ):
                r["reference_rel_diff"] = abs(r["loss"] - oracle["loss"]) / max(abs(oracle["loss"]), 1e-12)
            if ref is not None and r["loss"] is not None and ref["loss"] is not None:
                r["loss_rel_diff"] = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
                if r["grad_norm"] is not None and ref["grad_norm"]:
                    r["grad_norm_rel_diff"] = abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
                r["checked_against"] = ref["contender"]


def headline(payload: dict[str, Any]) -> list[str]:
    """Per dtype and contender: geometric means, over the shapes where both ran, of time and peak memory relative to
    ours; then the same at the largest shape where ours ran (or what kept the contender from it)."""
    lines = []
    records = payload["records"]
    for dtype_name in dict.fromkeys(r["dtype"] for r in records):
        at = {(r["contender"], r["V"], r["BT"]): r for r in records if r["dtype"] == dtype_name}
        ours = [k[1:] for k, r in at.items() if k[0] == BASELINE and r["status"] == "ok"]
        if not ours:
            lines.append(f"- {dtype_name}: ours did not run, so there are no ratios.")
            continue
        vocab, tokens = max(ours, key=lambda k: k[0] * k[1])
        for name in payload["contenders"]:
            if name == BASELINE:
                continue
            mine = [at[name, *k] for k in ours if at.get((name, *k), {}).get("time_vs_ours")]
            big = at.get((name, vocab, tokens))
            where = f"at the largest shape (V={vocab}, B·T={tokens})"
            if not mine:
                states = sorted({r["status"] for k, r in at.items() if k[0] == name})
                lines.append(f"- **{name}**, {dtype_name}: no shape ran ({', '.join(states)}).")
                continue
            t = harness.geomean([r["time_vs_ours"] for r in mine])
            c = harness.geomean([r["cpu_time_vs_ours"] for r in mine if "cpu_time_vs_ours" in r])
            m = harness.geomean([r["mem_vs_ours"] for r in mine if "mem_vs_ours" in r])
            cpu = f" ({c:.2f}× in CPU time)" if math.isfinite(c) else ""
            line = f"- **{name}**, {dtype_name}: {t:.2f}× ours' time{cpu}, {_ratio(m)} ours' peak memory (geometric "
            line += f"mean over {len(mine)} shapes); {where}: "
            if big is not None and big.get("time_vs_ours"):
                line += f"{big['time_vs_ours']:.2f}× time, {_ratio(big.get('mem_vs_ours', math.nan))} memory."
            else:
                line += f"{big['status'] if big else 'not run'}."
            lines.append(line)
    return lines


def _ratio(x: float) -> str:
    return f"{x:.2f}×" if math.isfinite(x) else "–×"  # peak 0 above the inputs: no ratio


def to_markdown(payload: dict[str, Any]) -> str:
    dev = payload["device"]
    v = payload["versions"]
    bw = payload.get("copy_bandwidth", {})
    title = f"# GRPO loss, forward + backward: {dev['name']} ({payload['mode']})"
    head = [
        title,
        "",
        f"Made by `{payload['command']}` on {payload['created']}, git {payload['git']}.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" if val else f"{k} (not installed)" for k, val in v.items()) + ".",
        "",
        (
            f"Device: {_device_line(dev)}. Measured copy bandwidth: **{bw.get('GBps', math.nan):.1f} GB/s** "
            f"(a {harness.fmt_bytes(bw.get('bytes'))} copy, bytes read + written)."
        ),
        "",
        (
            f"Workload: {_workload_line(payload['workload'])}. Time: median [p20, p80] of {payload['timing']}. "
            f"Peak memory: {payload['peak_memory_method']}, so it includes the returned gradient unless in place. "
            "GB/s counts one read of the logits and one write of their gradient (2·B·T·V·itemsize bytes); "
            "'% copy' is that over the measured copy bandwidth. ×ours: median time and peak memory over ours' "
            "(below 1: less than ours). Δloss, Δ‖∂‖: relative difference of the loss and of the gradient's norm "
            "from eager's (ours' where eager did not run)."
        ),
        "",
        "## Headline",
        "",
        *headline(payload),
        "",
    ]
    with_cpu = any(r.get("cpu_time_ms") for r in payload["records"])
    headers = (
        ["V", "B·T", "contender", "median ms", "[p20, p80]"]
        + (["CPU-time ms"] if with_cpu else [])
        + ["peak above inputs", "GB/s", "% copy", "×ours time", "×ours mem", "Δloss", "Δ‖∂‖", "note"]
    )
    body = []
    for dtype_name in dict.fromkeys(r["dtype"] for r in payload["records"]):
        rows = []
        for r in payload["records"]:
            if r["dtype"] != dtype_name:
                continue
            if r["status"] != "ok":
                rows.append(
                    [r["V"], r["BT"], r["contender"]]
                    + ["–"] * (len(headers) - 4)
                    + [f"**{r['status']}**: {r['note']}".replace("|", "/")]
                )
                continue
            t = r["time_ms"]
            cpu = [f"{r['cpu_time_ms']['median']:.0f}" if r.get("cpu_time_ms") else "–"] if with_cpu else []
            rows.append(
                [
                    r["V"],
                    r["BT"],
                    r["contender"],
                    f"{t['median']:.2f}",
                    f"[{t['p20']:.2f}, {t['p80']:.2f}]",
                    *cpu,
                    harness.fmt_bytes(r["peak_bytes"]),
                    f"{r['GBps']:.1f}",
                    f"{100 * r['copy_bw_fraction']:.0f}%" if r.get("copy_bw_fraction") else "–",
                    f"{r['time_vs_ours']:.2f}" if "time_vs_ours" in r else "–",
                    f"{r['mem_vs_ours']:.2f}" if "mem_vs_ours" in r else "–",
                    f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "–",
                    f"{r['grad_norm_rel_diff']:.1e}" if "grad_norm_rel_diff" in r else "–",
                    (r.get("note") or "").replace("|", "/"),
                ]
            )
        align = "rrl" + "r" * (len(headers) - 4) + "l"
        body += [f"## {dtype_name} logits", "", harness.markdown_table(headers, rows, align), ""]
    body += ["## Contenders", ""] + [f"- `{n}`: {d}" for n, d in payload["contenders"].items()]
    oracle = payload.get("reference_check")
    if oracle and oracle.get("status") == "ok":
        diffs = ", ".join(
            f"{r['contender']} {r['reference_rel_diff']:.1e}" for r in payload["records"] if "reference_rel_diff" in r
        )
        where = f"{oracle['dtype']}, V={oracle['V']}, B·T={oracle['B'] * oracle['T']}"
        body += ["", f"Reference check: the float64 oracle of reference/ gives loss {oracle['loss']:.9g} at {where}; "]
        body[-1] += f"relative differences: {diffs}."
    elif oracle:
        body += ["", f"Reference check: {oracle['status']} ({oracle.get('note', '')})."]
    if payload.get("notes"):
        body += ["", "## Notes", ""] + [f"- {n}" for n in payload["notes"]]
    return "\n".join(head + body) + "\n"


def _device_line(dev: dict[str, Any]) -> str:
    if dev["type"] == "cuda":
        return (
            f"{dev['name']} (sm {dev['capability']}, {harness.fmt_bytes(dev['memory_bytes'])}, CUDA {dev['cuda']}, "
            f"driver {dev.get('driver')}), host {dev['host_cpu']}"
        )

    def load(key: str) -> str:
        return ", ".join(f"{x:.2f}" for x in dev.get(key, [])) or "–"

    return (
        f"{dev['name']}, {dev['host_cpu_count']} cores, torch threads {dev.get('torch_threads')}, "
        f"{harness.fmt_bytes(dev.get('memory_bytes'))} RAM; load average (1, 5, 15 min) {load('load_average')} "
        f"at the start, {load('load_average_end')} at the end: other processes' load inflates wall-clock times, "
        "less so the CPU time"
    )


def _workload_line(w: dict[str, Any]) -> str:
    return ", ".join(f"{k}={val}" for k, val in w.items()) + (
        "; per-sequence advantages, old and reference log-probs given, completion mask with tail padding, "
        f"random logits of std {LOGIT_STD}, T = min({SEQ_LEN}, B·T)"
    )


def plot_figure(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in payload["records"] if r["status"] == "ok"]
    panels = list(dict.fromkeys((r["dtype"], r["V"]) for r in payload["records"]))
    fig, axes = plt.subplots(2, len(panels), figsize=(max(4.2 * len(panels), 8.5), 7.5), squeeze=False)
    names = list(payload["contenders"])
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    for j, (dtype_name, vocab) in enumerate(panels):
        for n in names:
            pts = sorted(
                (r["BT"], r["time_ms"]["median"], r["peak_bytes"])
                for r in recs
                if r["contender"] == n and r["dtype"] == dtype_name and r["V"] == vocab
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            style = {"marker": "o", "color": colors[n], "label": n, "linestyle": "--" if "inplace" in n else "-"}
            axes[0, j].plot(xs, [p[1] for p in pts], **style)
            axes[1, j].plot(xs, [p[2] / 2**20 for p in pts], **style)
        axes[0, j].set_title(f"{dtype_name}, V = {vocab}")
        for i, label in enumerate(("fwd+bwd time, median (ms)", "peak memory above inputs (MiB)")):
            ax = axes[i, j]
            ax.set_xscale("log", base=2)
            if i == 0 or min((y for line in ax.get_lines() for y in line.get_ydata()), default=1.0) >= 1.0:
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=1.0)  # in-place contenders can peak at ~0 MiB above the inputs
                ax.set_ylim(bottom=0)
            ax.set_xlabel("B·T (tokens)")
            if j == 0:
                ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle(f"GRPO loss forward+backward on {payload['device']['name']}", y=0.995, fontsize=11)
    if labels:  # none when no contender ran anywhere (every shape skipped)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(payload: dict[str, Any], out_stem: Path, png: bool = True) -> None:
    annotate(payload)
    harness.write_json(out_stem.with_suffix(".json"), payload)
    harness.write_text(out_stem.with_suffix(".md"), to_markdown(payload))
    if png:
        plot_figure(payload, out_stem.with_suffix(".png"))


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the GPU code path (all contenders in this process) on the CPU at toy sizes",
    )
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS)
    )
    p.add_argument(
        "--dtypes", default=None, help="comma-separated among bf16, fp32, fp16 (GPU default bf16,fp32; CPU fp32)"
    )
    p.add_argument("--vocabs", default=None, help="comma-separated V values")
    p.add_argument("--tokens", default=None, help="comma-separated B·T values")
    p.add_argument("--reps", type=int, default=None, help="timed calls per contender and shape (at most)")
    p.add_argument("--min-reps", type=int, default=5, help="timed calls at least, whatever the shape budget")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (GPU default 2, CPU 1)")
    p.add_argument("--shape-budget-s", type=float, default=6.0, help="GPU: time rounds until about this much is spent")
    p.add_argument("--budget-s", type=float, default=330.0, help="GPU: no new shape starts after this many seconds")
    p.add_argument("--rounds", type=int, default=2, help="CPU: fresh processes per contender and shape")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU: torch threads per worker")
    p.add_argument("--worker-timeout-s", type=float, default=600.0)
    p.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus; != 0 sends gradient through H")
    p.add_argument("--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output stem (writes .json/.md/.png); default benchmarks/results/<device>",
    )
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite the markdown and the plot beside a results JSON (after a change to the report)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run and args.device != "cpu":
        p.error("--dry-run runs on the CPU")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    mode = "dry-run" if args.dry_run else args.device
    defaults = {
        # dtypes, V, B·T, reps (at most), copy-bandwidth buffer, warm-up calls
        "cuda": (("bf16", "fp32"), GPU_VOCABS, GPU_TOKENS, 20, 4 << 30, 2),
        "cpu": (("fp32",), CPU_VOCABS, CPU_TOKENS, 4, 256 << 20, 1),
        "dry-run": (("fp32",), DRY_VOCABS, DRY_TOKENS, 3, 16 << 20, 1),
    }[mode]
    args.mode = mode
    args.dtypes = args.dtypes.split(",") if args.dtypes else list(defaults[0])
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    args.vocabs = [int(x) for x in args.vocabs.split(",")] if args.vocabs else list(defaults[1])
    args.tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else list(defaults[2])
    args.reps = args.reps or defaults[3]
    args.copy_bytes = defaults[4]
    args.warmup = defaults[5] if args.warmup is None else args.warmup
    if mode == "dry-run":
        args.min_reps = min(args.min_reps, args.reps)
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        return 0
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--shape-worker":
        return shape_worker(json.loads(sys.argv[2]))
    args = parse_args(argv)
    if args.render:
        finish(json.loads(args.render.read_text()), args.render.with_suffix(""))
        print(f"rewrote {args.render.with_suffix('.md')} and .png", flush=True)
        return 0
    w = Workload(loss_type=args.loss_type, entropy_coef=args.entropy_coef)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    info = harness.device_info(args.device)
    out_stem = args.out or harness.RESULTS_DIR / harness.device_slug(info)
    payload: dict[str, Any] = {
        "benchmark": "grpo_loss forward+backward from logits",
        "mode": args.mode,
        "command": "python benchmarks/bench_loss.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "created": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": info,
        "versions": harness.versions(),
        "git": harness.git_revision(),
        "workload": asdict(w),
        "timing": (
            "CUDA events around each call, rounds alternating the contenders"
            if args.device == "cuda"
            else "wall-clock per call, rounds of fresh processes alternating the contenders"
            if args.mode == "cpu"
            else "wall-clock per call, rounds alternating the contenders"
        ),
        "bytes_counted": "2·B·T·V·itemsize: one read of the logits, one write of their gradient",
        "contenders": {n: CONTENDERS[n].description for n in args.contenders},
        "shapes": {"dtypes": args.dtypes, "V": args.vocabs, "BT": args.tokens, "T": SEQ_LEN},
        "records": [],
        "notes": [],
    }
    if args.mode == "cpu":
        run_cpu(args, w, payload, out_stem)
    else:
        if args.mode == "dry-run":
            payload["reference_check"] = reference_check(args, w)
            payload["notes"].append("dry run: the GPU code path on the CPU at toy sizes; its numbers mean nothing")
        run_supervised(args, w, payload, out_stem)
    finish(payload, out_stem)
    print(f"results: {out_stem.with_suffix('.json')}, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
