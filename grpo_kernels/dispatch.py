"""The one place a backend is chosen: `pick_backend` for the logits path, `pick_linear_backend` for fused-linear,
`scale_` for the backward's scaling of a stored gradient.

Both return objects typed by the protocols of ops/backend.py. The Triton modules are imported only when picked, so a
machine without Triton (or without CUDA) never imports them.
"""

from __future__ import annotations

import os

import torch

from .config import BACKENDS
from .ops.backend import LinearBackend, RowBackend


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; ValueError for an unknown name or Triton without CUDA."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}); on a CPU it runs only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing triton), or use backend='torch'"
        )
    return name


def _wants_torch(name: str, device: torch.device, dtype: torch.dtype | None, what: str) -> bool:
    """True for the torch backend; float64 always runs there ("auto" routes it, "triton" is refused by name)."""
    resolved = resolve_backend_name(name, device)
    if dtype == torch.float64:
        if resolved == "triton" and name == "triton":
            raise TypeError(
                f"backend='triton' does not take float64 {what} (the kernels compute in fp32); use backend='torch' "
                "or 'auto', which computes float64 inputs in float64"
            )
        return True
    return resolved == "torch"


def pick_backend(device: torch.device, name: str = "auto", dtype: torch.dtype | None = None) -> RowBackend:
    """The logits-path row backend for tensors on `device` of `dtype` (float64 -> the chunked torch rows, which
    compute it in float64; the C rows are fp32)."""
    if _wants_torch(name, device, dtype, "logits"):
        from .ops import cpu_rows, torch_rows

        if device.type != "cpu" or dtype == torch.float64:
            return torch_rows
        if cpu_rows.available():
            return cpu_rows  # the fused C rows; the chunked torch rows where the extension is not built
        cpu_rows.warn_unavailable()
        return torch_rows
    from .ops import triton_logits

    return triton_logits


def pick_linear_backend(device: torch.device, name: str = "auto", dtype: torch.dtype | None = None) -> LinearBackend:
    """The fused-linear tile backend for `device`: the same name, device and dtype rules as `pick_backend`."""
    if _wants_torch(name, device, dtype, "hidden and weight"):
        from .ops import linear_folds_torch

        return linear_folds_torch.BACKEND
    from .ops import linear_folds_triton

    return linear_folds_triton.BACKEND


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place without reading `scale` (the upstream gradient of a scalar loss) on the host.

    On CUDA a Triton kernel reads it and skips the pass when it is exactly 1 (ops/triton_scale.py); elsewhere the
    host is the device and `mul_` takes the 0-d tensor as an fp32 scalar, exactly as `mul_(float(scale))` does.
    """
    if x.is_cuda:
        try:
            from .ops import triton_scale
        except ImportError:  # no Triton: one pass, the scale rounded to x's dtype for half-precision x
            x.mul_(scale)
            return
        triton_scale.scale_(x, scale)
        return
    x.mul_(scale)
