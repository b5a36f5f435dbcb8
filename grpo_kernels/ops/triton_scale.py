"""A stored gradient times the upstream gradient of a scalar loss, on the device: the scale is read by the kernel,
never by the host, and a scale of exactly 1 (a plain `loss.backward()`) costs no pass over the gradient.

The backward of `grpo_loss` and `fused_linear_grpo_loss` only scales what the forward computed. Reading the scale on
the host to skip the pass would drain the GPU queue and could not be captured in a CUDA graph; scaling with
`torch.mul` would always cost a pass and round the fp32 scale to a bf16 gradient's dtype first. Here every program
reads the scale, and only when it is not 1 walks its share of the tiles: x = x·s computed in fp32 (float64 for
float64 x) and rounded once, as `x.mul_(python_float)` does on CUDA (a NaN scale makes every element NaN).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per tile: 16 per thread at 8 warps
PROGRAMS_PER_SM = 4  # a persistent grid: when the scale is 1, each program reads it and exits


@triton.jit(do_not_specialize=["rows", "T", "V", "tiles_per_row"])
def scale_fwd_kernel(
    x_ptr,  # [B, T, V] (any batch and time strides, unit V stride), scaled in place
    s_ptr,  # [1] the scale, float32 (float64 for float64 x)
    rows,
    T,
    stride_b,
    stride_t,
    V,
    tiles_per_row,
    BLOCK: tl.constexpr,
):
    b_s = tl.load(s_ptr)
    if b_s != 1.0:  # NaN != 1: a NaN scale is applied
        i_p = tl.program_id(0)
        n_p = tl.num_programs(0)
        o_v = tl.arange(0, BLOCK)
        for i_tile in range(i_p, rows * tiles_per_row, n_p):
            i_row = (i_tile // tiles_per_row).to(tl.int64)
            v0 = (i_tile % tiles_per_row).to(tl.int64) * BLOCK
            p_x = x_ptr + (i_row // T) * stride_b + (i_row % T) * stride_t + v0 + o_v
            m_v = o_v < V - v0
            b_x = tl.load(p_x, mask=m_v)  # [BLOCK]
            tl.store(p_x, (b_x.to(b_s.dtype) * b_s).to(x_ptr.dtype.element_ty), mask=m_v)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(rows, T, stride_b, stride_t, V) of x as rows of unit stride: a contiguous tensor is one row."""
    if x.is_contiguous():
        return 1, 1, 0, 0, x.numel()
    if x.dim() == 3 and (x.stride(2) == 1 or x.shape[2] == 1):
        batch, length, vocab = x.shape
        return batch * length, length, x.stride(0), x.stride(1), vocab
    raise ValueError(f"scale_: x must be contiguous or [B, T, V] with unit V stride, got strides {x.stride()}")


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, `scale` a one-element tensor on x's device (read by the kernel only); returns x."""
    if x.numel() == 0:
        return x
    rows, length, stride_b, stride_t, vocab = _rows_view(x)
    s = scale.detach().reshape(1).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    tiles_per_row = triton.cdiv(vocab, BLOCK)
    programs = rows * tiles_per_row
    if x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        programs = min(programs, PROGRAMS_PER_SM * _sm_count(index))
    else:  # the interpreter runs programs one after another: a few exercise the grid-stride loop
        programs = min(programs, 3)
    scale_fwd_kernel[(programs,)](
        x, s, rows, length, stride_b, stride_t, vocab, tiles_per_row, BLOCK=BLOCK, num_warps=8
    )
    return x
