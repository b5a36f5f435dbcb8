"""top_entropy_quantile = 0.0 through the TRL drop-in, against TRL's own GRPOTrainer: TRL's GRPOConfig documents
[0, 1], and 0.0 trains only on the highest-entropy token(s) (H >= the maximum over the active tokens)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from trl import GRPOTrainer

from grpo_kernels.integrations.trl import FusedGRPOTrainer

from .test_trl_fused_linear import FusedLinearTrainer
from .test_trl_parity import assert_same, loss_grads_metrics, make_inputs, make_trainer, model_dir  # noqa: F401


@pytest.mark.parametrize(
    ("ours", "options"),
    [
        (FusedGRPOTrainer, dict(loss_type="dapo", beta=0.05)),
        (FusedGRPOTrainer, dict(loss_type="grpo", entropy_coef=0.02)),  # the bonus's mean over the kept token
        (FusedLinearTrainer, dict(loss_type="bnpo", importance_sampling_level="sequence")),
    ],
    ids=["logits-dapo-kl", "logits-grpo-entropy-bonus", "fused-linear-bnpo-sequence"],
)
def test_quantile_zero_matches_trl(model_dir, tmp_path, ours, options):  # noqa: F811
    options = dict(options, top_entropy_quantile=0.0)
    trainers = [make_trainer(cls, model_dir, tmp_path, **options) for cls in (GRPOTrainer, ours)]
    for trainer in trainers:
        trainer.model.train()
    batch = make_inputs(trainers[0])
    reference = loss_grads_metrics(trainers[0], batch)
    result = loss_grads_metrics(trainers[1], batch)
    assert_same(reference, result)
    assert float(reference[0]) != 0.0 and max(g.abs().max() for g in reference[1].values()) > 0
