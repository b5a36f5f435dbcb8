"""The fused-linear benchmark's pieces: inputs (hidden states, the lm_head weight), the contenders, one contender's
timing and peak memory at one shape, and the float64 oracle's loss on the same values."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import harness
from .contenders import ours_backend
from .measure import Meter
from .workload import SEQ_LEN, Workload, objective, reference_loss

# (B·T, H, V): the hidden widths of Qwen2.5-7B and Llama-3-8B, Qwen's vocabulary
GPU_SHAPES = [(n, h, 151936) for h in (3584, 4096) for n in (8192, 32768)]
HEADLINE = (8192, 4096, 151936)  # the largest shape with the oracle's check
TINY_SHAPES = [(128, 64, 1000), (256, 48, 777)]  # H not a power of two, V not a multiple of any tile


def options(w: Workload) -> dict[str, Any]:
    """The loss options of the workload, as grpo_loss and fused_linear_grpo_loss take them (no entropy bonus)."""
    out = asdict(w)
    out.pop("entropy_coef")
    return out


@dataclass
class Inputs:
    last: torch.Tensor  # [B, T+1, H] the model's final hidden states, requires grad
    hidden: torch.Tensor  # [B, T, H] contiguous copy of last[:, :-1], requires grad (a leaf)
    weight: torch.Tensor  # [V, H] lm_head, requires grad
    ids: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] float, tail padding
    old_logp: torch.Tensor  # [B, T]
    ref_logp: torch.Tensor  # [B, T]

    def zero_grad(self) -> None:
        for t in (self.last, self.hidden, self.weight):
            t.grad = None

    @property
    def loss_tensors(self) -> tuple[torch.Tensor, ...]:
        """What the loss takes besides ℓ and H, in `objective`'s order."""
        return self.advantages, self.mask, self.old_logp, self.ref_logp

    def grad_bytes(self) -> int:
        return sum(
            t.grad.numel() * t.grad.element_size() for t in (self.last, self.hidden, self.weight) if t.grad is not None
        )


