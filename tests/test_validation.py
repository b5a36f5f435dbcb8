"""Bad input gets a clear error naming the argument, never a crash or a silent wrong number."""

import pytest
import torch

from grpo_kernels import GRPOLoss, LossConfig, fused_linear_grpo_loss, grpo_loss, group_advantages, selective_log_softmax

B, T, V = 2, 3, 5


def good():
    return dict(
        logits=torch.randn(B, T, V),
        completion_ids=torch.randint(0, V, (B, T)),
        advantages=torch.randn(B),
    )


def call(**changes):
    kwargs = good()
    kwargs.update(changes)
    return grpo_loss(backend="torch", **kwargs)


# Each case: the change to a valid call, the error type, and a fragment the message must contain.
CASES = [
    (dict(logits=torch.randn(B, T)), ValueError, "logits must be 3-D"),
    (dict(logits=torch.randint(0, 3, (B, T, V))), TypeError, "logits must be float32"),
    (dict(logits=torch.randn(B, T, V).to(torch.float8_e4m3fn)), TypeError, "logits must be float32"),
    (dict(logits=torch.randn(B, V, T).transpose(1, 2)), ValueError, "unit stride"),
    (dict(logits=torch.randn(0, T, V)), ValueError, "B, T, V >= 1"),
    (dict(completion_ids=torch.randint(0, V, (B, T)).float()), TypeError, "completion_ids must be int32/int64"),
    (dict(completion_ids=torch.full((B, T), V)), ValueError, "completion_ids must lie in [0, 5)"),
    (dict(completion_ids=torch.full((B, T), -1)), ValueError, "completion_ids must lie in"),
    (dict(completion_ids=torch.zeros(B, T + 1, dtype=torch.long)), ValueError, "completion_ids must have shape"),
    (dict(advantages=torch.randn(B, T, 1)), ValueError, "advantages must have shape"),
    (dict(advantages=torch.ones(B, dtype=torch.long)), TypeError, "advantages must be a floating-point"),
    (dict(advantages=[1.0, 2.0]), TypeError, "advantages must be a torch.Tensor"),
    (dict(completion_mask=torch.ones(B, T + 1)), ValueError, "completion_mask must have shape"),
    (dict(old_logp=torch.zeros(B)), ValueError, "old_logp must have shape"),
    (dict(ref_logp=torch.zeros(B, T, dtype=torch.int32)), TypeError, "ref_logp must be a floating-point"),
    (dict(beta=0.1), ValueError, "ref_logp is required when beta != 0"),
    (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
    (dict(importance_sampling_level="tok"), ValueError, "importance_sampling_level must be one of"),
    (dict(top_entropy_quantile=-0.1), ValueError, "top_entropy_quantile must be in [0, 1]"),
    (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile must be in [0, 1]"),
    (dict(epsilon_low=-0.1), ValueError, "epsilon_low and epsilon_high must be >= 0"),
    (dict(importance_sampling_ratio=torch.ones(B, 2)), ValueError, "importance_sampling_ratio must have shape"),
    (dict(max_completion_length=0), ValueError, "max_completion_length must be > 0"),
    (dict(epsilon=0.2), TypeError, "unknown option(s) ['epsilon']"),
    (dict(inplace_backward=1), TypeError, "inplace_backward must be a bool"),
    (dict(config={"loss_type": "dapo"}), TypeError, "config must be a LossConfig or None, got dict"),
    (dict(config=LossConfig(), beta="0.1"), TypeError, "beta must be a real number"),  # options over a config
]


@pytest.mark.parametrize("changes,error,fragment", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_names_the_argument(changes, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        call(**changes)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        grpo_loss(**good(), backend="cuda")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        grpo_loss(**good(), backend="triton")


def test_inplace_on_a_leaf_is_refused():
    kwargs = good()
    kwargs["logits"].requires_grad_(True)
    with pytest.raises(ValueError, match="inplace_backward=True would overwrite a leaf"):
        grpo_loss(**kwargs, inplace_backward=True, backend="torch")


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        GRPOLoss(loss_type="nope")
    with pytest.raises(TypeError, match=r"GRPOLoss got unknown option\(s\) \['betta'\]"):
        GRPOLoss(betta=0.1)


def test_config_and_options_are_one_validated_config():
    """`config=` is the same call as its options spelled out; options given beside it override its fields."""
    kwargs = good()
    kwargs["ref_logp"] = torch.randn(B, T)
    options = dict(loss_type="dapo", beta=0.04, temperature=0.7, epsilon_high=0.28)
    spelled = grpo_loss(**kwargs, backend="torch", **options)
    held = grpo_loss(**kwargs, backend="torch", config=LossConfig(**options))
    assert torch.equal(spelled.loss, held.loss) and spelled.metrics.keys() == held.metrics.keys()
    override = grpo_loss(**kwargs, backend="torch", config=LossConfig(**options), temperature=1.3)
    assert torch.equal(override.loss, grpo_loss(**kwargs, backend="torch", **{**options, "temperature": 1.3}).loss)
    assert not torch.equal(override.loss, held.loss)
    module = GRPOLoss(config=LossConfig(**options), backend="torch")
    assert module.config == LossConfig(**options) and "loss_type='dapo'" in repr(module)
    assert torch.equal(module(**kwargs).loss, spelled.loss)


def test_fused_linear_options_are_checked_once_by_name():
    ids, adv = torch.zeros(1, 2, dtype=torch.long), torch.ones(1)
    with pytest.raises(TypeError, match=r"fused_linear_grpo_loss got unknown option\(s\) \['epsilon'\]"):
        fused_linear_grpo_loss(torch.randn(1, 2, 4), torch.randn(3, 4), ids, adv, epsilon=0.2)
    with pytest.raises(TypeError, match="config must be a LossConfig"):
        fused_linear_grpo_loss(torch.randn(1, 2, 4), torch.randn(3, 4), ids, adv, config="grpo")


def test_selective_log_softmax_validates():
    with pytest.raises(ValueError, match="completion_ids must lie in"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.tensor([[0, 1]]), temperature=-1.0)


def test_second_backward_is_an_error_not_a_wrong_number():
    x = torch.randn(B, T + 1, V, requires_grad=True)
    out = grpo_loss(x[:, :-1], torch.randint(0, V, (B, T)), torch.randn(B), backend="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called a second time"):
        out.loss.backward()


@pytest.mark.parametrize(
    "rewards,kwargs,fragment",
    [
        (torch.ones(6), dict(num_generations=4), "num_generations must be a positive divisor"),
        (torch.ones(2, 3, 1), {}, "rewards must be"),
        (torch.tensor([1.0, float("nan")]), dict(num_generations=2), "rewards must be finite"),
        (torch.ones(4), dict(num_generations=2, scale="std"), "scale must be one of"),
    ],
)
def test_group_advantages_validates(rewards, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        group_advantages(rewards, **kwargs)


@pytest.mark.parametrize("loss_fn", ["grpo_loss", "fused_linear_grpo_loss"])
@pytest.mark.parametrize("name", ["vocab_parallel_group", "data_parallel_group"])
def test_process_group_arguments_are_checked_by_name(loss_fn, name):
    from grpo_kernels import fused_linear_grpo_loss

    ids, adv = torch.zeros(1, 2, dtype=torch.long), torch.ones(1)
    if loss_fn == "grpo_loss":
        call = lambda group: grpo_loss(torch.randn(1, 2, 3), ids, adv, **{name: group})
    else:
        call = lambda group: fused_linear_grpo_loss(torch.randn(1, 2, 4), torch.randn(3, 4), ids, adv, **{name: group})
    # this test process has no process group: a group argument cannot be honoured, and must not be ignored
    with pytest.raises(ValueError, match=f"{name} was given but torch.distributed is not initialized"):
        call(object())
