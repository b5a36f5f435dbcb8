"""The tensor checks of the public functions: run once, at the boundary, so that nothing below re-checks.

`grpo_loss`, `selective_log_softmax` and the fused-linear functions call these. Shapes, dtypes and devices are known
to the host and raise a TypeError/ValueError that names the argument, what was expected and what came. Values are
not: `check_values` (check_inputs=True) reads its findings back once and raises the same way; without it,
`value_guard` keeps every value check on the device (no host read) and turns a bad value into NaN results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .loss_math import TokenInputs

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the torch path only


def check_tensor(name: str, x: Any, shapes: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}, got {x.device}")
    return x


def check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().double()


def check_rows_tensor(name: str, x: Any, last: str) -> torch.Tensor:
    """A non-empty (B, T, `last`) float32/bfloat16/float16/float64 tensor: the logits, or fused-linear's hidden
    states (float64 runs on the torch path, in float64; `dispatch` refuses it on Triton)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D (B, T, {last}), got {x.dim()}-D with shape {tuple(x.shape)}")
    if x.dtype not in LOGITS_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if min(x.shape) == 0:
        raise ValueError(f"{name} must have B, T, {last} >= 1, got shape {tuple(x.shape)}")
    return x


def check_logits(logits: Any) -> torch.Tensor:
    logits = check_rows_tensor("logits", logits, "V")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits must have a unit stride along the vocabulary (got strides {logits.stride()}); "
            "batch and time strides may be anything, so slice the time axis rather than transposing the vocabulary"
        )
    return logits


def check_ids(ids: Any, batch: int, length: int, device: torch.device, rows: str = "logits") -> torch.Tensor:
    """Shape and dtype; the value range, where the vocabulary size is known: on the device (`value_guard`), or read
    back with check_inputs=True (`check_values`, `check_ids_range`). `rows`: what scores the ids (logits, hidden)."""
    if isinstance(ids, torch.Tensor) and tuple(ids.shape) == (batch, length - 1):
        raise ValueError(
            f"{rows} have one position more than completion_ids ({rows} {length} positions, completion_ids "
            f"{length - 1}): {rows}[:, t] must score completion_ids[:, t] (already shifted); pass {rows}[:, :-1], "
            f"or of a model's whole output full_{rows}[:, -T-1:-1] with T = completion_ids.shape[1]"
        )
    ids = check_tensor("completion_ids", ids, ((batch, length),), device)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"completion_ids must be int32/int64, got {ids.dtype}")
    return ids


def token_inputs(
    batch: int,
    length: int,
    dev: torch.device,
    advantages: Any,
    completion_mask: Any,
    old_logp: Any,
    ref_logp: Any,
    importance_sampling_ratio: Any,
    sampling_logp: Any,
    *,
    beta: float,
    data_group: Any = None,
) -> TokenInputs:
    """The per-token tensors of a (batch, length) call on `dev`, checked and in float64, as one `TokenInputs`."""
    bt = ((batch, length),)
    adv = check_float(
        "advantages", check_tensor("advantages", advantages, ((batch,), (batch, 1), (batch, length)), dev)
    )
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    if completion_mask is None:
        mask = torch.ones(batch, length, dtype=torch.float64, device=dev)
    else:
        mask = check_tensor("completion_mask", completion_mask, bt, dev).detach().double()
    optional = {}
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampling_logp", sampling_logp)):
        optional[name] = None if x is None else check_float(name, check_tensor(name, x, bt, dev))
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={beta})")
    is_ratio = importance_sampling_ratio
    if is_ratio is not None:
        shapes = ((batch,), (batch, 1), (batch, length))
        is_ratio = check_float(
            "importance_sampling_ratio", check_tensor("importance_sampling_ratio", is_ratio, shapes, dev)
        )
        if is_ratio.dim() == 1:
            is_ratio = is_ratio.unsqueeze(1)
    return TokenInputs(
        adv, mask, optional["old_logp"], optional["ref_logp"], is_ratio, optional["sampling_logp"], data_group
    )


def _first(bad: torch.Tensor) -> torch.Tensor:
    """The flat index of the first True of `bad`, or −1: a 0-d int64 tensor (no host sync)."""
    flat = bad.reshape(-1)
    if flat.numel() == 0:
        return torch.tensor(-1, dtype=torch.int64, device=bad.device)
    return torch.where(flat.any(), flat.to(torch.int32).argmax(), -1).to(torch.int64)


