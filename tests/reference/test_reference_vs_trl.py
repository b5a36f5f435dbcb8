"""The float64 oracle against TRL 1.16's own `GRPOTrainer._compute_loss`: loss, ∂loss/∂logits and metrics to 1e-10.

TRL's method runs unbound on `_TrlTrainerStub`, which carries only the attributes it reads. Its log-probs and
entropies come from TRL's own helpers (`selective_log_softmax_and_entropy`) on a float64 logits leaf, so nothing on
the TRL side is computed by the oracle.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import reference_grpo_loss
from reference.grpo import IS_LEVELS, LOSS_TYPES

try:  # trl missing or not importable (a GPU machine without it): skip this module, don't abort the collection
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import selective_log_softmax_and_entropy
except ImportError as err:
    pytest.skip(f"trl does not import: {err}", allow_module_level=True)

RTOL = 1e-10  # both sides are float64; they differ only by the order of a few float operations
TRL_ONLY_METRICS = {"entropy_coef"}  # logged by TRL's entropy-coefficient controller, not a loss quantity


class _SingleProcessAccelerator:
    """One rank: gather / reduce / pad are the identity; `num_processes` only scales the dapo normalizer."""

    sync_gradients = True

    def __init__(self, num_processes: int):
        self.num_processes = num_processes

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


class _TrlTrainerStub:
    """The attributes `GRPOTrainer._compute_loss` reads, with TRL's own methods bound to it."""

    _compute_loss = GRPOTrainer._compute_loss
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = GRPOTrainer.__dict__["get_off_policy_mask"]  # the staticmethod object itself
    get_gamma_weights = GRPOTrainer.__dict__["get_gamma_weights"]

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor, options: dict, uses_is_ratio: bool):
        self._logits, self._ids, self._temperature = logits, ids, options.get("temperature", 1.0)
        epsilon_low = options.get("epsilon_low", 0.2)
        self.loss_type = options.get("loss_type", "grpo")
        self.beta = options.get("beta", 0.0)
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_low if options.get("epsilon_high") is None else options["epsilon_high"]
        self.importance_sampling_level = options.get("importance_sampling_level", "token")
        self.top_entropy_quantile = options.get("top_entropy_quantile", 1.0)
        self.off_policy_mask_threshold = options.get("off_policy_mask_threshold")
        self.use_vllm = uses_is_ratio
        self.vllm_importance_sampling_correction = uses_is_ratio
        self.aux_loss_enabled = False
        self.entropy_coef = options.get("entropy_coef", 0.0)
        self.use_adaptive_entropy = False
        self._entropy_bonus_enabled = self.entropy_coef != 0.0
        self.max_completion_length = options.get("max_completion_length") or ids.shape[1]
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(
            delta=options.get("delta"),
            use_bias_correction_kl=options.get("use_bias_correction_kl", False),
            sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05),
            vespo_k_pos=options.get("vespo_k_pos", 2.0),
            vespo_lambda_pos=options.get("vespo_lambda_pos", 3.0),
            vespo_k_neg=options.get("vespo_k_neg", 3.0),
            vespo_lambda_neg=options.get("vespo_lambda_neg", 2.0),
            steps_per_generation=1,
        )
        self.model = SimpleNamespace(training=True)
        self.accelerator = _SingleProcessAccelerator(options.get("world_size", 1))
        self._metrics = defaultdict(lambda: defaultdict(list))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logp, entropy = selective_log_softmax_and_entropy(self._logits, self._ids, temperature=self._temperature)
        return logp, entropy, None


@dataclass
class Case:
    logits: torch.Tensor  # (B, T, V) float64, finite (TRL's CPU entropy is NaN at −inf logits)
    ids: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None
    sampling_logp: torch.Tensor | None = None
    options: dict = field(default_factory=dict)


def run_trl(case: Case) -> tuple[float, torch.Tensor, dict[str, float]]:
    logits = case.logits.clone().requires_grad_(True)
    batch, length = case.ids.shape
    mask = torch.ones(batch, length, dtype=torch.float64) if case.mask is None else case.mask.double()
    stub = _TrlTrainerStub(logits, case.ids, case.options, uses_is_ratio=case.is_ratio is not None)
    items = case.options.get("num_items_in_batch")
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": case.ids,
        "completion_mask": mask,
        "advantages": case.advantages.double(),
        "old_per_token_logps": case.old_logp,
        "ref_per_token_logps": case.ref_logp,
        # TRL receives the generation batch's token count from the rollout; a single micro-batch here.
        "num_items_in_batch": torch.tensor(float(mask.sum()) if items is None else float(items), dtype=torch.float64),
    }
    if case.is_ratio is not None:  # TRL multiplies by it as given: a (B,) ratio must reach it as (B, 1)
        inputs["importance_sampling_ratio"] = case.is_ratio.reshape(batch, -1)
    if case.sampling_logp is not None:  # TRL reads it with inputs.get(key, old): the key must be absent for None
        inputs["sampling_per_token_logps"] = case.sampling_logp
    loss = stub._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, logits)
    metrics = {name: values[-1] for name, values in stub._metrics["train"].items() if name not in TRL_ONLY_METRICS}
    return loss.item(), grad, metrics


