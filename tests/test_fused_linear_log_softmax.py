"""fused_linear_log_softmax against the float64 oracle on logits = (hidden @ weight.T + bias) / τ: ℓ and H, and the
gradients of hidden, weight and bias under random upstream gradients on ℓ and H together, for the torch tiles and
the Triton folds (interpreted without a GPU); tied weights; no (B·T, V) tensor; 2 vocabulary-parallel gloo ranks and
an FSDP2-sharded head (and, in the same processes, grpo_loss(reduction="none") on vocabulary-sharded logits)."""

import pytest
import torch
import torch.distributed as dist

from grpo_kernels import fused_linear_log_softmax, grpo_loss
from grpo_kernels.ops import linear_folds_torch, linear_folds_triton
from reference import reference_grpo_loss, reference_selective_log_softmax

from .conftest import needs_triton_cpu
from .ranks import rank_results
from .test_fused_linear import assert_never_materializes_the_logits

pytestmark = pytest.mark.usefixtures("nan_empty")

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton_cpu)]  # CPU tensors: Triton under its interpreter
B, T, H, V = 3, 4, 37, 300  # V = 300: vocabulary tiles of 128, 128 and a ragged 44
TAU = 0.7


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    for tiles in (linear_folds_torch.BACKEND, linear_folds_triton.BACKEND):
        monkeypatch.setattr(tiles, "tile_elements", 1280)  # 12 rows in blocks of 10 and 2
        monkeypatch.setattr(tiles, "min_vocab_tile", 128)


def make_inputs(seed=0, dtype=torch.float32, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T + 2, H, generator=gen).to(dtype)  # the layer reads the strided view [:, 1:T+1]
    weight = (torch.randn(V, H, generator=gen) * 3 / H**0.5).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype) if bias else None
    if b is not None:
        b[-5:] = -torch.inf  # padded vocabulary rows
    ids = torch.randint(0, V - 5, (B, T), generator=gen)
    upstream = torch.randn(2, B, T, generator=gen, dtype=torch.float64)
    upstream[:, 1, 2] = 0.0  # a row with no gradient at all: pass 2 skips it
    return hidden, weight, b, ids, upstream


def oracle(hidden, weight, bias, ids, upstream, use=(True, True)):
    x, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    b = None if bias is None else bias.double().requires_grad_(True)
    logits = x[:, 1 : T + 1] @ w.T + (0.0 if b is None else b)
    logp, entropy = reference_selective_log_softmax(logits, ids, TAU)
    objective = (logp * upstream[0]).sum() * use[0] + (entropy * upstream[1]).sum() * use[1]
    grads = torch.autograd.grad(objective, [t for t in (x, w, b) if t is not None])
    return logp.detach(), entropy.detach(), grads


def ours(hidden, weight, bias, ids, upstream, backend, use=(True, True)):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + (() if bias is None else (bias,))]
    x, w = leaves[:2]
    b = leaves[2] if bias is not None else None
    logp, entropy = fused_linear_log_softmax(x[:, 1 : T + 1], w, ids, temperature=TAU, bias=b, backend=backend)
    outputs = [o for o, u in zip((logp, entropy), use) if u]
    grad_outputs = [g.to(o.dtype) for g, u, o in zip(upstream, use, (logp, entropy)) if u]
    torch.autograd.backward(outputs, grad_outputs)
    return logp, entropy, [t.grad for t in leaves]


def assert_matches(got, want, rtol=1e-5):
    logp, entropy, grads = got
    ref_logp, ref_entropy, ref_grads = want
    torch.testing.assert_close(logp.double(), ref_logp, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=rtol, atol=1e-6)
    assert len(grads) == len(ref_grads)
    for ours_grad, exact in zip(grads, ref_grads):
        assert exact.abs().max() > 0, "a test whose gradient is all zero proves nothing"
        err = (ours_grad.double() - exact).abs().max()
        assert err <= rtol * exact.abs().max(), f"gradient off by {err:.3e} (max {exact.abs().max():.3e})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_random_upstream_on_logp_and_entropy(backend, bias):
    inputs = make_inputs(seed=int(bias), bias=bias)
    assert_matches(ours(*inputs, backend), oracle(*inputs))


@pytest.mark.parametrize("use", [(True, False), (False, True)], ids=["logp-only", "entropy-only"])
def test_one_output_used(use):
    inputs = make_inputs(seed=2)
    assert_matches(ours(*inputs, "torch", use=use), oracle(*inputs, use=use))


def test_float64_is_computed_in_float64():
    inputs = make_inputs(seed=3, dtype=torch.float64)
    got = ours(*inputs, "torch")
    assert got[0].dtype == got[1].dtype == torch.float64
    assert_matches(got, oracle(*inputs), rtol=1e-12)


def test_tied_embeddings_accumulate_both_uses():
    gen = torch.Generator().manual_seed(4)
    emb = torch.nn.Embedding(V, H)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    u, v = torch.randn(2, B, T, generator=gen)
    grads = []
    for fused in (True, False):
        emb.zero_grad()
        hidden = torch.tanh(emb(tokens) if fused else emb(tokens).double())
        if fused:
            logp, entropy = fused_linear_log_softmax(hidden, emb.weight, ids, backend="torch")
        else:
            logp, entropy = reference_selective_log_softmax(hidden @ emb.weight.double().T, ids)
        ((logp * u).sum() + (entropy * v).sum()).backward()
        grads.append(emb.weight.grad.clone())
    assert (grads[0].double() - grads[1]).abs().max() <= 1e-5 * grads[1].abs().max()


