"""The fused-linear loss across processes (gloo on CPU), against the float64 oracle on the unsharded logits.

- Vocabulary parallel: each rank holds a contiguous block of the lm_head's rows (and bias); hidden is replicated.
  The loss, ℓ, H and metrics must equal the unsharded oracle's, ∂hidden the full one, and each rank's ∂weight/∂bias
  the oracle's rows of its block. 2x2 adds data parallelism: 4 ranks, each data half of the batch on its own
  2-rank vocabulary group, the data ranks' gradients averaged (as DDP/FSDP average) must be the whole batch's.
- FSDP2: `fully_shard` shards the lm_head weight as a DTensor; the loss reads it after the forward, gathers it and
  reduce-scatters its gradient. Every parameter's gradient (averaged by FSDP over the 2 data ranks) must be the
  whole batch's.
"""

import pytest
import torch
import torch.distributed as dist

from grpo_kernels import fused_linear_grpo_loss
from grpo_kernels.ops import linear_folds_torch, linear_folds_triton
from reference import reference_grpo_loss

from .conftest import needs_triton_cpu
from .ranks import rank_results

B, T, H, V = 4, 3, 8, 37  # 37 rows split unevenly over 2 and 4 ranks

OPTIONS = [
    {"loss_type": "dapo", "beta": 0.1},  # the token count and KL across data ranks
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "top_entropy_quantile": 0.6, "temperature": 0.7},
    {"loss_type": "cispo", "epsilon_high": 1.2},
    {"loss_type": "bnpo", "entropy_coef": 0.05},  # the entropy-bonus gradient through the merged H
]


def _options(data_parts: int) -> list[dict]:
    """The options whose data-parallel average is the whole batch's: bnpo normalizes by the local token count and the
    entropy bonus is a local mean (TRL 1.16 semantics), so with uneven token counts per rank their average is not."""
    if data_parts == 1:
        return OPTIONS
    return [o for o in OPTIONS if o["loss_type"] != "bnpo" and not o.get("entropy_coef")]


def _inputs():
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    bias = torch.randn(V, generator=gen)
    bias[-3:] = -torch.inf  # padded vocabulary: the last rows never win any probability
    ids = torch.randint(0, V - 3, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    adv[1] = 0.0  # with a masked row below, some rows carry no gradient and pass 2 skips them on every shard alike
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    mask[2] = 0.0
    logits = (hidden.double() @ weight.double().T + bias.double()).float()
    old = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).float() + 0.1
    ref = old - 0.3
    return hidden, weight, bias, ids, adv, mask, old, ref


def _blocks(n: int, parts: int) -> list[slice]:
    bounds = torch.linspace(0, n, parts + 1).round().long().tolist()
    return [slice(bounds[r], bounds[r + 1]) for r in range(parts)]


def _oracle(options, rows=slice(None)):
    """float64 loss, ℓ, H, metrics and ∂hidden/∂weight/∂bias of the unsharded lm_head, on batch rows `rows`."""
    hidden, weight, bias, ids, adv, mask, old, ref = _inputs()
    x, w, b = (t.double().requires_grad_(True) for t in (hidden, weight, bias))
    logits = (x[rows] @ w.T + b).requires_grad_(True)
    out = reference_grpo_loss(logits, ids[rows], adv[rows], mask[rows], old[rows], ref[rows], **options)
    out.loss.backward()
    return out, x.grad, w.grad, b.grad


def _small_tiles() -> None:
    # several vocabulary tiles per shard, and rows in more than one block: every loop edge of both passes
    for tiles in (linear_folds_torch.BACKEND, linear_folds_triton.BACKEND):
        tiles.tile_elements, tiles.min_vocab_tile = 64, 8


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary parallel (and vocabulary x data parallel)