def run_oracle(case: Case) -> tuple[float, torch.Tensor, dict[str, float]]:
    logits = case.logits.clone().requires_grad_(True)
    out = reference_grpo_loss(
        logits,
        case.ids,
        case.advantages,
        case.mask,
        case.old_logp,
        case.ref_logp,
        importance_sampling_ratio=case.is_ratio,
        sampling_logp=case.sampling_logp,
        **case.options,
    )
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out.loss.item(), grad, out.metrics


def assert_matches_trl(case: Case) -> None:
    trl_loss, trl_grad, trl_metrics = run_trl(case)
    loss, grad, metrics = run_oracle(case)
    assert math.isfinite(trl_loss), f"TRL gave a non-finite loss {trl_loss}: the case is ill-posed"
    assert abs(loss - trl_loss) <= RTOL * max(1.0, abs(trl_loss)), f"loss {loss!r} vs TRL {trl_loss!r}"
    grad_err = (grad - trl_grad).abs().max().item()
    assert grad_err <= RTOL * max(1.0, trl_grad.abs().max().item()), f"∂logits differs from TRL's by {grad_err:.3e}"
    assert set(metrics) == set(trl_metrics), f"metric names {sorted(metrics)} vs TRL {sorted(trl_metrics)}"
    for name, want in trl_metrics.items():
        got = metrics[name]
        assert (math.isnan(got) and math.isnan(want)) or abs(got - want) <= RTOL * max(1.0, abs(want)), (
            f"metric {name}: {got!r} vs TRL {want!r}"
        )


