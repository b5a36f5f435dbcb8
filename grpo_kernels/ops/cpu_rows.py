"""The fast CPU rows: torch_rows' interface on the fused C kernels of `grpo_kernels/csrc` (the `_cpu_rows` extension).

One call reads each row once for its maximum and once for its sums, and (for the gradient) once more while it is
still in L2, with rows spread over `torch.get_num_threads()` threads and the vocabulary in SIMD lanes. The
extension is built by `pip install` (C compiler and Python headers only); where it is missing, `available()` is
False and `dispatch.pick_backend` picks the chunked torch rows instead, with one warning (`warn_unavailable`);
`row_stats`, `row_grad` and `shard_partials` here fall back to them too, `fused_token_grad` raises. Setting
GRPO_KERNELS_CPU_ROWS=0 turns the extension off (to compare the two paths).

`fused_token_grad` forms the per-token coefficient in C (`token_coef` in csrc/cpu_rows.c), one of three copies
with `loss_math.per_token_terms` and `triton_logits._token_coef`; ops/coef.py lays out the scalars it passes.

The row state is the shared layout of ops/backend.py, [B, T, 4] = (row max, log Σe, 1 − p_y, Σ p·z'); the kernels
write the first three columns (the max replaced by 0 for a row that is all −inf) and H, and Σ p·z' = log Σe − H.
Precision rules as torch_rows: logits taken relative to the raw row max, 1 − p_y summed over the other tokens,
H = log Σe − Σ e·z / Σe. The launchers check every shape, dtype and stride they hand the C code as a raw pointer:
unlike the Triton launchers they cannot rely on asserts, which `python -O` strips.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from ..config import LossConfig
from . import torch_rows
from .backend import ROW_STATE_WIDTH, empty_row_state
from .coef import FUSED_LOSS_CODES, coef_flags, coef_scalars

if TYPE_CHECKING:
    from .linear_tiles import GradRows, RowStats

try:
    from .. import _cpu_rows as _ext
except ImportError as error:  # not built (no compiler at install time), or a checkout that was never installed
    _ext = None
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Below this many logits a call runs on the calling thread: waking the thread team costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 17
_warned = False
_forked = False


def _after_fork() -> None:
    # GNU OpenMP's thread team does not survive fork(); a forked child runs the kernels on one thread.
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork)


def available() -> bool:
    """True when the extension is built and not turned off by GRPO_KERNELS_CPU_ROWS=0."""
    return _ext is not None and os.environ.get("GRPO_KERNELS_CPU_ROWS", "1") != "0"


def warn_unavailable() -> None:
    """One warning per process that the CPU path runs on the slower chunked torch rows, and why."""
    global _warned
    if _warned or os.environ.get("GRPO_KERNELS_CPU_ROWS", "1") == "0":
        return
    _warned = True
    warnings.warn(
        f"grpo_kernels: the fused CPU kernels are not built ({_IMPORT_ERROR}); using the chunked torch rows, "
        "which are several times slower. Reinstall with a C compiler available (pip install -e .) to build them.",
        RuntimeWarning,
        stacklevel=3,
    )


def _supported(x: torch.Tensor) -> bool:
    return available() and x.device.type == "cpu"


def _threads(elements: int) -> int:
    if _forked or elements < PARALLEL_MIN_ELEMENTS:
        return 1
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------------------------
# Validation: the kernels take raw pointers, so every shape, dtype and stride they rely on is checked here.


def _check_rows(logits: torch.Tensor, ids: torch.Tensor) -> tuple[int, int, int]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits must be a 3-D (B, T, V) tensor, got {getattr(logits, 'shape', type(logits))}")
    if logits.dtype not in _DTYPE_CODES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    batch, length, vocab = logits.shape
    if logits.stride(-1) != 1 and vocab > 1:
        raise ValueError(f"logits must have unit stride along the vocabulary, got strides {logits.stride()}")
    if not isinstance(ids, torch.Tensor) or ids.shape != (batch, length):
        raise ValueError(f"ids must have shape {(batch, length)}, got {tuple(getattr(ids, 'shape', ()))}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32/int64, got {ids.dtype}")
    return batch, length, vocab


def _check_bt(name: str, x: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """A [B, T] float32 input (broadcast views welcome) as a contiguous [B·T] float32 tensor."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.shape != (batch, length):
        raise ValueError(f"{name} must have shape {(batch, length)}, got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {x.device}")
    return x.contiguous().view(-1)


