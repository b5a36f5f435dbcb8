"""With check_inputs=False no public call reads a value back to the host, in its forward or its backward.

On a GPU such a read (`.item()`, `.tolist()`, `bool()`/`int()`/`float()` of a tensor, `.cpu()`, a boolean-mask index,
`nonzero`, a tensor built from host data, ...) waits for the queue to drain and cannot be captured in a CUDA graph. A
CPU does not wait, so the tests here record each such call made from a grpo_kernels frame instead: torch's own Python
frames in between are looked through (`x.unique()` is torch code calling `torch.unique`), Triton's interpreter is
not (it is the device here). The CUDA graph test at the end captures the real thing on a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from grpo_kernels import (
    GRPOLoss,
    boundary,
    fused_linear_grpo_loss,
    fused_linear_log_softmax,
    grpo_loss,
    selective_log_softmax,
)
from grpo_kernels.ops import cpu_rows

from .conftest import HAS_TRITON_DEVICE, ON_GPU

B, T, V, H = 2, 3, 17, 8


def _package_frame() -> str | None:
    """`module:line` of the grpo_kernels frame that made the call being recorded, or None for anyone else's."""
    frame = sys._getframe(2)  # 0: here, 1: the patched function, 2: its caller
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "torch" or module.startswith("torch."):
            frame = frame.f_back
            continue
        if module == "grpo_kernels" or module.startswith("grpo_kernels."):
            return f"{module}:{frame.f_lineno}"
        return None
    return None


def _is_mask(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    values = (*args, kwargs.get("device"))
    return any(isinstance(v, (torch.device, str)) for v in values if v is not None)


# What synchronizes, and when: always, or only for these arguments (a boolean index, no output size, ...).
ALWAYS = lambda *args, **kwargs: True
READS = "item tolist cpu numpy nonzero argwhere unique unique_consecutive masked_select equal bincount new_tensor"
DUNDERS = "__bool__ __int__ __float__ __index__ __complex__ __array__"
TENSOR_METHODS = {
    **dict.fromkeys((*READS.split(), *DUNDERS.split()), ALWAYS),
    "__getitem__": lambda self, index, *rest: _is_mask(index),
    "__setitem__": lambda self, index, *rest: _is_mask(index),
    "repeat_interleave": lambda self, *args, **kwargs: "output_size" not in kwargs,
    "to": lambda self, *args, **kwargs: _names_a_device(args, kwargs),
}
TORCH_FUNCTIONS = {
    **dict.fromkeys(
        ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "equal", "bincount"), ALWAYS
    ),
    "repeat_interleave": lambda *args, **kwargs: "output_size" not in kwargs,
    # data from the host: a synchronous copy from pageable memory on a GPU
    "tensor": ALWAYS,
    "as_tensor": lambda data, *args, **kwargs: not isinstance(data, torch.Tensor),
}


@pytest.fixture
def host_reads(monkeypatch) -> list[str]:
    """The host reads made from grpo_kernels frames while the test runs, as 'what at module:line'."""
    found: list[str] = []

    def record(name: str, real, syncs):
        def patched(*args, **kwargs):
            if syncs(*args, **kwargs) and (where := _package_frame()) is not None:
                found.append(f"{name} at {where}")
            return real(*args, **kwargs)

        return patched

    for name, syncs in TENSOR_METHODS.items():
        monkeypatch.setattr(torch.Tensor, name, record(f"Tensor.{name}", getattr(torch.Tensor, name), syncs))
    for name, syncs in TORCH_FUNCTIONS.items():
        monkeypatch.setattr(torch, name, record(f"torch.{name}", getattr(torch, name), syncs))
    monkeypatch.setattr(torch.cuda, "synchronize", record("torch.cuda.synchronize", torch.cuda.synchronize, ALWAYS))
    return found


def assert_no_host_read(found: list[str]) -> None:
    assert not found, "host reads on the hot path:\n" + "\n".join(sorted(set(found)))


