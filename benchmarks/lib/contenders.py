"""The loss benchmark's contenders: each `build(workload, device)` returns fn(logits, inputs) -> loss, and `make_step`
wraps one as a training step does (forward, then backward to the gradient w.r.t. the logits as given)."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo_kernels.config import LossConfig

from .workload import Inputs, Workload, objective


def eager_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    cfg: LossConfig,
) -> torch.Tensor:
    """As users write it: `logits.float().log_softmax(-1).gather(...)` and the entropy from the same log-softmax,
    then the loss math (`workload.objective`)."""
    z = logits.float()
    if cfg.temperature != 1.0:
        z = z / cfg.temperature
    logp_all = z.log_softmax(-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.entropy_coef != 0.0):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return objective(logp, entropy, advantages, mask, old_logp, ref_logp, cfg)


@dataclass
class Contender:
    name: str
    description: str
    build: Callable[[Workload, str], Callable[[torch.Tensor, Inputs], torch.Tensor]]
    requires: tuple[str, ...] = ()  # distributions that must be installed; else the row says "missing"
    pinned: dict[str, str] = field(default_factory=dict)  # the versions this benchmark is pinned to
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


def ours_backend(device: str) -> str:
    """The grpo_loss backend `ours` names (named, so that a missing kernel fails rather than falls back): Triton on
    CUDA and under the Triton interpreter (the dry runs), the chunked torch rows on the CPU."""
    return "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def _build_eager(w: Workload, device: str) -> Callable:
    cfg = w.config()
    return lambda logits, inp: eager_loss(logits, *inp.tensors, cfg)


def _build_compile(w: Workload, device: str) -> Callable:
    # Default torch.compile, as a user would call it: static shapes at the first shape, automatically dynamic after
    # the first recompile. Compilation happens in the warm-up calls, outside the timing.
    # Tensors only as arguments, so that a new shape or dtype costs at most an automatic-dynamic recompile; the limit
    # is raised so that no shape of the table can silently fall back to eager.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    setattr(config, limit, max(getattr(config, limit), 64))

    cfg = w.config()

    def loss(logits, ids, advantages, mask, old_logp, ref_logp):
        return eager_loss(logits, ids, advantages, mask, old_logp, ref_logp, cfg)

    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    compiled = torch.compile(loss, backend=backend)

    def fn(logits: torch.Tensor, inp: Inputs) -> torch.Tensor:
        return compiled(logits, *inp.tensors)

    fn.note = "" if backend == "inductor" else f"torch.compile(backend={backend!r}), not inductor"  # type: ignore[attr-defined]
    return fn


def _build_trl(w: Workload, device: str) -> Callable:
    cfg = w.config()
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
        return objective(logp, entropy, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, cfg)

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

        backend = ours_backend(device)

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


# The order they are timed in, each recorded as soon as it is: ours first, so that a run cut short still has the
# baseline; compile last, since its cold compile (20-60 s on the headline's graph) is the least predictable.
CONTENDERS = {
    c.name: c
    for c in (
        Contender("ours", "grpo_kernels.grpo_loss (backend='triton' on CUDA, 'torch' on CPU)", _build_ours(False)),
        Contender(
            "ours_inplace",
            "grpo_kernels.grpo_loss(inplace_backward=True): the gradient overwrites the logits",
            _build_ours(True),
            inplace=True,
        ),
        Contender(
            "eager", "PyTorch eager: logits.float().log_softmax(-1).gather + entropy + the loss math", _build_eager
        ),
        Contender(
            "trl",
            "TRL 1.16 trl.trainer.utils.selective_log_softmax_and_entropy (its Triton kernel on CUDA, chunked torch "
            "on CPU) + the loss math",
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
        Contender("compile", "torch.compile (default options) of the eager function", _build_compile),
    )
}
BASELINE = "ours"  # ratios in the tables are contender / ours


# Faults, to test the recovery paths on a machine without a GPU: comma-separated "[kind:]contender[@B·T]" (at every
# shape without "@B·T"). Kinds: "sticky" (the default), the contender's calls raise a fake sticky CUDA error (an
# illegal memory access); "crash", the process timing it dies at its first call (SIGKILL, as from a segfault);
# "hang", its first call never returns; "kill", the table's supervisor kills its own process group as the contender
# starts, as the GPU check does to a phase at its deadline (runner.py).
FAULT_ENV = "GRPO_BENCH_FAULT"
FAULT_KINDS = ("sticky", "crash", "hang", "kill")
# torch.compile's backend for the `compile` contender (default inductor); the dry run uses aot_eager, which traces
# forward and backward as inductor does but generates no code (a cold inductor compile takes 25 s on a CPU).
COMPILE_BACKEND_ENV = "GRPO_BENCH_COMPILE_BACKEND"


@dataclass(frozen=True)
class Fault:
    kind: str
    contender: str
    tokens: int | None  # B·T, or None: every shape


def faults() -> list[Fault]:
    """The faults FAULT_ENV asks for (a malformed entry is an error that names the variable)."""
    out = []
    for item in filter(None, (x.strip() for x in os.environ.get(FAULT_ENV, "").split(","))):
        kind, _, rest = item.rpartition(":")
        name, _, tokens = rest.partition("@")
        kind = kind or "sticky"
        if kind not in FAULT_KINDS or name not in CONTENDERS or (tokens and not tokens.isdigit()):
            raise ValueError(
                f"{FAULT_ENV}={os.environ[FAULT_ENV]!r}: {item!r} is not [kind:]contender[@B·T] with kind in "
                f"{FAULT_KINDS} and contender in {tuple(CONTENDERS)}"
            )
        out.append(Fault(kind, name, int(tokens) if tokens else None))
    return out


def fault_at(name: str, tokens: int, kinds: tuple[str, ...]) -> Fault | None:
    """The first fault of one of `kinds` for contender `name` at B·T = `tokens`, if any."""
    return next((f for f in faults() if f.kind in kinds and f.contender == name and f.tokens in (None, tokens)), None)


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

    batch, length, _ = inp.full.shape
    fault = fault_at(contender.name, batch * (length - 1), ("sticky", "crash", "hang"))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        if fault is not None:
            _inject(fault)
        sink: list[torch.Tensor] = []
        view = inp.full if contender.full_buffer else inp.full[:, :-1]
        logits = _GradSink.apply(view, anchor, sink)
        loss = fn(logits, inp)
        loss.backward()
        return loss.detach(), sink.pop().detach()  # in place, the gradient is the logits buffer itself

    return step


def _inject(fault: Fault) -> None:
    if fault.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(1.0)
    raise RuntimeError(f"CUDA error: an illegal memory access was encountered (fake, from {FAULT_ENV})")
