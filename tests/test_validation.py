"""Bad input gets a clear error naming the argument, never a crash or a silent wrong number."""

import re
from pathlib import Path

import pytest
import torch

from grpo_kernels import (
    GRPOLoss,
    LossConfig,
    fused_linear_grpo_loss,
    fused_linear_log_softmax,
    group_advantages,
    grpo_loss,
    selective_log_softmax,
)

from .conftest import HAS_TRITON_DEVICE

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
    (dict(completion_ids=torch.zeros(B, T + 1, dtype=torch.long)), ValueError, "completion_ids must have shape"),
    # a model's logits not shifted (T + 1 positions for T ids): named as the logits' fault, with the slice to take
    (
        dict(completion_ids=torch.zeros(B, T - 1, dtype=torch.long)),
        ValueError,
        (
            f"logits have one position more than completion_ids (logits {T} positions, completion_ids {T - 1}): "
            "logits[:, t] must score completion_ids[:, t] (already shifted); pass logits[:, :-1]"
        ),
    ),
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
    (dict(epsilon_lo=0.2), TypeError, "unknown option(s) ['epsilon_lo']"),
    (dict(epsilon=0.2, epsilon_low=0.1), TypeError, "both epsilon (TRL's name) and epsilon_low"),
    (dict(inplace_backward=1), TypeError, "inplace_backward must be a bool"),
    (dict(config={"loss_type": "dapo"}), TypeError, "config must be a LossConfig or None, got dict"),
    (dict(config=LossConfig(), beta="0.1"), TypeError, "beta must be a real number"),  # options over a config
    # Meaning, not only shape (of the options; the tensors' values: VALUE_CASES below):
    (dict(delta=0.9), ValueError, "delta must be > 1"),
    (dict(delta=1.0), ValueError, "delta must be > 1"),
    (dict(beta=-0.01, ref_logp=torch.zeros(B, T)), ValueError, "beta must be >= 0"),
    (dict(loss_type="vespo", vespo_k_pos=-1.0), ValueError, "vespo_k_pos must be >= 0"),
    (dict(loss_type="vespo", vespo_k_neg=-0.5), ValueError, "vespo_k_neg must be >= 0"),
    (dict(loss_type="vespo", vespo_lambda_pos=0.0), ValueError, "vespo_lambda_pos must be > 0"),
    (dict(loss_type="vespo", vespo_lambda_neg=-2.0), ValueError, "vespo_lambda_neg must be > 0"),
    (dict(off_policy_mask_threshold=-0.1), ValueError, "off_policy_mask_threshold must be >= 0"),
    (dict(temperature=1e-39), ValueError, "1/temperature is finite in float32"),
    (dict(check_inputs=1), TypeError, "check_inputs must be a bool"),
]


