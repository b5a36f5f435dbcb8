"""Vocabulary-parallel loss: P gloo ranks each hold a contiguous vocabulary shard of the logits; the merged loss,
ℓ, H and metrics equal the unsharded oracle's, and each rank's gradient equals the oracle's on its shard."""

import pytest
import torch
import torch.distributed as dist

from grpo_kernels import grpo_loss
from reference import reference_grpo_loss

from .conftest import needs_triton_cpu
from .ranks import rank_results

B, T, V = 2, 4, 37  # 37 splits unevenly over 2 and 4 ranks

OPTIONS = [
    dict(loss_type="dapo", beta=0.1, entropy_coef=0.05),  # KL and the entropy-bonus gradient through merged H
    dict(loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.6),
    dict(loss_type="sapo", temperature=0.8),
    dict(loss_type="cispo", epsilon_high=1.2),
]


def _shards(world: int) -> list[slice]:
    bounds = torch.linspace(0, V, world + 1).round().long().tolist()
    return [slice(bounds[r], bounds[r + 1]) for r in range(world)]


def _inputs():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(B, T, V, generator=gen) * 2
    logits[:, :, -3:] = -torch.inf  # padded vocabulary: the last shard has −inf columns
    ids = torch.randint(0, V - 3, (B, T), generator=gen)
    logits[0, 0, ids[0, 0]] += 25.0  # a peaked row: p_y ≈ 1 - 1e-10, its 1 − p_y must survive the merge
    adv = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    old = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).float() + 0.1
    ref = old - 0.3
    return logits, ids, adv, mask, old, ref


def _rank_main(rank: int, world: int, backend: str) -> list:
    logits, ids, adv, mask, old, ref = _inputs()
    shard = _shards(world)[rank]
    outputs = []
    for options in OPTIONS:
        x = logits[:, :, shard].clone().requires_grad_(True)
        out = grpo_loss(x, ids, adv, mask, old, ref, vocab_parallel_group=dist.group.WORLD, backend=backend, **options)
        out.loss.backward()
        metrics = {k: float(v) for k, v in out.metrics.items()}
        outputs.append((float(out.loss), out.logp, out.entropy, x.grad, metrics))
    return outputs


@pytest.mark.parametrize(
    ("world", "backend"), [(2, "torch"), (4, "torch"), pytest.param(2, "triton", marks=needs_triton_cpu)]
)
def test_vocab_parallel_equals_unsharded_oracle(world, backend):
    # backend="triton": the shard partials kernel and the gradient kernel (interpreted on a CPU)
    per_rank = rank_results(_rank_main, (backend,), world)
    logits, ids, adv, mask, old, ref = _inputs()
    worst = 0.0
    for i, options in enumerate(OPTIONS):
        full = logits.double().requires_grad_(True)
        whole = reference_grpo_loss(full, ids, adv, mask, old, ref, **options)
        whole.loss.backward()
        for r, shard in enumerate(_shards(world)):
            loss, logp, entropy, grad, metrics = per_rank[r][i]
            assert abs(loss - whole.loss.item()) <= 1e-5 * abs(whole.loss.item()) + 1e-6, (options, r)
            torch.testing.assert_close(logp.double(), whole.logp.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(entropy.double(), whole.entropy.detach(), rtol=1e-5, atol=1e-6)
            assert full.grad.abs().max() > 0, "a test whose gradient is all zero proves nothing"
            err = (grad.double() - full.grad[:, :, shard]).abs().max() / full.grad.abs().max()
            assert err <= 1e-5, f"{options}: rank {r}'s shard gradient off by {err:.2e} of the max"
            worst = max(worst, float(err))
            for name, value in metrics.items():
                assert abs(value - whole.metrics[name]) <= 1e-5 * max(1.0, abs(whole.metrics[name])), (name, r)
    print(f"{world} ranks, {backend}: worst shard-gradient error {worst:.1e} of the max")