# ----------------------------------------------------------------------------------------------------------------
# Inputs and the public calls, forward and backward


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[1, 2] = 0.0  # a padded token
    return {
        "logits": torch.randn(B, T, V, generator=gen),
        "completion_ids": torch.randint(0, V, (B, T), generator=gen),
        "advantages": torch.randn(B, generator=gen),
        "completion_mask": mask,
        "old_logp": torch.randn(B, T, generator=gen) * 0.1 - 3.0,
        "ref_logp": torch.randn(B, T, generator=gen) * 0.1 - 3.0,
        "importance_sampling_ratio": 0.8 + 0.4 * torch.rand(B, T, generator=gen),
    }


# The option sets that reach every schedule: the one-read fused pass (token level; the dapo token count from
# num_items_in_batch, the KL, the entropy bonus), the two-pass schedule (sequence-level ratio, entropy mask, off-policy
# mask, whose per-sequence metrics average over rows), and the per-token loss.
TOKEN = {"loss_type": "dapo", "beta": 0.04, "num_items_in_batch": 5, "entropy_coef": 0.01}
SEQUENCE = {"importance_sampling_level": "sequence", "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.5}


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


def _grpo_loss(backend: str, options: dict, reduction: str = "loss_type") -> list[torch.Tensor]:
    args = _inputs()
    x = _leaf(args.pop("logits"))
    out = grpo_loss(x[:, :], **args, backend=backend, reduction=reduction, **options)
    upstream = torch.randn(out.loss.shape) if reduction == "none" else torch.tensor(0.5)
    out.loss.backward(upstream)
    return [out.loss, out.logp, out.entropy, *out.metrics.values(), x.grad]


def _module(backend: str) -> list[torch.Tensor]:
    args = _inputs()
    x = _leaf(args.pop("logits"))
    out = GRPOLoss(loss_type="sapo", backend=backend)(x, **args)
    out.loss.backward()
    return [out.loss, x.grad]


def _selective_log_softmax(backend: str) -> list[torch.Tensor]:
    args = _inputs()
    x = _leaf(args["logits"])
    logp, entropy = selective_log_softmax(x, args["completion_ids"], 0.7, backend=backend)
    (logp * torch.randn(B, T)).sum().add((entropy * torch.randn(B, T)).sum()).backward()
    return [logp, entropy, x.grad]


def _hidden_and_weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / H**0.5, torch.randn(V, generator=gen)


def _fused_linear_grpo_loss(backend: str, options: dict) -> list[torch.Tensor]:
    args = _inputs()
    del args["logits"]
    hidden, weight, bias = (_leaf(t) for t in _hidden_and_weight())
    out = fused_linear_grpo_loss(hidden, weight, bias=bias, backend=backend, **args, **options)
    out.loss.backward(torch.tensor(0.5))
    return [out.loss, out.logp, *out.metrics.values(), hidden.grad, weight.grad, bias.grad]


def _fused_linear_log_softmax(backend: str) -> list[torch.Tensor]:
    ids = _inputs()["completion_ids"]
    hidden, weight, bias = (_leaf(t) for t in _hidden_and_weight())
    logp, entropy = fused_linear_log_softmax(hidden, weight, ids, temperature=0.7, bias=bias, backend=backend)
    upstream = torch.randn(2, B, T)
    upstream[:, 0, 1] = 0.0  # a row without gradient
    torch.autograd.backward([logp, entropy], [upstream[0], upstream[1]])
    return [logp, entropy, hidden.grad, weight.grad, bias.grad]


def _compiled(backend: str, options: dict) -> list[torch.Tensor]:
    """What torch.compile traces: grpo_loss's own Python as it runs while compiling (boundary.compiling() true),
    its custom ops (compile_op.py) executed as they are at run time."""
    args = _inputs()
    x = _leaf(args.pop("logits"))
    with mock.patch.object(boundary, "compiling", return_value=True):
        out = grpo_loss(x, **args, backend=backend, **options)
    out.loss.backward()
    return [out.loss, out.logp, out.entropy, *out.metrics.values(), x.grad]


CALLS = {
    "grpo_loss-token": lambda backend: _grpo_loss(backend, TOKEN),
    "grpo_loss-sequence": lambda backend: _grpo_loss(backend, SEQUENCE),
    "grpo_loss-per-token": lambda backend: _grpo_loss(backend, {"beta": 0.04}, reduction="none"),
    "GRPOLoss": _module,
    "selective_log_softmax": _selective_log_softmax,
    "fused_linear_grpo_loss-token": lambda backend: _fused_linear_grpo_loss(backend, TOKEN),
    "fused_linear_grpo_loss-sequence": lambda backend: _fused_linear_grpo_loss(backend, SEQUENCE),
    "fused_linear_log_softmax": _fused_linear_log_softmax,
    "compile-token": lambda backend: _compiled(backend, TOKEN),
    "compile-sequence": lambda backend: _compiled(backend, SEQUENCE),
}

# backend="auto" on the CPU runs the C rows ("torch" runs them too) or, with GRPO_KERNELS_CPU_ROWS=0, the chunked
# torch rows; backend="triton" runs the kernels under Triton's interpreter.
BACKENDS = [
    pytest.param("auto", "1", id="c-rows", marks=pytest.mark.skipif(not cpu_rows.available(), reason="not built")),
    pytest.param("torch", "0", id="torch-rows"),
    pytest.param("triton", "1", id="triton", marks=pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="no Triton")),
]