@pytest.mark.parametrize("changes,error,fragment", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_names_the_argument(changes, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call(**changes)


# The tensors' values are on the device: check_inputs=True reads the checks' findings back (one host sync) and
# raises naming the argument; off (the default), nothing is read back and the call's results are NaN instead.
VALUE_CASES = [
    ({"completion_ids": torch.full((B, T), V)}, "completion_ids must lie in [0, 5) (the logits' vocabulary), got"),
    ({"completion_ids": torch.full((B, T), -1)}, "completion_ids must lie in"),
    ({"completion_mask": torch.full((B, T), -1.0)}, "completion_mask must hold only 0 and 1"),
    ({"completion_mask": torch.full((B, T), 2, dtype=torch.long)}, "got 2.0 at position (0, 0)"),
    ({"completion_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.5, 0.0]])}, "got 0.5 at position (1, 1)"),
    ({"completion_mask": torch.tensor([[1.0, float("nan"), 1.0]] * B)}, "completion_mask must hold only"),
    ({"importance_sampling_ratio": torch.tensor([1.0, -0.5])}, "importance_sampling_ratio must be >= 0, got -0.5 at"),
]


@pytest.mark.parametrize("changes,fragment", VALUE_CASES, ids=[c[1][:40] for c in VALUE_CASES])
def test_bad_values_name_the_argument_with_check_inputs(changes, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call(**changes, check_inputs=True)
    kwargs = {**good(), **changes}
    x = kwargs.pop("logits").requires_grad_(True)
    out = grpo_loss(x, **kwargs, backend="torch")  # off: NaN, not a wrong number
    out.loss.backward()
    assert out.loss.isnan() and x.grad.isnan().all() and all(m.isnan() for m in out.metrics.values())


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
    with pytest.raises(TypeError, match=r"fused_linear_grpo_loss got unknown option\(s\) \['eps'\]"):
        fused_linear_grpo_loss(torch.randn(1, 2, 4), torch.randn(3, 4), ids, adv, eps=0.2)
    with pytest.raises(TypeError, match="config must be a LossConfig"):
        fused_linear_grpo_loss(torch.randn(1, 2, 4), torch.randn(3, 4), ids, adv, config="grpo")


def test_selective_log_softmax_validates():
    with pytest.raises(ValueError, match="completion_ids must lie in"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.tensor([[0, 3]]), check_inputs=True)
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.tensor([[0, 1]]), check_inputs="yes")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.tensor([[0, 1]]), temperature=-1.0)


def test_second_backward_is_an_error_not_a_wrong_number():
    x = torch.randn(B, T + 1, V, requires_grad=True)
    out = grpo_loss(x[:, :-1], torch.randint(0, V, (B, T)), torch.randn(B), backend="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called a second time"):
        out.loss.backward()


@pytest.mark.parametrize(
    "rewards,kwargs,error,fragment",
    [
        (torch.ones(6), dict(num_generations=4), ValueError, "num_generations must be a positive divisor"),
        (torch.ones(2, 3, 1), {}, ValueError, "rewards must be"),
        (torch.tensor([1.0, float("nan")]), dict(num_generations=2), ValueError, "rewards must be finite"),
        (torch.ones(4), dict(num_generations=2, scale="std"), ValueError, "scale must be one of"),
        (torch.ones(4), dict(num_generations=2, eps=0.0), ValueError, "eps must be finite and > 0"),
        (torch.ones(4), dict(num_generations=2, eps=-1e-4), ValueError, "eps must be finite and > 0"),
        (torch.ones(4), dict(num_generations=2, eps=float("inf")), ValueError, "eps must be finite and > 0"),
        (torch.ones(4), dict(num_generations=2, eps="1e-4"), TypeError, "eps must be a real number"),
        (torch.ones(4), dict(num_generations=True), TypeError, "num_generations must be an int or None, got bool"),
        (torch.ones(4), dict(num_generations=2.0), TypeError, "num_generations must be an int or None, got float"),
        (torch.ones(2, 2), dict(num_generations=2.0), TypeError, "num_generations must be an int"),
    ],
)
def test_group_advantages_validates(rewards, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        group_advantages(rewards, **kwargs)


def test_masks_of_every_dtype_are_accepted_when_zero_one():
    kwargs = good()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    dtypes = (torch.bool, torch.int32, torch.int64, torch.float32)
    losses = [grpo_loss(**kwargs, completion_mask=mask.to(dtype), backend="torch").loss for dtype in dtypes]
    assert all(torch.equal(x, losses[0]) for x in losses)
    assert torch.isfinite(call(importance_sampling_ratio=torch.tensor([0.0, 2.0])).loss)  # ρ = 0 is allowed
    assert torch.isfinite(call(temperature=1e-30).loss)  # 1/τ = 1e30 is finite in fp32


# check_inputs: non-finite values at unmasked tokens are named with their first position; masked ones are absent.
NAN, INF = float("nan"), float("inf")


def _with(x: torch.Tensor, where: tuple, value: float) -> torch.Tensor:
    x = x.clone()
    x[where] = value
    return x


def test_check_inputs_names_the_argument_and_the_first_position():
    kwargs = good()
    logits = kwargs.pop("logits")
    ids, adv = kwargs["completion_ids"], kwargs["advantages"]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    bad = [
        (
            dict(old_logp=_with(torch.zeros(B, T), (1, 2), NAN)),
            r"old_logp must be finite at unmasked tokens, got nan at position \(1, 2\)",
        ),
        (
            dict(old_logp=_with(_with(torch.zeros(B, T), (1, 0), -INF), (1, 2), NAN)),
            r"old_logp .* got -inf at position \(1, 0\)",
        ),
        (
            dict(ref_logp=_with(torch.zeros(B, T), (0, 1), INF), beta=0.1),
            r"ref_logp must be finite .* got inf at position \(0, 1\)",
        ),
        (dict(advantages=_with(adv, (1,), NAN)), r"advantages must be finite .* position \(1, 0\)"),
        (
            dict(importance_sampling_ratio=_with(torch.ones(B, T), (0, 0), INF)),
            "importance_sampling_ratio must be finite",
        ),
        (
            dict(logits=_with(logits, (1, 1, 3), NAN)),
            r"logits must be finite at unmasked tokens, got nan at position \(1, 1, 3\)",
        ),
        (dict(logits=_with(logits, (0, 1, 2), INF)), r"got inf at position \(0, 1, 2\)"),
        (dict(logits=_with(logits, (0, 0), -INF)), r"a row of only −inf at \(0, 0\)"),
    ]
    for changes, fragment in bad:
        args = {**dict(logits=logits, completion_ids=ids, advantages=adv, completion_mask=mask), **changes}
        with pytest.raises(ValueError, match=fragment):
            grpo_loss(**args, check_inputs=True, backend="torch")
        # off (the default): no error, a NaN or inf loss as before
        assert not torch.isfinite(grpo_loss(**args, backend="torch").loss) or "ref_logp" in changes


def test_check_inputs_ignores_masked_tokens_and_padded_vocabulary():
    kwargs = good()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logits = kwargs["logits"].clone()
    logits[0, 2] = NAN  # a masked row
    logits[..., -1] = -INF  # a padded vocabulary column
    kwargs["completion_ids"] = kwargs["completion_ids"].clamp(max=V - 2)
    old = _with(torch.zeros(B, T), (0, 2), -1e4)
    ref = _with(torch.zeros(B, T), (0, 2), INF)
    rho = _with(torch.ones(B, T), (0, 2), NAN)
    out = grpo_loss(
        **{**kwargs, "logits": logits}, completion_mask=mask, old_logp=old, ref_logp=ref, beta=0.1,
        importance_sampling_ratio=rho, sampling_logp=torch.full((B, T), NAN), check_inputs=True, backend="torch",
    )  # fmt: skip
    assert torch.isfinite(out.loss)


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


class _IdsSpy:
    """A row or tile backend that records the range of every ids tensor it is handed, then runs the real one."""

    def __init__(self, rows, seen: list[tuple[int, int]]):
        self.rows, self.seen = rows, seen
        if getattr(rows, "fused_token_grad", None) is None:
            self.fused_token_grad = None

    def __getattr__(self, name):
        real = getattr(self.rows, name)

        def spied(*args, **kwargs):
            tensors = [getattr(a, "ids", a) for a in args]  # a tile backend takes the ids in its LinearInputs
            ids = next(a for a in tensors if isinstance(a, torch.Tensor) and not a.is_floating_point())
            self.seen.append((int(ids.min()), int(ids.max())))
            return real(*args, **kwargs)

        return spied


TRITON = pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="no Triton"))


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_out_of_range_ids_never_reach_a_kernel_and_give_nan(backend, monkeypatch):
    """check_inputs=False: an id outside [0, V) is replaced by 0 before any kernel sees it (no read out of bounds),
    its token's ℓ and H are NaN, and so are the loss, the metrics and the gradient."""
    import grpo_kernels.api
    import grpo_kernels.fused_linear

    seen: list[tuple[int, int]] = []
    pick, pick_linear = grpo_kernels.api.pick_backend, grpo_kernels.fused_linear.pick_linear_backend
    monkeypatch.setattr(grpo_kernels.api, "pick_backend", lambda *a: _IdsSpy(pick(*a), seen))
    monkeypatch.setattr(grpo_kernels.fused_linear, "pick_linear_backend", lambda *a: _IdsSpy(pick_linear(*a), seen))
    kwargs = good()
    ids = kwargs["completion_ids"].clone()
    ids[0, 1], ids[1, 2] = V, -1  # (1, 2) is masked in the loss (its id ignored), not in the per-token layers
    bad = torch.zeros(B, T, dtype=torch.bool)
    bad[0, 1] = bad[1, 2] = True
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    bad_active = bad & mask.bool()
    hidden, weight = torch.randn(B, T, 4), torch.randn(V, 4)
    schedules = (("fused", {"beta": 0.1}), ("two-pass", {"importance_sampling_level": "sequence"}), ("none", {}))
    for name, options in schedules:
        x = kwargs["logits"].clone().requires_grad_(True)
        reduction = "none" if name == "none" else "loss_type"
        out = grpo_loss(x, ids, kwargs["advantages"], mask, ref_logp=torch.zeros(B, T), backend=backend,
                        reduction=reduction, **options)  # fmt: skip
        out.loss.sum().backward()
        rows = x.grad if name != "none" else x.grad[mask.bool()]  # per token: a masked token's gradient is 0
        assert out.loss.isnan().all() and rows.isnan().all(), name
        assert all(m.isnan() for m in out.metrics.values()), name
        assert torch.equal(out.logp.isnan(), bad_active) and torch.equal(out.entropy.isnan(), bad_active), name
    x = kwargs["logits"].clone().requires_grad_(True)
    logp, entropy = selective_log_softmax(x, ids, backend=backend)
    (logp.nan_to_num() + entropy.nan_to_num()).sum().backward()  # a caller that drops the NaN: its rows stay NaN
    assert torch.equal(logp.isnan(), bad) and torch.equal(entropy.isnan(), bad)
    assert torch.equal(x.grad.isnan().all(-1), bad) and x.grad[~bad].isfinite().all()
    h = hidden.clone().requires_grad_(True)
    out = fused_linear_grpo_loss(h, weight, ids, kwargs["advantages"], mask, backend=backend)
    out.loss.backward()
    assert out.loss.isnan() and h.grad.isnan().all() and torch.equal(out.logp.isnan(), bad_active)
    h = hidden.clone().requires_grad_(True)
    logp, entropy = fused_linear_log_softmax(h, weight, ids, backend=backend)
    (logp.nan_to_num() - entropy.nan_to_num()).sum().backward()
    assert torch.equal(logp.isnan(), bad) and torch.equal(h.grad.isnan().all(-1), bad)
    assert seen and all(lo >= 0 and hi < V for lo, hi in seen), seen


# ----------------------------------------------------------------------------------------------------------------
# Eager and torch.compile cross the same boundary (grpo_kernels/boundary.py): the same inputs are refused, by the
# same message, and the same ones accepted.


def _compiled(**kwargs):
    """grpo_loss under torch.compile(fullgraph=True), traced afresh (a graph of its own per case: no cache, no
    recompile limit), through a backend that records the graphs, so that a call that silently ran eagerly fails."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda kw: grpo_loss(backend="torch", **kw), fullgraph=True, backend=record)
    return step(kwargs), graphs


COMPILE_ONLY = {"inplace_backward"}  # refused under compile for what the op cannot do, not for its type


@pytest.mark.parametrize("changes,error,fragment", CASES, ids=[c[2][:40] for c in CASES])
def test_compiled_calls_refuse_what_eager_refuses(changes, error, fragment):
    with pytest.raises(Exception, match=re.escape(fragment)) as caught:
        _compiled(**{**good(), **changes})
    # fullgraph wraps the error (dynamo's Unsupported over its ObservedValueErrorError, or a fake op's error at
    # trace time): the eager type is named in the chain
    chain, exc = [], caught.value
    while exc is not None:
        chain.append(type(exc).__name__)
        exc = exc.__cause__
    named = any(error.__name__ in name for name in chain) or f"{error.__name__}(" in str(caught.value)
    assert named or set(changes) & COMPILE_ONLY, chain


@pytest.mark.parametrize("changes,fragment", VALUE_CASES, ids=[c[1][:40] for c in VALUE_CASES])
def test_compiled_calls_check_values_as_eager_does(changes, fragment):
    with pytest.raises(Exception, match=re.escape(fragment)):
        _compiled(**{**good(), **changes}, check_inputs=True)
    out, graphs = _compiled(**{**good(), **changes})  # off: accepted, NaN results, as eager
    assert graphs and out.loss.isnan() and all(m.isnan() for m in out.metrics.values())


def test_compiled_calls_accept_what_eager_accepts():
    kwargs = {**good(), "completion_mask": torch.tensor([[1, 0, 1], [1, 1, 0]]), "check_inputs": True}
    out, graphs = _compiled(**kwargs)
    eager = grpo_loss(backend="torch", **kwargs)
    assert graphs, "the call ran eagerly"
    torch.testing.assert_close(out.loss, eager.loss)
    assert out.metrics.keys() == eager.metrics.keys()


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face's padding convention: -100 (or anything) as the id of a masked token. It is ignored as the token's
# logits are: the results are exactly those of the same call with 0 there, on every backend.

ROW_BACKENDS = [
    "c-rows",  # backend="torch" on a CPU: the compiled C rows
    "torch-rows",  # the chunked torch rows (the C extension turned off)
    TRITON,  # the Triton kernels, under the interpreter here
    "compiled",  # torch.compile: the row ops around the traced objective
]


def _padding_problem():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=gen)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    zero_ids = torch.randint(0, V, (B, T), generator=gen).masked_fill(mask == 0, 0)
    padded = zero_ids.masked_fill(mask == 0, -100)
    padded[1, 2] = 10**9  # any value: far past the vocabulary too
    adv = torch.tensor([1.0, -0.5])
    return logits, mask, zero_ids, padded, adv


_COMPILED: dict[tuple, object] = {}  # one compiled step per option set, for the padded ids and the zeros alike


def _loss_and_grad(logits, ids, adv, mask, backend, reduction="loss_type", **options):
    x = logits.clone().requires_grad_(True)
    if backend == "compiled":
        key = tuple(sorted(options.items()))
        if key not in _COMPILED:
            step = lambda *a: grpo_loss(*a, backend="torch", **options).loss
            _COMPILED[key] = torch.compile(step, fullgraph=True, backend="aot_eager")  # traced, AOT autograd
        loss = _COMPILED[key](x, ids, adv, mask)
    else:
        loss = grpo_loss(x, ids, adv, mask, backend=backend, reduction=reduction, **options).loss
    loss.sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("backend", ROW_BACKENDS)
@pytest.mark.parametrize("reduction", ["loss_type", "none"])  # the aggregated loss and the per-token layer
def test_minus_100_ids_at_masked_tokens_are_ignored(backend, reduction, monkeypatch):
    if backend == "compiled" and reduction == "none":
        pytest.skip("reduction='none' is eager only (refused by name under torch.compile)")
    if backend == "torch-rows":
        from grpo_kernels.ops import cpu_rows

        monkeypatch.setenv("GRPO_KERNELS_CPU_ROWS", "0")
        assert not cpu_rows.available()
    name = "torch" if backend in ("c-rows", "torch-rows") else backend
    logits, mask, zero_ids, padded, adv = _padding_problem()
    for options in ({}, {"loss_type": "dapo", "importance_sampling_level": "sequence"}, {"check_inputs": True}):
        want, want_grad = _loss_and_grad(logits, zero_ids, adv, mask, name, reduction, **options)
        got, got_grad = _loss_and_grad(logits, padded, adv, mask, name, reduction, **options)
        assert got.isfinite().all() and got_grad.isfinite().all(), options
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


def test_minus_100_ids_at_masked_tokens_in_the_module_and_fused_linear():
    logits, mask, zero_ids, padded, adv = _padding_problem()
    loss_fn = GRPOLoss(loss_type="dapo", check_inputs=True)
    assert torch.equal(loss_fn(logits, padded, adv, mask).loss, loss_fn(logits, zero_ids, adv, mask).loss)
    hidden, weight = torch.randn(B, T, 4), torch.randn(V, 4)
    for backend in ("torch", "triton") if HAS_TRITON_DEVICE else ("torch",):
        results = []
        for ids in (zero_ids, padded):
            h = hidden.clone().requires_grad_(True)
            out = fused_linear_grpo_loss(h, weight, ids, adv, mask, backend=backend)
            out.loss.backward()
            logp, entropy = fused_linear_log_softmax(h, weight, ids, completion_mask=mask, backend=backend)
            results.append((out.loss, h.grad, logp, entropy))
        for got, want in zip(results[1], results[0]):
            assert got.isfinite().all()
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_per_token_layers_take_a_completion_mask_for_padded_ids():
    logits, mask, zero_ids, padded, _ = _padding_problem()
    x = logits.clone().requires_grad_(True)
    logp, entropy = selective_log_softmax(x, padded, completion_mask=mask.bool(), check_inputs=True)
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(logp[mask == 0], torch.zeros(3)) and torch.equal(entropy[mask == 0], torch.zeros(3))
    want = selective_log_softmax(logits, zero_ids)[0]
    torch.testing.assert_close(logp[mask == 1], want[mask == 1], rtol=0, atol=0)
    assert torch.equal(x.grad[mask == 0], torch.zeros(3, V)) and x.grad.isfinite().all()
    with pytest.raises(ValueError, match=re.escape("completion_ids must lie in [0, 5)")):
        selective_log_softmax(logits, padded, check_inputs=True)  # unmasked: the documented error
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        selective_log_softmax(logits, padded, completion_mask=mask[:, :2])


def test_trl_names_and_defaults():
    """TRL's `epsilon` is our `epsilon_low`, eager and compiled; every default is TRL 1.16 GRPOConfig's but for the
    ones `TRL_DEFAULTS_THAT_DIFFER` lists (which docs/loss.md states)."""
    from grpo_kernels.config import TRL_DEFAULTS_THAT_DIFFER, TRL_NAMES

    kwargs = {**good(), "old_logp": torch.randn(B, T)}
    want = grpo_loss(backend="torch", epsilon_low=0.05, **kwargs).loss
    torch.testing.assert_close(grpo_loss(backend="torch", epsilon=0.05, **kwargs).loss, want, rtol=0, atol=0)
    assert GRPOLoss(epsilon=0.05).config == LossConfig(epsilon_low=0.05)
    with pytest.raises(TypeError, match=re.escape("['epsilon_lo'] ('epsilon_lo': did you mean 'epsilon_low'")):
        grpo_loss(backend="torch", epsilon_lo=0.05, **kwargs)
    torch.testing.assert_close(_compiled(**kwargs, epsilon=0.05)[0].loss, want)
    trl = pytest.importorskip("trl")
    from dataclasses import fields

    theirs = {f.name: f.default for f in fields(trl.GRPOConfig)}
    ours = {f.name: f.default for f in fields(LossConfig)}
    for trl_name, name in TRL_NAMES.items():
        theirs[name] = theirs.pop(trl_name)
    differ = {k: theirs[k] for k in ours.keys() & theirs.keys() if theirs[k] != ours[k]}
    assert differ == TRL_DEFAULTS_THAT_DIFFER
    text = (Path(__file__).parents[1] / "docs" / "loss.md").read_text()
    for name, value in TRL_DEFAULTS_THAT_DIFFER.items():
        assert f"| `{name}` | `{ours[name]!r}` | `{value!r}` |" in text, name
