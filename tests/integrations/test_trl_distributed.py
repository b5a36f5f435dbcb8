"""FusedGRPOTrainer against TRL's GRPOTrainer under 2 data-parallel processes (gloo on CPU, set up by accelerate as
`accelerate launch` would): what TRL reduces across processes (the entropy-mask quantile over every rank's
entropies, the dapo/cispo/vespo token count over the world size, the gathered metrics) must come out the same.

Each rank builds TRL's trainer and ours (in the logits mode and with use_fused_linear=True) on the same tiny model,
crafts its own micro-batch (a different one per rank), and compares one compute_loss + backward exactly as
tests/integrations/test_trl_parity.py does in one process.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

from . import run_ranks, save_tiny_model

WORLD = 2
CASES = [
    {"loss_type": "dapo", "beta": 0.05},  # num_items_in_batch / world size
    {"loss_type": "grpo", "top_entropy_quantile": 0.5},  # the quantile over the gathered entropies
    {"loss_type": "cispo", "importance_sampling_level": "sequence"},
    {"loss_type": "vespo", "entropy_coef": 0.02},
]


def _check_rank(rank: int, model_dir: str, out: str) -> list[str]:
    import torch.distributed as dist
    from trl import GRPOTrainer

    from grpo_kernels.integrations.trl import FusedGRPOTrainer

    from .test_trl_parity import assert_same, loss_grads_metrics, make_inputs, make_trainer

    verdicts = []
    for options in CASES:
        # the first-step self-check on too: TRL's own loss beside ours, its gathers and reductions over both ranks
        fused = functools.partial(FusedGRPOTrainer, verify_first_step=True)
        classes = (GRPOTrainer, fused, functools.partial(fused, use_fused_linear=True))
        trainers = [make_trainer(cls, model_dir, out, **options) for cls in classes]
        assert dist.is_initialized() and dist.get_world_size() == WORLD, "the trainers did not go distributed"
        for trainer in trainers:
            trainer.model.train()
        batch = make_inputs(trainers[0], seed=rank)  # each rank its own micro-batch
        reference = loss_grads_metrics(trainers[0], batch)
        for mode, trainer in zip(("logits", "fused-linear"), trainers[1:]):
            try:
                assert_same(reference, loss_grads_metrics(trainer, batch))
                assert trainer.first_step_report is not None and not trainer.first_step_report.problems
                verdicts.append("ok")
            except AssertionError as err:
                verdicts.append(f"{mode} {options}: {err}")
    return verdicts


@pytest.mark.slow
def test_two_processes_match_trl(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_dp"))
    for rank, per_case in enumerate(run_ranks(_check_rank, model_dir, WORLD)):
        assert per_case == ["ok"] * (2 * len(CASES)), f"rank {rank}: {per_case}"