def make_case(
    seed: int = 0,
    batch: int = 3,
    length: int = 5,
    vocab: int = 7,
    *,
    mask: str = "partial",
    old: bool = True,
    ref: bool = False,
    is_ratio: str | None = None,
    sampling: bool | str = False,
    token_advantages: bool = False,
    options: dict | None = None,
) -> Case:
    """Random inputs whose ratios r = exp(ℓ − ℓ_old) straddle the usual clip edges (log-ratios of a few tenths)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    logp = torch.log_softmax(logits / (options or {}).get("temperature", 1.0), -1)
    logp = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    shape = (batch, length) if token_advantages else (batch,)
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    if mask == "ones":
        completion_mask = None
    elif mask == "none_active":
        completion_mask = torch.zeros(batch, length)
    else:  # "partial": right padding of random length; the last row fully masked when B > 1
        lengths = torch.randint(1, length + 1, (batch,), generator=gen)
        if batch > 1:
            lengths[-1] = 0
        completion_mask = (torch.arange(length) < lengths.unsqueeze(1)).float()

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(batch, length, generator=gen, dtype=torch.float64)

    rho = None
    if is_ratio is not None:  # a float64 ρ: TRL takes log ρ in the dtype it is given (float32 would round)
        ratio_shape = {"BT": (batch, length), "B1": (batch, 1), "B": (batch,)}[is_ratio]
        rho = torch.exp(0.3 * torch.randn(ratio_shape, generator=gen, dtype=torch.float64))
        if completion_mask is not None:  # ordinary padding: ρ = 1 where nothing was sampled
            active = completion_mask.bool() if is_ratio == "BT" else completion_mask.bool().any(-1)
            rho = torch.where(active.reshape(rho.shape), rho, 1.0)
    return Case(
        logits=logits,
        ids=ids,
        advantages=advantages,
        mask=completion_mask,
        old_logp=logp + noise(0.3) if old else None,
        ref_logp=logp + noise(0.5) if ref else None,
        is_ratio=rho,
        sampling_logp=_sampling_logp(logp + noise(0.4) + 0.1, sampling),
        options=dict(options or {}),
    )


def _sampling_logp(values: torch.Tensor, kind: bool | str) -> torch.Tensor | None:
    """None, the values, or ("nan") the values with every other token unscorable (NaN, as vLLM reports it)."""
    if not kind:
        return None
    if kind == "nan":
        values = values.clone()
        values.view(-1)[::2] = float("nan")
    return values


# Every loss type at both importance-sampling levels, on the default options.
@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_level(loss_type, level):
    for seed in range(3):
        assert_matches_trl(make_case(seed, options={"loss_type": loss_type, "importance_sampling_level": level}))


# One option (or input variant) at a time, each on the loss types where it changes something; reasons inline.
OPTION_CASES = [
    ("grpo", {"epsilon_high": 0.28}, {}),  # asymmetric clip (DAPO's clip-higher)
    ("dapo", {"epsilon_high": 0.28, "epsilon_low": 0.1}, {}),  # both edges moved
    ("grpo", {"delta": 1.1}, {}),  # two-sided clipping caps r, and the clip metrics see the capped r
    ("bnpo", {"delta": 1.05, "importance_sampling_level": "sequence"}, {}),  # delta on the GSPO weight
    ("grpo", {"beta": 0.04}, {"ref": True}),  # k3 KL term and the "kl" metric
    ("grpo", {"beta": 0.04, "use_bias_correction_kl": True}, {"ref": True}),  # KL weighted by r
    ("grpo", {"beta": 0.04, "use_bias_correction_kl": True, "delta": 1.1}, {"ref": True}),  # KL sees r before delta
    # the KL correction with a (B, 1) GSPO weight
    ("sapo", {"beta": 0.1, "use_bias_correction_kl": True, "importance_sampling_level": "sequence"}, {"ref": True}),
    ("vespo", {"beta": 0.1}, {"ref": True}),  # KL added after φ
    ("grpo", {"temperature": 0.7}, {}),  # τ < 1 scales ∂logits by 1/τ
    ("cispo", {"temperature": 1.3, "epsilon_high": 1.2}, {}),  # τ > 1, cap straddled
    ("grpo", {}, {"is_ratio": "BT"}),  # token-level TIS ratio
    ("grpo", {}, {"is_ratio": "B1"}),  # sequence-level ratio
    ("dapo", {"importance_sampling_level": "sequence"}, {"is_ratio": "B"}),  # (B,) is read as (B, 1)
    ("vespo", {}, {"is_ratio": "BT"}),  # folded into φ: Σ log ρ over all T (padded positions hold ρ = 1)
    ("vespo", {}, {"is_ratio": "B1"}),  # folded into φ once per sequence
    ("grpo", {"off_policy_mask_threshold": 0.05}, {"sampling": True}),  # drops some negative-A sequences
    ("dapo", {"off_policy_mask_threshold": 0.0}, {}),  # sampling log-probs default to old
    ("cispo", {"off_policy_mask_threshold": 0.2}, {"sampling": "nan"}),  # tokens vLLM could not score count 0
    ("sapo", {"off_policy_mask_threshold": 0.05}, {"sampling": True, "old": False}),  # ... and old to sg(ℓ)
    ("grpo", {"top_entropy_quantile": 0.5}, {}),  # entropy mask; the threshold can land on a token exactly
    ("bnpo", {"top_entropy_quantile": 0.2}, {}),  # a strict mask
    ("grpo", {"entropy_coef": 0.01}, {}),  # entropy bonus, gradient through H, "policy_loss" metric
    ("dapo", {"entropy_coef": -0.02, "top_entropy_quantile": 0.5}, {}),  # bonus over the entropy-masked tokens
    ("dapo", {"num_items_in_batch": 23}, {}),  # token count of the whole generation batch
    ("cispo", {"num_items_in_batch": 0.5, "epsilon_high": 1.1}, {}),  # count clamped to 1
    ("vespo", {"num_items_in_batch": 40, "world_size": 2}, {}),  # normalizer N / P
    ("dapo", {"num_items_in_batch": 17, "world_size": 2}, {}),  # the same on the clipped family
    ("dr_grpo", {"max_completion_length": 9}, {}),  # constant normalizer B · max_completion_length
    ("luspo", {}, {"token_advantages": True}),  # (B, T) advantages
    ("vespo", {"importance_sampling_level": "sequence"}, {"token_advantages": True}),  # φ becomes (B, T)
    ("grpo", {"off_policy_mask_threshold": 0.05}, {"sampling": True, "token_advantages": True}),  # per-token keep
    ("sapo", {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.3}, {}),  # non-default temperatures
    # non-default (k, λ), rounded to float32 by TRL; λ_neg = 1e-5 hits the 1e-4 floor
    ("vespo", {"vespo_k_pos": 1.5, "vespo_lambda_pos": 0.1, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1e-5}, {}),
]


@pytest.mark.parametrize(
    "loss_type,options,variant", OPTION_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(OPTION_CASES)]
)
def test_each_option(loss_type, options, variant):
    for seed in range(3):
        assert_matches_trl(make_case(seed, options=dict(loss_type=loss_type, **options), **variant))


# Masks and old log-probs: the denominators' max(·, 1) guards and the ratio-exactly-1 path.
@pytest.mark.parametrize("mask", ["ones", "partial", "none_active"])  # no mask, ragged + empty row, all empty
@pytest.mark.parametrize("old", [True, False])  # ℓ_old given, or sg(ℓ) (r ≡ 1)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo"])  # the four denominators
def test_masks_and_old_logp(mask, old, loss_type):
    for level in IS_LEVELS:
        options = {"loss_type": loss_type, "importance_sampling_level": level, "top_entropy_quantile": 0.6}
        assert_matches_trl(make_case(1, mask=mask, old=old, options=options))


# T == 1: TRL's metric helpers read any (B, 1) tensor as per-sequence values (reference/grpo.py, disagreement 3).
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo", "cispo"])  # clip metrics, phi and cispo metrics
def test_single_token_completions(loss_type):
    options = {"loss_type": loss_type, "beta": 0.05}
    assert_matches_trl(make_case(2, batch=4, length=1, mask="ones", options=options, ref=True))
    # With masked tokens TRL's T = 1 metrics average over every row, masked ones included (reference disagreement
    # 3b); ours leave masked tokens out (disagreement 10). The loss and the gradient are TRL's.
    case = make_case(2, batch=4, length=1, options=options, ref=True)
    trl_loss, trl_grad, _ = run_trl(case)
    loss, grad, metrics = run_oracle(case)
    assert abs(loss - trl_loss) <= RTOL * max(1.0, abs(trl_loss))
    assert (grad - trl_grad).abs().max().item() <= RTOL * max(1.0, trl_grad.abs().max().item())
    ref = reference_grpo_loss(
        case.logits, case.ids, case.advantages, case.mask, case.old_logp, case.ref_logp, **case.options
    )
    active = case.mask.bool()
    assert 0 < active.sum() < active.numel()
    assert metrics["entropy"] == pytest.approx(ref.entropy.detach()[active].mean().item(), rel=1e-12)


def test_vocabulary_of_one():  # V = 1: ℓ = 0 and H = 0 everywhere, the gradient is exactly 0
    case = make_case(3, vocab=1, options={"loss_type": "grpo", "entropy_coef": 0.1})
    assert_matches_trl(case)
    assert run_oracle(case)[1].abs().max() == 0


def test_integer_and_bool_masks_are_read_as_float():  # the oracle casts; TRL is fed the float mask
    case = make_case(4, options={"loss_type": "bnpo", "top_entropy_quantile": 0.5})
    for dtype in (torch.bool, torch.int32, torch.int64):
        assert_matches_trl(Case(**{**case.__dict__, "mask": case.mask.to(dtype)}))


@st.composite
def random_cases(draw) -> Case:
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    options: dict = {"loss_type": loss_type, "importance_sampling_level": draw(st.sampled_from(IS_LEVELS))}
    if draw(st.booleans()):
        options["epsilon_high"] = draw(st.sampled_from([0.1, 0.28, 1.5]))
    if draw(st.booleans()) and loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        options["delta"] = draw(st.sampled_from([1.0, 1.1, 2.0]))
    ref = draw(st.booleans())
    if ref:
        options["beta"] = draw(st.sampled_from([0.01, 0.5]))
        options["use_bias_correction_kl"] = draw(st.booleans())
    if draw(st.booleans()):
        options["temperature"] = draw(st.sampled_from([0.5, 0.9, 1.7]))
    sampling = False
    if draw(st.booleans()):
        options["off_policy_mask_threshold"] = draw(st.sampled_from([-0.1, 0.0, 0.1]))
        sampling = draw(st.sampled_from([False, True, "nan"]))
    if draw(st.booleans()):
        options["top_entropy_quantile"] = draw(st.sampled_from([0.0, 0.25, 0.5, 0.9]))
    if draw(st.booleans()):
        options["entropy_coef"] = draw(st.sampled_from([0.01, -0.1]))
    if loss_type in ("dapo", "cispo", "vespo") and draw(st.booleans()):
        options["num_items_in_batch"] = draw(st.integers(0, 30))
        options["world_size"] = draw(st.sampled_from([1, 2, 4]))
    if loss_type == "dr_grpo" and draw(st.booleans()):
        options["max_completion_length"] = draw(st.integers(1, 12))
    length = draw(st.integers(1, 6))
    return make_case(
        draw(st.integers(0, 2**31 - 1)),
        batch=draw(st.integers(1, 4)),
        length=length,
        vocab=draw(st.integers(1, 11)),
        # (at T = 1 TRL's metrics count masked tokens: test_single_token_completions)
        mask=draw(st.sampled_from(["ones", "partial", "partial", "none_active"] if length > 1 else ["ones"])),
        old=draw(st.booleans()),
        ref=ref,
        is_ratio=draw(st.sampled_from([None, None, "BT", "B1", "B"])),
        sampling=sampling,
        token_advantages=draw(st.sampled_from([False, False, True])),
        options=options,
    )


@settings(max_examples=100, deadline=None, database=None)
@given(case=random_cases())
def test_random_cases_match_trl(case):
    assert_matches_trl(case)
