"""FusedGRPOTrainer(use_fused_linear=True) on an FSDP2-sharded model (fully_shard per decoder layer, on the lm_head and
on the root, as accelerate's FSDP2 plugin wraps it), 2 gloo processes on CPU: the lm_head weight the loss reads after
the forward is a sharded DTensor; the loss gathers it and its gradient comes back reduce-scattered. The loss must
equal TRL's GRPOTrainer on the unsharded model, and every parameter's gradient (full_tensor) the ranks' average of
TRL's unsharded gradients, which is what FSDP's averaging makes of them.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("trl")

from . import run_ranks, save_tiny_model

WORLD = 2
CASES = [{"loss_type": "dapo", "beta": 0.05}, {"loss_type": "grpo", "top_entropy_quantile": 0.5}]


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)


def _loss_and_grads(trainer, batch):
    from torch.distributed.tensor import DTensor

    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g
    return loss.detach(), {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _check_rank(rank: int, model_dir: str, out: str) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from trl import GRPOTrainer

    from grpo_kernels.integrations.trl import FusedGRPOTrainer

    from .test_trl_parity import make_inputs, make_trainer

    verdicts = []
    for options in CASES:
        classes = (GRPOTrainer, functools.partial(FusedGRPOTrainer, use_fused_linear=True))
        trainers = [make_trainer(cls, model_dir, out, **options) for cls in classes]
        batch = make_inputs(trainers[0], seed=rank)  # before sharding: TRL's own log-probs, each rank its own
        for trainer in trainers[1:]:
            _shard(trainer.model)
        for trainer in trainers:
            trainer.model.train()
        # The expected gradient: TRL on the unsharded model, averaged over the ranks as FSDP averages
        ref_loss, ref_grads = _loss_and_grads(trainers[0], batch)
        for g in ref_grads.values():
            dist.all_reduce(g)
            g /= WORLD
        assert isinstance(trainers[1].model.lm_head.weight, DTensor), "the head must be sharded when read"
        loss, grads = _loss_and_grads(trainers[1], batch)
        try:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
            assert grads.keys() == ref_grads.keys()
            worst = 0.0
            for name, ref in ref_grads.items():
                err = (grads[name] - ref).abs().max().item() / ref.abs().max().item()
                assert err <= 1e-4, f"grad of {name}: max error {err:.3g} of the max"
                worst = max(worst, err)
            verdicts.append("ok")
            print(f"rank {rank} {options}: worst gradient error {worst:.1e} of the max")
        except AssertionError as err:
            verdicts.append(f"{options}: {err}")
    return verdicts


@pytest.mark.slow
def test_fused_linear_on_an_fsdp2_sharded_model_matches_trl(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_fsdp"))
    for rank, per_case in enumerate(run_ranks(_check_rank, model_dir, WORLD)):
        assert per_case == ["ok"] * len(CASES), f"rank {rank}: {per_case}"