def _vocab_rank(rank: int, world: int, data_parts: int, backend: str) -> list:
    _small_tiles()
    vocab_parts = world // data_parts
    # ranks [d·vocab_parts, (d+1)·vocab_parts) share data rank d's sequences and split the vocabulary
    vocab_groups = [dist.new_group(list(range(d * vocab_parts, (d + 1) * vocab_parts))) for d in range(data_parts)]
    data_groups = [dist.new_group(list(range(v, world, vocab_parts))) for v in range(vocab_parts)]
    d, v = divmod(rank, vocab_parts)
    hidden, weight, bias, ids, adv, mask, old, ref = _inputs()
    rows, block = _blocks(B, data_parts)[d], _blocks(V, vocab_parts)[v]
    outputs = []
    for options in _options(data_parts):
        x = hidden[rows].clone().requires_grad_(True)
        w = weight[block].clone().requires_grad_(True)
        b = bias[block].clone().requires_grad_(True)
        out = fused_linear_grpo_loss(
            x,
            w,
            ids[rows],
            adv[rows],
            mask[rows],
            old[rows],
            ref[rows],
            bias=b,
            backend=backend,
            vocab_parallel_group=vocab_groups[d],
            data_parallel_group=data_groups[v] if data_parts > 1 else None,
            **options,
        )
        out.loss.backward()
        metrics = {k: float(m) for k, m in out.metrics.items()}
        outputs.append((out.loss.item(), out.logp, out.entropy, x.grad, w.grad, b.grad, metrics))
    return outputs


