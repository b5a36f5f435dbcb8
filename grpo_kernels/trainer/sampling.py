"""Sampling the policy: one batched `generate` of G completions per prompt, each from its own seed.

Completion i of a step draws its tokens from a generator seeded by (seed, step, prompt, generation) alone, so the
completions are the same whichever rank, batch or resumed run samples them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from .config import TrainConfig
from .model import eos_token_ids


@dataclass
class Samples:
    """What one batched `generate` returns, the prompts repeated once per completion (N = prompts × G)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T], pad after EOS
    completion_mask: torch.Tensor  # [N, T] float, 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool, no EOS within max_completion_length


def sample_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """The seed of completion `generation` of prompt `prompt` (its place in the step's global batch) at `step`:
    a pure function, so a completion is the same whichever rank, batch or resumed run samples it."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SeededSampler:
    """A logits processor that samples each row with its own seeded torch.Generator and returns scores whose argmax
    is the sampled token (`generate` runs greedy around it). Temperature, top-k and top-p are transformers' own
    warpers, so the distribution is exactly the one `do_sample=True` samples from; only the randomness differs:
    row i draws from `seeds[i]` alone, never from the global RNG, so batching and sharding leave it unchanged."""

    def __init__(self, seeds: list[int], cfg: TrainConfig, device: torch.device) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(cfg.temperature)]
        if cfg.top_k:
            self.warpers.append(TopKLogitsWarper(cfg.top_k))
        if cfg.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(cfg.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"SeededSampler has {len(self.generators)} seeds for {scores.shape[0]} rows")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        tokens = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        out = torch.full_like(scores, -math.inf)
        out.scatter_(1, tokens[:, None], 0.0)
        return out


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: TrainConfig,
    *,
    greedy: bool = False,
    seeds: list[int] | None = None,
) -> Samples:
    """One batched `generate` for every prompt × G (× 1 with `greedy`, for evaluation). With `seeds` (one per
    completion, prompt-major), completion i is sampled from its own generator seeded with seeds[i] (`SeededSampler`)
    instead of the global RNG."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    g = 1 if greedy else cfg.num_generations
    enc = tokenizer(
        prompts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=cfg.max_prompt_length,
        add_special_tokens=not (cfg.chat_template and getattr(tokenizer, "chat_template", None)),
    )
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    eos = eos_token_ids(model, tokenizer)
    seeded = seeds is not None and not greedy
    if seeded and len(seeds) != len(prompts) * g:
        raise ValueError(f"generate needs {len(prompts) * g} seeds (prompts x G), got {len(seeds)}")
    sample = not greedy and not seeded  # seeded sampling runs greedy over SeededSampler's scores
    if seeded:  # greedy search returns one sequence per input: the prompts are repeated here instead
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
    gen_cfg = generation_config(cfg, sample, tokenizer, eos, 1 if seeded else g)
    was_training = model.training
    model.eval()  # no dropout while sampling
    processors = LogitsProcessorList([SeededSampler(seeds, cfg, device)] if seeded else [])
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_cfg, logits_processor=processors
    )
    model.train(was_training)
    prompt_len = prompt_ids.shape[1]
    completion_ids = out[:, prompt_len:]
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=device))
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    completion_mask = (torch.arange(completion_ids.shape[1], device=device)[None] <= first_eos[:, None]).float()
    return Samples(
        prompt_ids if seeded else prompt_ids.repeat_interleave(g, 0),
        prompt_mask if seeded else prompt_mask.repeat_interleave(g, 0),
        completion_ids,
        completion_mask,
        ~is_eos.any(1),
    )


def generation_config(cfg: TrainConfig, sample: bool, tokenizer: Any, eos: list[int], num_return: int) -> Any:
    """transformers' GenerationConfig of one `generate` call: sampling (`sample`) or greedy search."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=cfg.top_k if sample else None,
        max_new_tokens=cfg.max_completion_length,
        num_return_sequences=num_return,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        bos_token_id=tokenizer.bos_token_id,
        # Explicit neutral values: transformers fills the fields left None from the model's generation_config, and
        # any other warper would make the sampler differ from softmax(logits / temperature), the loss' policy.
        repetition_penalty=1.0,
        typical_p=1.0,
        no_repeat_ngram_size=0,
        use_cache=True,
    )


def decode_completions(tokenizer: Any, samples: Samples) -> list[str]:
    """The completions' text, up to their EOS."""
    lengths = samples.completion_mask.sum(1).long().tolist()
    ids = [row[:n] for row, n in zip(samples.completion_ids.tolist(), lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)