def make_inputs(tokens: int, width: int, vocab: int, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, length = max(1, tokens // SEQ_LEN), min(tokens, SEQ_LEN)
    dtype = torch.bfloat16
    last = torch.randn(batch, length + 1, width, device=device, generator=gen).to(dtype).requires_grad_()
    hidden = last.detach()[:, :-1].contiguous().requires_grad_()
    # logits of std ~2, as a trained head gives: softmax neither flat nor one-hot
    weight = (torch.randn(vocab, width, device=device, generator=gen) * (2 / math.sqrt(width))).to(dtype)
    weight.requires_grad_()
    ids = torch.randint(0, vocab, (batch, length), device=device, generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch, 1), device=device, generator=gen)
    mask = (torch.arange(length, device=device) < lengths).float()
    with torch.no_grad():  # ratios around 1, as after one optimizer step: old/ref = current ℓ + noise
        logp = torch.empty(batch, length, device=device)
        w32 = weight.float()
        for b in range(batch):
            z = hidden[b].float() @ w32.T
            logp[b] = z.gather(-1, ids[b, :, None]).squeeze(-1) - z.logsumexp(-1)
    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(batch, length, device=device, generator=gen)

    return Inputs(
        last,
        hidden,
        weight,
        ids,
        torch.randn(batch, device=device, generator=gen),
        mask,
        logp + noise(0.05),
        logp + noise(0.1),
    )



# ----------------------------------------------------------------------------------------------------------------
# Contenders: each build(w, device) returns step(inp) -> loss, having run the backward.


def _build_materialized(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from grpo_kernels import grpo_loss

    backend = ours_backend(device)

    def step(inp: Inputs) -> torch.Tensor:
        logits = inp.hidden @ inp.weight.T  # [B, T, V] bf16: the tensor the fused path never makes
        out = grpo_loss(
            logits, inp.ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, backend=backend, **options(w)
        )
        out.loss.backward()
        return out.loss.detach()

    return step


def _build_fused(strided: bool) -> Callable:
    def build(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
        from grpo_kernels.fused_linear import fused_linear_grpo_loss

        backend = ours_backend(device)

        def step(inp: Inputs) -> torch.Tensor:
            hidden = inp.last[:, :-1] if strided else inp.hidden
            out = fused_linear_grpo_loss(
                hidden,
                inp.weight,
                inp.ids,
                inp.advantages,
                inp.mask,
                inp.old_logp,
                inp.ref_logp,
                backend=backend,
                **options(w),
            )
            out.loss.backward()
            return out.loss.detach()

        return step

    return build


def _build_trl(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # the vocabulary tile GRPOTrainer uses

    cfg = w.config()

    def step(inp: Inputs) -> torch.Tensor:
        batch, length, width = inp.hidden.shape
        logp, entropy, *_ = ChunkedLogProbFunction.apply(
            inp.hidden.view(-1, width),
            inp.weight,
            None,
            inp.ids.view(-1),
            w.temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("entropy",),  # entropy: TRL logs it, as we compute it
        )
        flat = (batch, length)
        loss = objective(logp.view(flat), entropy.view(flat), *inp.loss_tensors, cfg)
        loss.backward()
        return loss.detach()

    return step


def _build_liger(w: Workload, device: str) -> Callable[[Inputs], torch.Tensor]:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled: Liger's default on the GPU (torch.compile of its loss math); the CPU dry run skips the compiler.
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=w.beta,
        use_ref_model=True,
        loss_type=w.loss_type,
        epsilon_low=w.epsilon_low,
        epsilon_high=w.epsilon_high,
        temperature=w.temperature,
        compiled=device == "cuda",
    )

    def step(inp: Inputs) -> torch.Tensor:
        out = loss_fn(
            inp.hidden,
            inp.weight,
            inp.ids,
            inp.mask,
            inp.advantages,
            ref_per_token_logps=inp.ref_logp,
            old_per_token_logps=inp.old_logp,
        )
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()

    return step


CONTENDERS: dict[str, tuple[Callable, str]] = {
    "materialized": (_build_materialized, "hidden @ W.T in bf16, then grpo_kernels.grpo_loss (the baseline)"),
    "fused_linear": (_build_fused(False), "grpo_kernels.fused_linear_grpo_loss"),
    "fused_linear_strided": (_build_fused(True), "the same on hidden = last_hidden[:, :-1] (a strided view)"),
    "trl_chunked": (_build_trl, "TRL 1.16 ChunkedLogProbFunction (ℓ, H) + the loss math"),
    "liger": (_build_liger, "Liger-Kernel LigerFusedLinearGRPOLoss (computes no entropy)"),
}



def bench_contender(name: str, w: Workload, inp: Inputs, device: str, warmup: int, reps: int) -> dict[str, Any]:
    build, _ = CONTENDERS[name]
    try:
        step = build(w, device)
    except ImportError as err:
        return {"status": "missing", "why": f"{type(err).__name__}: {err}"}
    meter = Meter(device)
    calls = []
    try:
        for i in range(warmup + reps):  # compilation and autotuning happen in the warm-up, outside the timing
            inp.zero_grad()
            gc.collect()
            ms, peak, loss = meter.call(lambda: step(inp))
            if i >= warmup:
                calls.append((ms, peak, inp.grad_bytes(), float(loss)))
    except Exception as err:  # noqa: BLE001 - a contender's failure is a row, not the end of the run
        return {"status": "oom" if meter.is_oom(err) else "error", "why": f"{type(err).__name__}: {str(err)[:300]}"}
    finally:
        inp.zero_grad()
        meter.free()
    peak = max(c[1] for c in calls)
    return {
        "status": "ok",
        "ms": harness.summarize_ms([c[0] for c in calls]),
        "peak_bytes": peak,
        "transient_bytes": peak - calls[-1][2],
        "loss": calls[-1][3],
    }


def reference_check(inp: Inputs, w: Workload, tokens: int) -> dict[str, Any]:
    """The float64 oracle's loss on logits = hidden @ weight.T from the same bf16 values (B·T <= 8192 only: its
    float64 (B·T, V) temporaries take ~50 GB at 8192 x 151936)."""
    if tokens > 8192:
        return {"status": "skipped", "why": "B·T > 8192: the float64 logits would not fit"}
    logits = None
    try:
        logits = inp.hidden.detach().double() @ inp.weight.detach().double().T
        loss = reference_loss(logits, inp.ids, inp.advantages, inp.mask, inp.old_logp, inp.ref_logp, w)
        return {"status": "ok", "loss": loss}
    except Exception as err:  # noqa: BLE001 - e.g. out of memory on an 80 GB card: the table says so
        return {"status": "error", "why": f"{type(err).__name__}: {str(err)[:200]}"}
    finally:
        del logits
        Meter("cuda" if inp.hidden.is_cuda else "cpu").free()


def ratios(row: dict[str, Any], name: str) -> dict[str, float | None]:
    """name / materialized, for time, peak and transient memory."""
    ours, base = row["contenders"].get(name, {}), row["contenders"].get("materialized", {})
    if ours.get("status") != "ok" or base.get("status") != "ok":
        return {"time": None, "peak": None, "transient": None}
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {
        "time": div(ours["ms"]["median"], base["ms"]["median"]),
        "peak": div(ours["peak_bytes"], base["peak_bytes"]),
        "transient": div(ours["transient_bytes"], base["transient_bytes"]),
    }

