"""Gradient accumulation gives the whole step's gradient: for every loss type, at uneven splits, the gradient
accumulated over the micro-batches is the unsplit batch's; a split into more micro-batches than sequences is
refused by name."""

import pytest
import torch

from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.demo import build_char_tokenizer, build_tiny_model
from grpo_kernels.trainer.dist import World
from grpo_kernels.trainer.loop import accumulate_gradients
from grpo_kernels.trainer.model import micro_batches
from grpo_kernels.trainer.rollout import Rollout

P, T = 3, 6  # prompt and completion tokens


def tiny_rollout(n: int, seed: int = 0) -> Rollout:
    """n sequences of P prompt tokens and T completion tokens, completions of different lengths (so that the
    micro-batches hold different token counts), old and reference log-probs off the current policy."""
    gen = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(4, 20, (n, T), generator=gen)
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    input_ids = torch.cat([torch.randint(4, 20, (n, P), generator=gen), completion_ids], 1)
    attention = torch.cat([torch.ones(n, P, dtype=torch.long), mask.long()], 1)
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention,
        completion_ids=completion_ids,
        completion_mask=mask,
        advantages=torch.randn(n, generator=gen),
        old_logp=-3.0 + 0.3 * torch.randn(n, T, generator=gen),
        ref_logp=-3.0 + 0.3 * torch.randn(n, T, generator=gen),
        metrics={},
        prompts=[],
        texts=[],
        rewards=torch.zeros(n),
        reward_values={},
        all_advantages=torch.zeros(n),
    )


def step_gradient(model, roll: Rollout, cfg: TrainConfig) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, roll, cfg, World())
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: one thread is fastest, and steady on a shared machine
    torch.manual_seed(0)
    model = build_tiny_model(build_char_tokenizer(), hidden=16, layers=1, heads=2).double()
    model.train()
    yield model
    torch.set_num_threads(threads)


# (prompts, G, gradient_accumulation_steps): micro-batches of 5 and 4; of 2, 1, 2, 1 (4 on 6 sequences, not 3)
SPLITS = [(3, 3, 2), (3, 2, 4)]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("prompts, g, steps", SPLITS, ids=lambda v: str(v))
def test_accumulated_gradient_is_the_whole_steps(model, loss_type, prompts, g, steps):
    roll = tiny_rollout(prompts * g)
    base = dict(prompts_per_step=prompts, num_generations=g, max_completion_length=T, loss_type=loss_type, beta=0.04)
    whole = step_gradient(model, roll, TrainConfig.from_flat(base))
    split_cfg = TrainConfig.from_flat(base | {"gradient_accumulation_steps": steps})
    assert len(micro_batches(prompts * g, split_cfg)) == steps
    split = step_gradient(model, roll, split_cfg)
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-12 * whole.abs().max().item())


def test_more_micro_batches_than_sequences_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps must be at most the 6 sequences"):
        TrainConfig.from_flat(dict(prompts_per_step=3, num_generations=2, gradient_accumulation_steps=7))
    cfg = TrainConfig.from_flat(dict(prompts_per_step=3, num_generations=2, gradient_accumulation_steps=6))
    assert [s.stop - s.start for s in micro_batches(6, cfg)] == [1] * 6
