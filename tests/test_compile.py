"""torch.compile(fullgraph=True) of a step containing grpo_loss: one graph, the same loss, metrics and gradient."""

import pytest
import torch

from grpo_kernels import grpo_loss

from .conftest import ON_GPU

# One option set per schedule the compiled path must trace: token-level clipped with KL, the sequence-level GSPO
# ratio with the entropy mask and bonus, vespo's no-grad gamma weights with an IS ratio.
OPTIONS = [
    dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    dict(loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.5, entropy_coef=0.1),
    dict(loss_type="vespo", temperature=0.8),
]


def _step(full, ids, adv, mask, old, ref, ratio, options, backend):
    scaled = full * 1.5  # something for the compiler to fuse around the loss
    out = grpo_loss(
        scaled[:, :-1], ids, adv, mask, old, ref, importance_sampling_ratio=ratio, backend=backend, **options
    )
    return out.loss * 2.0, out.metrics["entropy"], out.logp


def _inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, 50, generator=gen).to(device=device, dtype=dtype)
    ids = torch.randint(0, 50, (3, 6), generator=gen).to(device)
    adv = torch.randn(3, generator=gen).to(device)
    mask = (torch.rand(3, 6, generator=gen) > 0.2).float().to(device)
    old = (torch.randn(3, 6, generator=gen) * 0.1 - 4).to(device)
    ref = (torch.randn(3, 6, generator=gen) * 0.1 - 4).to(device)
    ratio = (0.8 + 0.4 * torch.rand(3, 6, generator=gen)).to(device)
    return full, ids, adv, mask, old, ref, ratio


def _compare(compiler_backend, device, dtype, rows_backend, options):
    full, *rest = _inputs(device, dtype)
    compiled = torch.compile(_step, fullgraph=True, backend=compiler_backend)
    x = full.clone().requires_grad_(True)
    loss, ent, logp = compiled(x, *rest, options, rows_backend)
    loss.backward()
    y = full.clone().requires_grad_(True)
    loss_e, ent_e, logp_e = _step(y, *rest, options, rows_backend)
    loss_e.backward()
    torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent.double(), ent_e.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp, logp_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.float(), y.grad.float(), rtol=1e-4, atol=1e-5 * float(y.grad.abs().max()))


@pytest.mark.parametrize("options", OPTIONS, ids=["dapo-kl", "gspo-entropy", "vespo"])
def test_fullgraph_compile_matches_eager_cpu(options):
    torch._dynamo.reset()
    _compare("aot_eager", "cpu", torch.float32, "torch", options)


def test_bad_option_fails_at_trace_time_with_the_eager_message():
    torch._dynamo.reset()
    full, *rest = _inputs("cpu", torch.float32)
    with pytest.raises(Exception, match="loss_type must be one of"):
        torch.compile(_step, fullgraph=True, backend="aot_eager")(full, *rest, dict(loss_type="ppo"), "torch")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", OPTIONS, ids=["dapo-kl", "gspo-entropy", "vespo"])
def test_fullgraph_inductor_compile_matches_eager_gpu(options):
    torch._dynamo.reset()
    _compare("inductor", "cuda", torch.bfloat16, "triton", options)