def _check_out(out: torch.Tensor, logits: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or (out.shape, out.dtype, out.device) != (
        logits.shape,
        logits.dtype,
        logits.device,
    ):
        raise ValueError(
            f"out must match the logits ({tuple(logits.shape)}, {logits.dtype}, {logits.device}), got "
            f"{(tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__}"
        )
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        raise ValueError(f"out must have unit stride along the vocabulary, got strides {out.stride()}")


def _flat_ids(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.int64).contiguous().view(-1)


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _head(logits: torch.Tensor, ids: torch.Tensor) -> tuple:
    """The leading arguments every row kernel takes: (x, dtype, B·T, T, V, stride_b, stride_t, ids)."""
    batch, length, vocab = logits.shape
    return (
        logits.data_ptr(), _DTYPE_CODES[logits.dtype], batch * length, length, vocab,
        logits.stride(0), logits.stride(1), ids.data_ptr(),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The row-backend interface (api.py, vocab_parallel.ShardBackend)


def row_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, row_state): logp [B, T] float64 (ops/backend.py, "ℓ in float64"), entropy [B, T] float32,
    row_state [B, T, 4] in the layout of ops/backend.py."""
    batch, length, _ = _check_rows(logits, ids)
    if not _supported(logits):
        return torch_rows.row_stats(logits, ids, temperature)
    logp = torch.empty(batch, length, dtype=torch.float64)
    entropy = torch.empty(batch, length, dtype=torch.float32)
    head = torch.empty(batch, length, 3, dtype=torch.float32)  # (m, log Σe, 1 − p_y), as the kernel writes them
    flat = _flat_ids(ids)
    _ext.stats(
        *_head(logits, flat), 1.0 / temperature, 1.0 / temperature, logp.data_ptr(), entropy.data_ptr(),
        head.data_ptr(), _threads(logits.numel()),
    )  # fmt: skip
    state = empty_row_state(batch, length, logits.device)
    state[..., :3] = head
    torch.sub(head[..., 1], entropy, out=state[..., 3])  # Σ p·z' = log Σe − H
    return logp, entropy, state


def row_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    row_state: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    """out = (g·(onehot − p) − h·p·(z − Σ p·z)) / τ, as torch_rows.row_grad; `out` may be `logits` itself. An id
    outside [0, V) (a target in another vocabulary shard, negative included) contributes no one-hot."""
    batch, length, _ = _check_rows(logits, ids)
    _check_out(out, logits)
    if not _supported(logits):
        return torch_rows.row_grad(logits, ids, row_state, g, h, temperature, out)
    if row_state.shape != (batch, length, ROW_STATE_WIDTH) or row_state.dtype != torch.float32:
        raise ValueError(
            f"row_state must be [B, T, {ROW_STATE_WIDTH}] float32 from row_stats, got "
            f"{tuple(row_state.shape)} {row_state.dtype}"
        )
    head = row_state[..., :3].contiguous()
    entropy = (row_state[..., 1] - row_state[..., 3]).contiguous().view(-1)  # H = log Σe − Σ p·z'
    g_flat, h_flat = (_check_bt(n, x, batch, length) for n, x in (("g", g), ("h", h)))
    if g_flat is None:
        raise ValueError("g is required")
    flat = _flat_ids(ids)
    _ext.grad(
        *_head(logits, flat), 0, 1.0 / temperature, head.data_ptr(), entropy.data_ptr(),
        g_flat.data_ptr(), _ptr(h_flat), out.data_ptr(), out.stride(0), out.stride(1), _threads(logits.numel()),
    )  # fmt: skip


def shard_partials(logits: torch.Tensor, ids: torch.Tensor, offset: int, temperature: float) -> torch.Tensor:
    """[B, T, 5] float32 partials of one vocabulary shard, as torch_rows.shard_partials: (raw max m, Σ e,
    Σ e·z', raw target logit or −inf, Σ_{v≠y} e), e = exp(z'), z' = (x − m)/τ; `ids` are global."""
    batch, length, _ = _check_rows(logits, ids)
    if not _supported(logits):
        return torch_rows.shard_partials(logits, ids, offset, temperature)
    parts = torch.empty(batch, length, 5, dtype=torch.float32)
    flat = _flat_ids(ids)
    _ext.partials(*_head(logits, flat), int(offset), 1.0 / temperature, parts.data_ptr(), _threads(logits.numel()))
    return parts


def fused_token_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    *,
    advantages: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    rho: torch.Tensor | None,
    weight: torch.Tensor,
    entropy_weight: torch.Tensor | None,
    cfg: LossConfig,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over each row for the token-level losses: ℓ, H, g = ∂loss/∂ℓ and ∂logits (the interface of
    triton_logits.fused_token_grad: loss = Σ w·(ρ·L + β·kl) + Σ entropy_weight·H; `out` may be `logits`). logp is
    float64 (as row_stats) and g is formed from it; a row with weight 0 and entropy weight 0 gets exact
    zeros, its logits unread."""
    batch, length, _ = _check_rows(logits, ids)
    if cfg.is_sequence_level or cfg.loss_type not in FUSED_LOSS_CODES:
        raise ValueError(
            f"fused_token_grad handles token-level options only (loss_type in {tuple(FUSED_LOSS_CODES)}, no "
            f"sequence-level ratio or masks), got loss_type={cfg.loss_type!r}, "
            f"importance_sampling_level={cfg.importance_sampling_level!r}"
        )
    if cfg.beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={cfg.beta})")
    if advantages is None or weight is None:
        raise ValueError("advantages and weight are required")
    _check_out(out, logits)
    if cfg.beta == 0.0:
        ref_logp = None  # a given ref with β = 0 must not turn an inf into 0·inf
    per_token = {
        name: _check_bt(name, x, batch, length)
        for name, x in (
            ("advantages", advantages), ("old_logp", old_logp), ("ref_logp", ref_logp), ("rho", rho),
            ("weight", weight), ("entropy_weight", entropy_weight),
        )
    }  # fmt: skip
    if not _supported(logits):
        raise RuntimeError("cpu_rows.fused_token_grad needs the _cpu_rows extension (see available())")
    logp = torch.empty(batch, length, dtype=torch.float64)  # ℓ in float64, as row_stats
    entropy = torch.empty(batch, length, dtype=torch.float32)
    flat = _flat_ids(ids)
    _ext.fused(
        *_head(logits, flat), 1.0 / temperature, 1.0 / temperature, out.data_ptr(), out.stride(0), out.stride(1),
        logp.data_ptr(), entropy.data_ptr(), *(_ptr(x) for x in per_token.values()),
        *coef_flags(cfg).values(), *coef_scalars(cfg).values(), _threads(logits.numel()),
    )  # fmt: skip
    return logp, entropy


# ----------------------------------------------------------------------------------------------------------------
# The fused-linear folds (ops/linear_tiles.py's interface, on one fp32 tile of x @ Wᵀ + b)


def fold_stats(z: torch.Tensor, ids: torch.Tensor, v0: int, inv_t: float, st: RowStats) -> bool:
    """linear_folds_torch.fold_stats_torch in one pass over the tile; False, touching nothing, where the extension
    or the tile's layout does not allow it (the caller then runs the torch fold)."""
    if not (available() and z.dtype == torch.float32 and z.is_contiguous() and ids.is_contiguous()):
        return False
    rows, cols = z.shape
    fields = (st.max, st.sum_exp, st.sum_exp_z, st.target)
    if any(not f.is_contiguous() or f.dtype != torch.float32 for f in fields) or ids.dtype != torch.int64:
        return False
    _ext.fold_stats(z.data_ptr(), rows, cols, ids.data_ptr(), v0, inv_t, *(f.data_ptr() for f in fields),
                    _threads(z.numel()))  # fmt: skip
    return True


def fold_grad(z: torch.Tensor, v0: int, inv_t: float, rows: GradRows, grad_dtype: torch.dtype) -> torch.Tensor | None:
    """linear_folds_torch.fold_grad_torch in one pass, written over the tile z itself (the caller drops z after);
    None, touching nothing, where the extension or the tile's layout does not allow it."""
    ids, lse, mean_z, g, h = rows.ids, rows.lse, rows.mean_z, rows.g, rows.h
    inputs = [x for x in (ids, lse, mean_z, g, h) if x is not None]
    if not (available() and z.dtype == grad_dtype == torch.float32 and z.is_contiguous()) or any(
        not x.is_contiguous() for x in inputs
    ):
        return None
    if ids.dtype != torch.int64 or any(x.dtype != torch.float32 for x in (lse, g, mean_z, h) if x is not None):
        return None
    n_rows, cols = z.shape
    _ext.fold_grad(z.data_ptr(), n_rows, cols, ids.data_ptr(), v0, inv_t, lse.data_ptr(), _ptr(mean_z), g.data_ptr(),
                   _ptr(h), _threads(z.numel()))  # fmt: skip
    return z