@pytest.mark.parametrize("backend, c_rows", BACKENDS)
def test_no_public_call_reads_a_value_back(backend, c_rows, monkeypatch, host_reads):
    monkeypatch.setenv("GRPO_KERNELS_CPU_ROWS", c_rows)
    failures = []
    for name, call in CALLS.items():
        results = call(backend)
        assert all(torch.isfinite(r).all() for r in results if r is not None), name  # valid inputs, real numbers
        if host_reads:
            failures.append(f"{name}: " + ", ".join(sorted(set(host_reads))))
            host_reads.clear()
    assert not failures, "host reads on the hot path:\n" + "\n".join(failures)


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (gloo, in memory): the vocabulary-parallel code paths, one shard."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend, c_rows", BACKENDS)
def test_vocabulary_parallel_calls_read_nothing_back(backend, c_rows, monkeypatch, one_rank_group, host_reads):
    """The shard's offset and the full vocabulary stay on the device (vocab_parallel.shard_offset)."""
    monkeypatch.setenv("GRPO_KERNELS_CPU_ROWS", c_rows)
    args = _inputs()
    x = _leaf(args.pop("logits"))
    out = grpo_loss(x, **args, backend=backend, vocab_parallel_group=one_rank_group, **SEQUENCE)
    out.loss.backward()
    del args["completion_ids"]
    hidden, weight, bias = (_leaf(t) for t in _hidden_and_weight())
    ids = _inputs()["completion_ids"]
    fused = fused_linear_grpo_loss(hidden, weight, ids, bias=bias, backend=backend, vocab_parallel_group=one_rank_group,
                                   **args, **TOKEN)  # fmt: skip
    fused.loss.backward()
    logp, entropy = fused_linear_log_softmax(hidden, weight, ids, bias=bias, backend=backend,
                                             vocab_parallel_group=one_rank_group)  # fmt: skip
    (logp.sum() + entropy.sum()).backward()
    results = [out.loss, x.grad, fused.loss, logp, entropy, hidden.grad, weight.grad]
    assert all(torch.isfinite(r).all() for r in results)
    assert_no_host_read(host_reads)


def test_the_detector_sees_a_host_read(host_reads):
    """The test above can fail: check_inputs=True reads its checks' results back (once, by design), and is seen."""
    args = _inputs()
    grpo_loss(**args, backend="torch", check_inputs=True)
    assert any("grpo_kernels.validation" in f for f in host_reads), host_reads
    host_reads.clear()
    x = torch.ones(3)
    assert x.sum().item() == 3.0 and bool(x[x > 0].any())  # from a test frame: not the package's
    assert not host_reads


# ----------------------------------------------------------------------------------------------------------------
# The backward's scaling on the device (ops/triton_scale.py): what `x.mul_(float(scale))` gives, read by the kernel


