"""Data parallel: with DDP's gradient averaging, P gloo ranks reproduce the whole-batch loss gradient exactly.

Each rank holds a shard of the sequences. The defaults that span ranks (the dapo/cispo/vespo token count, the
entropy-mask quantile, the metrics) are reduced across the group, so rank r's ∂logits / P must equal the
single-process ∂logits of the same rows, and the metrics must equal the whole batch's.
"""

import pytest
import torch

from grpo_kernels import grpo_loss
from reference import reference_grpo_loss

from .ranks import rank_results

B_PER_RANK, T, V = 2, 5, 13

# Loss types whose aggregation DDP averaging reproduces (bnpo normalizes by the local token count, as TRL does).
OPTIONS = [
    dict(loss_type="dapo"),  # token count all-reduced
    dict(loss_type="grpo", top_entropy_quantile=0.37),  # quantile over the gathered entropies of all ranks
    dict(loss_type="vespo", beta=0.1),
    dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence"),
    dict(loss_type="dr_grpo", delta=1.2),
]


def _inputs(world: int):
    gen = torch.Generator().manual_seed(world)
    b = B_PER_RANK * world
    logits = torch.randn(b, T, V, generator=gen) * 2
    ids = torch.randint(0, V, (b, T), generator=gen)
    adv = torch.randn(b, generator=gen)
    mask = (torch.rand(b, T, generator=gen) > 0.3).float()
    old = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    old = old + 0.3 * torch.randn(b, T, generator=gen)
    ref = old - 0.2
    return logits, ids, adv, mask, old, ref


def _rank_main(rank: int, world: int) -> list:
    logits, ids, adv, mask, old, ref = _inputs(world)
    rows = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
    outputs = []
    for options in OPTIONS:
        x = logits[rows].clone().requires_grad_(True)
        out = grpo_loss(x, ids[rows], adv[rows], mask[rows], old[rows], ref[rows], backend="torch", **options)
        out.loss.backward()
        outputs.append((x.grad / world, {k: float(v) for k, v in out.metrics.items()}))
    return outputs


@pytest.mark.parametrize("world", [2, 3])  # an even and an odd world size
def test_data_parallel_gradient_equals_whole_batch(world):
    per_rank = rank_results(_rank_main, (), world)
    logits, ids, adv, mask, old, ref = _inputs(world)
    for i, options in enumerate(OPTIONS):
        full = logits.double().requires_grad_(True)
        whole = reference_grpo_loss(full, ids, adv, mask, old, ref, **options)
        whole.loss.backward()
        sharded = torch.cat([per_rank[r][i][0] for r in range(world)])
        err = (sharded.double() - full.grad).abs().max() / full.grad.abs().max()
        assert err < 1e-5, f"{options}: gradient differs by {err:.2e} of its max"
        for name, value in per_rank[0][i][1].items():
            assert all(per_rank[r][i][1][name] == value for r in range(world)), f"{name} differs across ranks"
            assert abs(value - whole.metrics[name]) <= 1e-5 * max(1.0, abs(whole.metrics[name])), (options, name)