def test_never_materializes_the_logits(monkeypatch):
    def step(hidden, weight, ids):
        logp, entropy = fused_linear_log_softmax(hidden, weight, ids, backend="torch")
        (logp.sum() - 0.1 * entropy.sum()).backward()

    assert_never_materializes_the_logits(monkeypatch, step)


@pytest.mark.parametrize(
    ("changes", "error", "fragment"),
    [
        ({"weight": torch.randn(V, H + 1)}, ValueError, "weight must have shape"),
        ({"weight": torch.randn(V, H, dtype=torch.float64)}, TypeError, "weight and hidden must have the same dtype"),
        ({"ids": torch.full((B, T), V), "check_inputs": True}, ValueError, "completion_ids must lie in"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"bias": torch.randn(V + 1)}, ValueError, "bias must have shape"),
    ],
)
def test_bad_input_names_the_argument(changes, error, fragment):
    args = {"hidden": torch.randn(B, T, H), "weight": torch.randn(V, H), "ids": torch.zeros(B, T, dtype=torch.long)}
    args.update(changes)
    with pytest.raises(error, match=fragment):
        fused_linear_log_softmax(args.pop("hidden"), args.pop("weight"), args.pop("ids"), **args)


# ----------------------------------------------------------------------------------------------------------------
# 2 gloo ranks: the vocabulary-parallel form (each rank holds a block of the head's rows) and an FSDP2-sharded head


def _rank(rank: int, world: int) -> tuple:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    for tiles in (linear_folds_torch.BACKEND, linear_folds_triton.BACKEND):
        tiles.tile_elements, tiles.min_vocab_tile = 64, 8  # several tiles per shard
    hidden, weight, bias, ids, upstream = make_inputs(seed=5)
    block = slice(0, 161) if rank == 0 else slice(161, V)  # uneven shards; the padded rows all on rank 1
    x = hidden.clone().requires_grad_(True)
    w, b = weight[block].clone().requires_grad_(True), bias[block].clone().requires_grad_(True)
    logp, entropy = fused_linear_log_softmax(
        x[:, 1 : T + 1], w, ids, temperature=TAU, bias=b, vocab_parallel_group=dist.group.WORLD
    )
    torch.autograd.backward([logp, entropy], [upstream[0].float(), upstream[1].float()])
    sharded = (logp, entropy, x.grad, w.grad, b.grad)

    # the per-token GRPO loss on this rank's logits shard (grpo_loss's vocabulary-parallel form)
    shard = (hidden[:, 1 : T + 1] @ weight[block].T + bias[block]).requires_grad_(True)
    out = grpo_loss(shard, ids, upstream[0, :, 0].float(), reduction="none", vocab_parallel_group=dist.group.WORLD,
                    beta=0.1, ref_logp=logp.detach() - 0.2, top_entropy_quantile=0.5, temperature=TAU)  # fmt: skip
    (out.loss * upstream[1].float()).sum().backward()
    per_token = (out.loss, shard.grad)

    head = torch.nn.Linear(H, V)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    fully_shard(head)
    assert isinstance(head.weight, DTensor)
    x = hidden.clone().requires_grad_(True)
    logp, entropy = fused_linear_log_softmax(x[:, 1 : T + 1], head.weight, ids, temperature=TAU, bias=head.bias)
    # each data rank's share of the mean: FSDP averages the two ranks' gradients
    torch.autograd.backward([logp, entropy], [upstream[0].float(), upstream[1].float()])
    fsdp = (x.grad, head.weight.grad.full_tensor(), head.bias.grad.full_tensor())
    return sharded, fsdp, per_token


def test_vocab_parallel_and_fsdp2_equal_the_unsharded_oracle():
    per_rank = rank_results(_rank, (), 2)
    hidden, weight, bias, ids, upstream = make_inputs(seed=5)
    ref_logp, ref_entropy, (dx, dw, db) = oracle(hidden, weight, bias, ids, upstream)
    logits = (hidden[:, 1 : T + 1].double() @ weight.double().T + bias.double()).requires_grad_(True)
    ref = reference_grpo_loss(logits, ids, upstream[0, :, 0].float(), beta=0.1, ref_logp=ref_logp.float() - 0.2,
                              top_entropy_quantile=0.5, temperature=TAU)  # fmt: skip
    (ref.per_token_loss * upstream[1].float().double()).sum().backward()
    for rank, (sharded, fsdp, (loss, grad)) in enumerate(per_rank):
        block = slice(0, 161) if rank == 0 else slice(161, V)
        logp, entropy, gx, gw, gb = sharded
        assert_matches((logp, entropy, [gx, gw, gb]), (ref_logp, ref_entropy, (dx, dw[block], db[block])))
        fx, fw, fb = fsdp
        assert_matches((logp, entropy, [fx, fw, fb]), (ref_logp, ref_entropy, (dx, dw, db)))
        torch.testing.assert_close(loss.double(), ref.per_token_loss.detach(), rtol=1e-5, atol=1e-6)
        assert (grad.double() - logits.grad[..., block]).abs().max() <= 1e-5 * logits.grad.abs().max()