def _position(index: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def _on_active(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """`active` [B, T] as the mask of `x`: per sequence ([B, 1]: any active token) or per token."""
    return active.any(-1, keepdim=True) if x.shape[-1] == 1 and active.shape[-1] != 1 else active


def _mask_is_not_zero_one(mask: torch.Tensor) -> torch.Tensor:
    return (mask != 0) & (mask != 1)  # NaN too


def _negative_ratio(inp: TokenInputs) -> torch.Tensor | None:
    return None if inp.is_ratio is None else (inp.is_ratio < 0) & _on_active(inp.is_ratio, inp.mask != 0)


class ValueGuard(NamedTuple):
    """The value checks of a call kept on the device (check_inputs=False): nothing is read back, nothing raises.

    Multiplying by these factors changes no number of a valid call (x·1 = x); an invalid one gives NaN results:
    - `ids`: the ids with each one outside [0, vocab) replaced by 0, so no kernel reads outside a row;
    - `per_token`: [B, T] float32, NaN at an active token (any token, without a mask) whose id was outside
      [0, vocab), else 1 (for its ℓ and H);
    - `call`: 0-d float32, NaN when an active token's id was outside [0, vocab), the mask held a value other than
      0 and 1 or ρ < 0 at an active token, else 1: for the loss and its metrics, and through autograd every
      gradient. A masked token's id is never checked: whatever it holds, it is read as 0.
    """

    ids: torch.Tensor
    per_token: torch.Tensor
    call: torch.Tensor

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.per_token

    def scalars(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: value * self.call for name, value in metrics.items()}


@dataclass(frozen=True)
class TokenCall:
    """A call's per-token side, checked: what the autograd functions and the compiled op take.

    `factor` is the loss's and the metrics' factor (1, NaN for an invalid value at an active token; under
    torch.compile with check_inputs=True it also carries the check op's zero, so that the op is never dropped as
    unused); `weights` are `loss_math.aggregation_weights`, once per call (None with reduction="none")."""

    inp: TokenInputs
    guard: ValueGuard
    factor: torch.Tensor
    weights: torch.Tensor | None

    @property
    def ids(self) -> torch.Tensor:
        """The ids in [0, V) (`ValueGuard`): the ones the kernels read."""
        return self.guard.ids


def _nan_where(bad: torch.Tensor) -> torch.Tensor:
    """float32 ones of `bad`'s shape, NaN where `bad` holds."""
    return torch.ones(bad.shape, dtype=torch.float32, device=bad.device).masked_fill_(bad, math.nan)


def _outside(ids: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    return (ids < 0) | (ids >= vocab)


def value_guard(
    ids: torch.Tensor, vocab: int | torch.Tensor, inp: TokenInputs | None = None, active: torch.Tensor | None = None
) -> ValueGuard:
    """The `ValueGuard` of a call: ids against `vocab` (an int, or a 0-d tensor: the full vocabulary of a sharded
    one), and with `inp` the 0/1 mask and ρ >= 0 at active tokens. O(B·T) device work, no host read.

    Every id outside [0, vocab) becomes 0 (no kernel reads outside a row); with `inp`, one at a masked token (the
    -100 of Hugging Face's padding convention, or anything else) is ignored as its logits are, and only one at an
    active token makes the results NaN. `active`: the [B, T] bool mask of the per-token layers, where `inp` is not
    given (None: every token is active)."""
    outside = _outside(ids, vocab)
    if inp is not None:
        active = inp.mask != 0
    bad_ids = outside if active is None else outside & active
    invalid = bad_ids.any()
    if inp is not None:
        invalid = invalid | _mask_is_not_zero_one(inp.mask).any()
        negative = _negative_ratio(inp)
        if negative is not None:
            invalid = invalid | negative.any()
    return ValueGuard(ids=ids.masked_fill(outside, 0), per_token=_nan_where(bad_ids), call=_nan_where(invalid))


def check_values(
    ids: torch.Tensor,
    vocab: int | torch.Tensor,
    inp: TokenInputs,
    *,
    beta: float = 0.0,
    logits: torch.Tensor | None = None,
    logits_are_shard: bool = False,
) -> None:
    """The value checks of check_inputs=True, with one host sync for all of them: ids in [0, vocab), a 0/1
    completion mask, ρ >= 0 at active tokens, and every active token's advantage, ℓ_old, ℓ_ref (when β != 0), ρ and
    (when given) logits row finite (for the logits: no NaN, no +inf, not all −inf; an O(B·T·V) pass). Masked
    tokens may hold anything, their ids included (-100 or any other value): they are absent from the loss.
    `sampling_logp` is not checked: NaN and ±inf there are defined (the off-policy mask reads NaN as 0, as TRL).
    `vocab`: an int, or the 0-d tensor of a sharded one."""
    vocab = int(vocab)  # (a tensor: the full vocabulary of a shard, read back here, with check_inputs)
    mask = inp.mask
    active = mask != 0
    lo, hi = torch.aminmax(ids.masked_fill(~active, 0))  # a masked token's id is ignored, as its logits are
    found: list[tuple[str, tuple[int, ...], torch.Tensor]] = []  # (argument, shape, first bad flat index)

    def add(name: str, bad: torch.Tensor) -> None:
        found.append((name, tuple(bad.shape), _first(bad)))

    add("completion_mask", _mask_is_not_zero_one(mask))
    negative = _negative_ratio(inp)
    if negative is not None:
        add("negative ratio", negative)
    finite_inputs = [
        ("advantages", inp.advantages), ("old_logp", inp.old_logp), ("importance_sampling_ratio", inp.is_ratio)
    ]  # fmt: skip
    if beta != 0.0:
        finite_inputs.append(("ref_logp", inp.ref_logp))
    for name, x in finite_inputs:
        if x is not None:
            add(name, ~torch.isfinite(x) & _on_active(x, active))
    if logits is not None:
        top = logits.amax(-1)  # NaN propagates; +inf anywhere; −inf only for a row without any finite logit
        bad = torch.isnan(top) | (top == torch.inf)
        if not logits_are_shard:  # (a vocabulary shard may be all −inf: padded columns)
            bad |= top == -torch.inf
        add("logits", bad & active)
    values = torch.stack([lo.long(), hi.long()] + [f[2] for f in found]).tolist()  # the one host sync
    lo_v, hi_v = values[0], values[1]
    if lo_v < 0 or hi_v >= vocab:
        raise ValueError(
            f"completion_ids must lie in [0, {vocab}) (the logits' vocabulary), got values in [{lo_v}, {hi_v}]"
        )
    for (name, shape, _), index in zip(found, values[2:]):
        if index < 0:
            continue
        where = _position(index, shape)
        if name == "completion_mask":
            raise ValueError(
                f"completion_mask must hold only 0 and 1 (bool, int or float 0./1.), got {mask[where].item()} at "
                f"position {where}"
            )
        if name == "negative ratio":
            value = inp.is_ratio[where].item()
            raise ValueError(f"importance_sampling_ratio must be >= 0, got {value} at position {where}")
        if name == "logits":
            row = logits[where]
            bad_v = torch.isnan(row) | (row == torch.inf)
            v = int(bad_v.to(torch.int32).argmax())
            detail = f"{row[v].item()} at position {(*where, v)}"
            if not bool(bad_v.any()):
                detail = f"a row of only −inf at {where}"
            raise ValueError(f"check_inputs: logits must be finite at unmasked tokens, got {detail}")
        value = {"advantages": inp.advantages, "old_logp": inp.old_logp, "ref_logp": inp.ref_logp}.get(
            name, inp.is_ratio
        )
        raise ValueError(
            f"check_inputs: {name} must be finite at unmasked tokens, got {value[where].item()} at position {where}"
        )


def layer_guard(
    ids: torch.Tensor, vocab: int | torch.Tensor, completion_mask: Any, check_inputs: bool
) -> tuple[ValueGuard, torch.Tensor | None]:
    """The ids' checks of the per-token layers (`selective_log_softmax`, `fused_linear_log_softmax`): with a
    `completion_mask`, a masked token's id is ignored (read as 0); check_inputs=True raises for an active one
    outside [0, vocab) (one host sync), else it gives NaN at its token. Returns the guard and the bool mask."""
    active = None
    if completion_mask is not None:
        active = check_tensor("completion_mask", completion_mask, (tuple(ids.shape),), ids.device).detach() != 0
    if check_inputs:
        check_ids_range(ids if active is None else ids.masked_fill(~active, 0), vocab)
    return value_guard(ids, vocab, active=active), active


def masked_tokens(x: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """`x` [B, T] with 0 at the tokens `active` leaves out (no gradient reaches them); `x` itself without a mask."""
    return x if active is None else torch.where(active, x, torch.zeros((), dtype=x.dtype, device=x.device))


def check_ids_range(ids: torch.Tensor, vocab: int | torch.Tensor) -> None:
    """O(B·T) range check of the ids (check_inputs=True of the per-token layers), one host sync."""
    lo, hi = torch.aminmax(ids)
    lo, hi, vocab = int(lo), int(hi), int(vocab)
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"completion_ids must lie in [0, {vocab}) (the logits' vocabulary), got values in [{lo}, {hi}]"
        )