def _scale_cases(device: str) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """(base tensor, the view that is scaled): a strided [B, T, V] view with two tiles per row (the gradient of
    sliced logits), and the contiguous ∂weight / ∂bias shapes of fused-linear."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 3, 4096 + 9, generator=gen)
    full[0, 0, :8] = torch.tensor([1e-39, -3e-41, 1e-45, 0.0, -0.0, float("inf"), float("nan"), 6e4])  # subnormals
    flat = torch.randn(5, 7, generator=gen)
    whole = lambda t: t
    return [(full.to(device), lambda t: t[:, 1:, 3:-2]), (flat.to(device), whole), (flat[0].to(device), whole)]


def _assert_scale_matches_torch(device: str) -> None:
    """Bit for bit; except, under Triton's interpreter, bf16, whose fp32 -> bf16 conversion the interpreter emulates
    by truncation where a GPU rounds to nearest even (as torch does): there, within one bf16 ulp."""
    from grpo_kernels.ops import triton_scale

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        rtol = 2.0**-7 if dtype == torch.bfloat16 and device == "cpu" else 0.0
        scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        for scale in (1.0 / 3.0, 1.0, 0.5**-20, float("nan")):
            s = torch.tensor(scale, dtype=scale_dtype, device=device)
            for base, view in _scale_cases(device):
                base = base.to(dtype)
                want, got = base.clone(), base.clone()
                view(want).mul_(float(s))  # what the backward did before: a host scalar, applied in fp32 (opmath)
                triton_scale.scale_(view(got), s)
                torch.testing.assert_close(got, want, rtol=rtol, atol=0, equal_nan=True, msg=f"{dtype} x {scale}")
                assert torch.equal(got.isnan(), want.isnan()), f"{dtype} x {scale}"


@pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="no Triton")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 inf
def test_device_side_scale_equals_the_host_scalar_product():
    """Strided rows, ragged tiles, a grid-stride loop; s = 1 leaves x as it is, NaN makes it NaN; outside the view
    nothing is written."""
    _assert_scale_matches_torch("cuda" if ON_GPU else "cpu")


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: grpo_loss forward + backward captured in a CUDA graph, replayed on new inputs


def _cuda_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, length, vocab = 4, 33, 3000
    args = {
        "logits": torch.randn(batch, length, vocab, generator=gen).to(torch.bfloat16),
        "completion_ids": torch.randint(0, vocab, (batch, length), generator=gen),
        "advantages": torch.randn(batch, generator=gen),
        "completion_mask": (torch.rand(batch, length, generator=gen) > 0.2).float(),
        "old_logp": torch.randn(batch, length, generator=gen) * 0.1 - 8.0,
        "ref_logp": torch.randn(batch, length, generator=gen) * 0.1 - 8.0,
        "importance_sampling_ratio": 0.8 + 0.4 * torch.rand(batch, length, generator=gen),
    }
    return {name: x.cuda() for name, x in args.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [TOKEN, SEQUENCE], ids=["token", "sequence"])
def test_grpo_loss_forward_and_backward_replay_in_a_cuda_graph(options):
    """A host read inside the capture raises (capture_error_mode "global"); a replay on new inputs equals eager."""
    static = _cuda_inputs(0)
    logits = static.pop("logits").requires_grad_(True)  # a leaf: its .grad is an output of the graph
    upstream = torch.full((), 0.5, device="cuda")  # != 1: the backward's scaling runs, on the device

    def step():
        out = grpo_loss(logits, **static, **options)
        out.loss.backward(upstream)
        return out

    # Warm up on a side stream (Triton compiles, autograd sets up), as torch's CUDA graph notes prescribe.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            logits.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    logits.grad = None  # so that the captured backward allocates .grad from the graph's private pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    new = _cuda_inputs(1)
    with torch.no_grad():
        logits.copy_(new.pop("logits"))
        for name, x in new.items():
            static[name].copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    x = logits.detach().clone().requires_grad_(True)
    want = grpo_loss(x, **{name: t.clone() for name, t in static.items()}, **options)
    want.loss.backward(upstream)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logp, want.logp)
    assert all(torch.equal(out.metrics[k], want.metrics[k]) for k in want.metrics)
    assert torch.equal(logits.grad, x.grad) and bool(torch.isfinite(x.grad).all())