@pytest.mark.parametrize(
    ("world", "data_parts", "backend"),
    [(2, 1, "torch"), (4, 1, "torch"), pytest.param(2, 1, "triton", marks=needs_triton_cpu), (4, 2, "torch")],
    ids=["vocab2", "vocab4", "vocab2-triton", "data2xvocab2"],
)
def test_vocab_parallel_fused_linear_equals_unsharded_oracle(world, data_parts, backend):
    per_rank = rank_results(_vocab_rank, (data_parts, backend), world)
    vocab_parts = world // data_parts
    worst = 0.0
    for i, options in enumerate(_options(data_parts)):
        whole, dx, dw, db = _oracle(options)
        assert dw.abs().max() > 0 and dx.abs().max() > 0, "a test whose gradient is all zero proves nothing"
        for rank, results in enumerate(per_rank):
            loss, logp, entropy, gx, _, _, metrics = results[i]
            d, v = divmod(rank, vocab_parts)
            rows, block = _blocks(B, data_parts)[d], _blocks(V, vocab_parts)[v]
            if data_parts == 1:
                assert abs(loss - whole.loss.item()) <= 1e-5 * abs(whole.loss.item()) + 1e-6, (options, rank)
                for name, value in metrics.items():
                    assert abs(value - whole.metrics[name]) <= 1e-5 * max(1.0, abs(whole.metrics[name])), name
            torch.testing.assert_close(logp.double(), whole.logp.detach()[rows], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(entropy.double(), whole.entropy.detach()[rows], rtol=1e-5, atol=1e-6)
            # the data ranks' mean gradient is the whole batch's: rank d's part, over data_parts, is the oracle's
            # ∂hidden of its own sequences; the weight gradients are averaged over the data ranks of this block
            err = (gx.double() / data_parts - dx[rows]).abs().max() / dx.abs().max()
            assert err <= 1e-5, f"{options}: rank {rank}'s ∂hidden off by {err:.2e} of the max"
            worst = max(worst, float(err))
            mean_w = sum(per_rank[e * vocab_parts + v][i][4].double() for e in range(data_parts)) / data_parts
            mean_b = sum(per_rank[e * vocab_parts + v][i][5].double() for e in range(data_parts)) / data_parts
            err = (mean_w - dw[block]).abs().max() / dw.abs().max()
            assert err <= 1e-5, f"{options}: rank {rank}'s ∂weight rows off by {err:.2e} of the max"
            worst = max(worst, float(err))
            assert (mean_b - db[block]).abs().max() <= 1e-5 * db.abs().max(), (options, rank)
    layout = f"{data_parts} data x {vocab_parts} vocab, {backend}"
    print(f"world {world} ({layout}): worst ∂hidden/∂weight error {worst:.1e}")


def test_vocab_parallel_checks_ids_against_the_full_vocabulary_and_the_group():
    per_rank = rank_results(_ids_rank, (), 2)
    assert per_rank[0] == per_rank[1] == "ok"


def _ids_rank(rank: int, world: int) -> str:
    w = torch.randn(5, 4)  # 10 ids over the 2 shards: 7 is valid on every rank, 10 on none
    call = lambda ids, **check: fused_linear_grpo_loss(
        torch.randn(1, 2, 4), w, torch.tensor([ids]), torch.ones(1), vocab_parallel_group=dist.group.WORLD, **check
    )
    assert torch.isfinite(call([7, 0]).loss) and torch.isnan(call([10, 0]).loss)  # off: NaN, no host read
    try:
        call([10, 0], check_inputs=True)
        verdict = "accepted an id outside the full vocabulary"
    except ValueError as err:
        verdict = "ok" if "completion_ids" in str(err) else str(err)
    try:  # with torch.distributed up, a group argument that is not a ProcessGroup is named
        fused_linear_grpo_loss(
            torch.randn(1, 2, 4), w, torch.tensor([[0, 1]]), torch.ones(1), vocab_parallel_group="tp"
        )
        verdict = "accepted a string as vocab_parallel_group"
    except TypeError as err:
        named = "vocab_parallel_group must be a torch.distributed ProcessGroup" in str(err)
        verdict = verdict if named else str(err)
    return verdict


# ----------------------------------------------------------------------------------------------------------------
# FSDP2 (fully_shard): the lm_head weight is a sharded DTensor when the loss reads it


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the final hidden states; the loss applies the head
        return torch.tanh(self.body(x))


def _fsdp_rank(rank: int, world: int, options: dict) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    _small_tiles()
    model = _Policy()
    fully_shard(model.lm_head)
    fully_shard(model)
    hidden, _, _, ids, adv, mask, old, ref = _inputs()
    rows = _blocks(B, world)[rank]
    h = model(hidden[rows])  # through FSDP's forward hooks: the body is gathered, the head is not
    head = model.lm_head
    assert isinstance(head.weight, DTensor), "the test needs the lm_head weight sharded when the loss runs"
    out = fused_linear_grpo_loss(
        h, head.weight, ids[rows], adv[rows], mask[rows], old[rows], ref[rows], bias=head.bias, **options
    )
    out.loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return grads


@pytest.mark.parametrize("options", [OPTIONS[0], {"loss_type": "grpo"}], ids=["dapo-kl", "grpo"])
def test_fsdp2_sharded_lm_head_gives_the_whole_batch_gradient(options):
    per_rank = rank_results(_fsdp_rank, (options,), 2)
    hidden, _, _, ids, adv, mask, old, ref = _inputs()
    model = _Policy().double()
    h = model(hidden.double())
    logits = torch.nn.functional.linear(h, model.lm_head.weight, model.lm_head.bias)
    reference_grpo_loss(logits, ids, adv, mask, old, ref, **options).loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0, name
        for rank, grads in enumerate(per_rank):
            err = (grads[name].double() - p.grad).abs().max() / p.grad.abs().max()
            assert err <= 1e-5, f"rank {rank}: ∂{name} off by {err:.2e} of the max"
            worst = max(worst, float(err))
    print(f"FSDP2 {options}: worst parameter-gradient error {worst:.1e} of the max")


def test_zero3_partitioned_weight_is_refused_by_name():
    weight = torch.nn.Parameter(torch.empty(0))
    weight.ds_id = 3  # what DeepSpeed ZeRO-3 leaves in a module between its forwards
    with pytest.raises(ValueError, match="weight is a DeepSpeed ZeRO-3 partitioned parameter"):
        fused_linear_grpo_loss(torch.randn(1, 2, 4), weight, torch.zeros(1, 2, dtype=torch.long), torch.ones(1))
