"""Checks that need the real chip: real sizes, no recompiles across completion lengths, past 2^31 elements, a
million completion tokens. Reported as skipped without a CUDA GPU (benchmarks/gpu_check.sh runs them)."""

import pytest
import torch

from grpo_kernels import grpo_loss
from grpo_kernels.ops import triton_logits
from reference import reference_grpo_loss

from .oracle_check import TOLERANCES, assert_close, assert_grad_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
KERNELS = (triton_logits.row_stats_fwd_kernel, triton_logits.row_grad_kernel, triton_logits.fused_token_grad_fwd_kernel)


def _jit(kernel):
    while not hasattr(kernel, "device_caches"):  # @triton.heuristics wraps the JITFunction
        kernel = kernel.fn
    return kernel


def _compiled_kernels() -> int:
    """Kernel binaries Triton has compiled so far (its per-device caches; the first slot is the kernel cache)."""
    return sum(len(entry[0]) for k in KERNELS for entry in _jit(k).device_caches.values())


def _problem(batch, length, vocab, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    full = (torch.randn(batch, length + 1, vocab, device="cuda", generator=gen) * 2).to(dtype)
    ids = torch.randint(0, vocab, (batch, length), device="cuda", generator=gen)
    adv = torch.randn(batch, device="cuda", generator=gen)
    mask = (torch.rand(batch, length, device="cuda", generator=gen) > 0.1).float()
    return full, ids, adv, mask


@pytest.mark.parametrize("options", [dict(loss_type="dapo", beta=0.04), dict(importance_sampling_level="sequence")])
def test_real_size_bf16_against_oracle(options):
    # Qwen's 151936 vocabulary in bf16; 4096 rows keep the float64 oracle (5 GB of logits) comfortable.
    full, ids, adv, mask = _problem(8, 512, 151936, torch.bfloat16)
    old = reference_grpo_loss(full[:, :-1].double(), ids, adv).logp.float() + 0.05
    ref = old - 0.1
    x = full.clone().requires_grad_(True)
    out = grpo_loss(x[:, :-1], ids, adv, mask, old, ref if options.get("beta") else None, **options)
    out.loss.backward()
    x64 = full.double().requires_grad_(True)
    r = reference_grpo_loss(x64[:, :-1], ids, adv, mask, old, ref if options.get("beta") else None, **options)
    r.loss.backward()
    tol = TOLERANCES[torch.bfloat16]
    assert_close("loss", out.loss, r.loss.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_close("logp", out.logp, r.logp.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_grad_close(x.grad, x64.grad, torch.bfloat16, upstream_is_one=True, oracle_error=1e-15)


def test_new_completion_length_does_not_recompile():
    for length in (97, 98):  # warm up every kernel once
        full, ids, adv, mask = _problem(2, length, 32000, torch.bfloat16)
        grpo_loss(full[:, :-1].requires_grad_(), ids, adv, mask).loss.backward()
        grpo_loss(full[:, :-1].requires_grad_(), ids, adv, mask, importance_sampling_level="sequence").loss.backward()
    before = _compiled_kernels()
    for length in (100, 257, 1000, 1777):
        full, ids, adv, mask = _problem(3, length, 32000, torch.bfloat16)
        grpo_loss(full[:, :-1].requires_grad_(), ids, adv, mask).loss.backward()
        grpo_loss(full[:, :-1].requires_grad_(), ids, adv, mask, importance_sampling_level="sequence").loss.backward()
    assert _compiled_kernels() == before, "a new completion length or batch size recompiled a kernel"


def test_past_two_to_the_31_elements():
    # 1 x 16400 x 131072 bf16 = 2.15e9 elements (4.3 GB): offsets past 2^31 must not wrap.
    batch, length, vocab = 1, 16400, 131072
    assert batch * length * vocab > 2**31
    full, ids, adv, _ = _problem(batch, length, vocab, torch.bfloat16)
    x = full[:, :-1].detach().requires_grad_(True)
    out = grpo_loss(x, ids, adv, loss_type="dr_grpo", max_completion_length=length)
    out.loss.backward()
    tail = slice(length - 64, length)  # rows whose offsets exceed 2^31; dr_grpo's weights don't couple rows
    r_x = x.detach()[:, tail].double().requires_grad_(True)
    r = reference_grpo_loss(r_x, ids[:, tail], adv, loss_type="dr_grpo", max_completion_length=length)
    r.loss.backward()
    tol = TOLERANCES[torch.bfloat16]
    assert_close("logp", out.logp[:, tail], r.logp.detach(), tol["loss_rtol"], tol["loss_atol"])
    assert_grad_close(x.grad[:, tail], r_x.grad, torch.bfloat16, upstream_is_one=True, oracle_error=1e-15)


def test_a_million_completion_tokens():
    batch, length, vocab = 4, 262144, 16  # B·T = 2^20 rows: no grid dimension is bounded by T
    full, ids, adv, mask = _problem(batch, length, vocab, torch.float32)
    x = full[:, :-1].detach().requires_grad_(True)
    out = grpo_loss(x, ids, adv, mask)
    out.loss.backward()
    ref = grpo_loss(x.detach().cpu().requires_grad_(True), ids.cpu(), adv.cpu(), mask.cpu(), backend="torch")
    torch.testing.assert_close(out.logp.cpu(), ref.logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.cpu(), ref.loss, rtol=1e-5, atol=1e-6)


def test_vocab_shard_kernels_at_real_size():
    """The vocabulary-parallel Triton path without collectives: Qwen's vocabulary cut in two shards, each shard's
    partials from the Triton kernel equal the torch ones, and the merged ℓ/H and the shards' gradients (Triton
    gradient kernel on the merged state) equal the unsharded Triton path's."""
    from grpo_kernels.ops.torch_rows import shard_partials
    from grpo_kernels.vocab_parallel import merge_partials

    full, ids, _, _ = _problem(4, 256, 151936, torch.bfloat16)
    x = full[:, :-1]
    half = 151936 // 2
    shards = [(x[..., :half], 0), (x[..., half:], half)]
    parts = [triton_logits.shard_partials(s, ids, off, 0.9) for s, off in shards]
    for p, (s, off) in zip(parts, shards):
        torch.testing.assert_close(p, shard_partials(s.float(), ids, off, 0.9), rtol=2e-6, atol=0.0)
    logp, entropy, state = merge_partials(torch.stack(parts), 0.9)
    whole_logp, whole_entropy, whole_state = triton_logits.row_stats(x, ids, 0.9)
    torch.testing.assert_close(logp, whole_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, whole_entropy, rtol=1e-5, atol=1e-6)
    g, h = torch.randn_like(logp), torch.randn_like(logp)
    want = torch.empty_like(x)
    triton_logits.row_grad(x, ids, whole_state, g, h, 0.9, want)
    for s, off in shards:
        got = torch.empty_like(s)
        triton_logits.row_grad(s, ids - off, state, g, h, 0.9, got)
        # two bf16 roundings of values that agree to fp32 precision: at most one bf16 ulp (2^-7 relative) apart
        ref = want[..., off : off + s.shape[-1]].float()
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-6 * ref.abs().max().item())
