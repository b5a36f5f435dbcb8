"""The first-step self-check of the TRL drop-in: TRL's own `_compute_loss` beside the fused one on the same batch.

Cost: one extra forward and backward (TRL's loss), on the first training micro-batch only; during it, two copies of
the trainable parameters' gradients are held. Every later step runs the fused loss alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# The parity tolerances of the tests: fp32, and mixed precision / half-precision weights (bf16 logits: TRL's head and
# ours round the same gradient differently, a few bf16 ulps of 2^-8)
FP32_TOLERANCES = {"loss_rtol": 1e-5, "loss_atol": 1e-7, "grad_rtol": 1e-4, "metric_rtol": 1e-5, "metric_atol": 1e-6}
HALF_TOLERANCES = {"loss_rtol": 1e-4, "loss_atol": 1e-6, "grad_rtol": 3e-2, "metric_rtol": 1e-3, "metric_atol": 1e-4}
# Trainer state `_compute_loss` updates (the adaptive entropy controller): TRL's run must not leave its mark
_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


class FirstStepMismatch(RuntimeError):
    """The fused loss disagreed with TRL's own `_compute_loss` on the first training step; the message says where."""


@dataclass
class FirstStepReport:
    """What the self-check compared; `problems` is empty when the fused loss matched TRL's."""

    trl_version: str
    tolerances: dict[str, float]
    loss: float = math.nan
    trl_loss: float = math.nan
    worst_grad: tuple[str, float, float] = ("", 0.0, 0.0)  # (parameter, max error, bound)
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = (
            f"First-step check against TRL {self.trl_version}'s own GRPOTrainer._compute_loss: loss {self.loss!r} "
            f"(TRL {self.trl_loss!r}); worst gradient {self.worst_grad[0] or '-'}: max error "
            f"{self.worst_grad[1]:.3g} (bound {self.worst_grad[2]:.3g})"
        )
        if not self.problems:
            return head + "; everything agrees."
        return head + ". Differences:\n  - " + "\n  - ".join(self.problems)


def _tolerances(trainer: Any, model: torch.nn.Module) -> dict[str, float]:
    half = trainer.accelerator.mixed_precision in ("bf16", "fp16") or any(
        p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters() if p.requires_grad
    )
    return HALF_TOLERANCES if half else FP32_TOLERANCES


def _state(trainer: Any) -> dict[str, Any]:
    values = {}
    for name in _STATE:
        if hasattr(trainer, name):
            value = getattr(trainer, name)
            values[name] = value.clone() if isinstance(value, torch.Tensor) else value
    return values


def _grads(loss: torch.Tensor, params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g.detach() for (name, p), g in zip(params, grads)}


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


def _compare_metrics(ours: dict, theirs: dict, tol: dict[str, float], problems: list[str]) -> None:
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours:
            problems.append(f"metric {name!r}: TRL logs it, the fused loss does not")
        elif name not in theirs:
            problems.append(f"metric {name!r}: the fused loss logs it, TRL does not")
        elif len(ours[name]) != len(theirs[name]) or not all(
            _close(float(a), float(b), tol["metric_rtol"], tol["metric_atol"]) for a, b in zip(ours[name], theirs[name])
        ):
            problems.append(f"metric {name!r}: fused {ours[name]} vs TRL {theirs[name]}")


def _compare_state(ours: dict, theirs: dict, problems: list[str]) -> None:
    for name, ref in theirs.items():
        value = ours.get(name)
        if isinstance(ref, torch.Tensor) or isinstance(value, torch.Tensor):
            same = (
                isinstance(ref, torch.Tensor)
                and isinstance(value, torch.Tensor)
                and torch.allclose(value.double(), ref.double(), rtol=1e-5, atol=1e-6)
            )
        else:
            same = value == ref or (isinstance(ref, float) and isinstance(value, float) and _close(value, ref, 1e-6, 0))
        if not same:
            problems.append(f"trainer state {name}: fused {value!r} vs TRL {ref!r}")


def first_step_check(
    trainer: Any,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    fused: Callable[[Any, torch.nn.Module, dict[str, Any]], torch.Tensor],
    reference: Callable[[Any, torch.nn.Module, dict[str, Any]], torch.Tensor],
    trl_version: str,
) -> tuple[torch.Tensor, FirstStepReport]:
    """Run `reference` (TRL's `_compute_loss`) and `fused` on the same batch and compare; return the fused loss.

    The reference runs first, on the unwrapped model (its gradient is local, as the fused one's below), from the same
    RNG state the fused run then sees; its metrics and controller-state updates are discarded. The fused loss's
    gradient is taken here; the returned loss carries it to the caller's backward, and the fused metrics are logged
    as usual. Raises FirstStepMismatch with the report when something differs.
    """
    unwrapped = trainer.accelerator.unwrap_model(model)
    params = [(name, p) for name, p in unwrapped.named_parameters() if p.requires_grad]
    tol = _tolerances(trainer, unwrapped)
    report = FirstStepReport(trl_version=trl_version, tolerances=dict(tol))
    logged, before = trainer._metrics, _state(trainer)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        with torch.random.fork_rng(devices=devices):
            ref_loss = reference(trainer, unwrapped, inputs)
            ref_grads = _grads(ref_loss, params)
        ref_metrics = dict(trainer._metrics["train"])
        after_ref = _state(trainer)
        for name, value in before.items():
            setattr(trainer, name, value)
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        loss = fused(trainer, model, inputs)
        grads = _grads(loss, params)
        our_metrics = dict(trainer._metrics["train"])
        _compare_state(_state(trainer), after_ref, report.problems)
    finally:
        fused_metrics = trainer._metrics
        trainer._metrics = logged
    for mode, values in fused_metrics.items():
        for name, value in values.items():
            logged[mode][name].extend(value)

    report.loss, report.trl_loss = loss.detach().double().item(), ref_loss.detach().double().item()
    if not _close(report.loss, report.trl_loss, tol["loss_rtol"], tol["loss_atol"]):
        report.problems.append(
            f"loss: fused {report.loss!r} vs TRL {report.trl_loss!r} "
            f"(relative error {abs(report.loss - report.trl_loss) / max(abs(report.trl_loss), 1e-30):.3g})"
        )
    worst = -1.0
    bad_grads = []
    for name, ref in ref_grads.items():
        err = (grads[name].double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        bound = tol["grad_rtol"] * (ref.double().abs().max().item() if ref.numel() else 0.0) + 1e-12
        if not math.isfinite(err) or err > bound:
            bad_grads.append(f"gradient of {name}: max error {err:.3g} > {bound:.3g} ({tol['grad_rtol']:g} of its max)")
        if err / bound > worst:
            worst, report.worst_grad = err / bound, (name, err, bound)
    if bad_grads:
        shown = bad_grads[:8]
        if len(bad_grads) > len(shown):
            shown.append(f"... and {len(bad_grads) - len(shown)} more parameters of {len(ref_grads)}")
        report.problems.extend(shown)
    _compare_metrics(our_metrics, ref_metrics, tol, report.problems)
    if report.problems:
        raise FirstStepMismatch(str(report))
    # The step's own backward must not run the fused loss's backward again: hand it a loss of the same value whose
    # gradient is the one just computed (Σ p·g, less its value), so DDP's hooks and loss scaling apply as usual
    link = sum((p * grads[name].to(p.dtype)).sum() for name, p in params)
    return loss.detach() + (link - link.detach()), report


__all__ = ["FP32_TOLERANCES", "HALF_TOLERANCES", "FirstStepMismatch", "FirstStepReport", "first_step_check"]
