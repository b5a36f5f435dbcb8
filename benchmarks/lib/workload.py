"""What the loss benchmarks compute: the workload (the loss options), the inputs, the per-token objective every
contender finishes with, and the float64 truth of reference/.

The per-token objective is `grpo_kernels.loss_math.grpo_objective`, the package's one definition of TRL 1.16's
`GRPOTrainer._compute_loss` outside the oracle; nothing here writes it out again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from grpo_kernels.config import LossConfig
from grpo_kernels.loss_math import TokenInputs, grpo_objective

LOGIT_STD = 2.0  # random logits with the spread of a real LM head's: softmax neither flat nor one-hot
SEQ_LEN = 1024  # T: B·T is split as B sequences of (up to) 1024 completion tokens
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class Workload:
    """The loss every contender computes: TRL 1.16's default loss type with a KL term, so that each contender reads
    old and reference log-probs too (a trainer with num_iterations > 1 or vLLM, and beta > 0)."""

    loss_type: str = "dapo"  # GRPOConfig's default
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28  # DAPO's clip-higher
    temperature: float = 1.0
    entropy_coef: float = 0.0  # GRPOConfig's default: the entropy is computed (a metric), no gradient through it

    def config(self) -> LossConfig:
        return LossConfig(**asdict(self))


def objective(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    cfg: LossConfig,
) -> torch.Tensor:
    """The loss from per-token ℓ and H ([B, T]): `loss_math.grpo_objective` in float64, with the metrics TRL logs
    beside it (ours computes them inside its call too), so every contender finishes the same way."""
    tokens = TokenInputs(
        advantages=advantages.double().unsqueeze(1),
        mask=mask.double(),
        old_logp=old_logp.double(),
        ref_logp=ref_logp.double(),
        is_ratio=None,
        sampling_logp=None,
    )
    loss, _metrics = grpo_objective(logp.double(), entropy.double(), tokens, cfg)
    return loss


def reference_loss(
    logits64: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    w: Workload,
) -> float:
    """The float64 oracle's loss (reference/, reached from the repository root) on float64 logits [B, T, V]."""
    from reference import reference_grpo_loss

    with torch.no_grad():
        return float(reference_grpo_loss(logits64, ids, advantages, mask, old_logp, ref_logp, **asdict(w)).loss)


@dataclass
class Inputs:
    """One batch. `full` is the (B, T+1, V) buffer a model's forward returns; contenders that take logits already
    shifted get the view full[:, :-1] (no copy), Liger gets `full` itself, as its kernel requires."""

    full: torch.Tensor  # [B, T+1, V]
    ids: torch.Tensor  # [B, T] int64
    advantages: torch.Tensor  # [B] float32
    mask: torch.Tensor  # [B, T] int64, tail padding as in a batch of completions of varied lengths
    old_logp: torch.Tensor  # [B, T] float32
    ref_logp: torch.Tensor  # [B, T] float32
    seed: int
    pristine: torch.Tensor | None = None  # a copy to restore from, where memory is cheaper than regenerating

    def refill(self) -> None:
        """Rewrite the logits with the values they started with: in-place contenders overwrite them with gradients."""
        with torch.no_grad():
            if self.pristine is not None:
                self.full.copy_(self.pristine)
                return
            gen = torch.Generator(self.full.device).manual_seed(self.seed)
            self.full.normal_(0.0, LOGIT_STD, generator=gen)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the loss takes besides the logits, in `objective`'s order."""
        return self.ids, self.advantages, self.mask, self.old_logp, self.ref_logp

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full, *self.tensors))


def split_tokens(tokens: int) -> tuple[int, int]:
    length = min(SEQ_LEN, tokens)
    return max(1, tokens // length), length


def make_inputs(batch: int, length: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Deterministic inputs (the same in every process for a seed), built without a full-size temporary."""
    full = torch.empty(batch, length + 1, vocab, dtype=dtype, device=device)
    inp = Inputs(full, *(torch.empty(0),) * 5, seed=seed)  # type: ignore[arg-type]
    inp.refill()
    gen = torch.Generator(device).manual_seed(seed + 1)
    inp.ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    inp.advantages = torch.randn(batch, generator=gen, device=device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen, device=device)
    inp.mask = (torch.arange(length, device=device) < lengths.unsqueeze(1)).long()
    logp = _true_logp(full[:, :-1], inp.ids)
    # Near-on-policy old/ref log-probs: ratios around 1, some of them past the clip range.
    inp.old_logp = logp + 0.2 * torch.randn(logp.shape, generator=gen, device=device)
    inp.ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=gen, device=device)
    return inp


@torch.no_grad()
def _true_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    batch, length, vocab = logits.shape
    rows = max(1, (1 << 26 if logits.is_cuda else 1 << 20) // vocab)  # float32 temporaries of 256 MiB / 4 MiB
    out = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    for b in range(batch):
        for t in range(0, length, rows):
            z = logits[b, t : t + rows].float()
            out[b, t : t + rows] = z.gather(-1, ids[b, t : t + rows, None]).squeeze(-1) - z.logsumexp(-1)
    return out
