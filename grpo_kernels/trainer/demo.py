"""`grpo-kernels demo`: R1's recipe in miniature, on the CPU, with nothing to download.

A character tokenizer and a tiny Llama are built in code; the task is two-digit addition answered in R1's format
(`<think>` column sums `</think><answer>` total `</answer>`). A short cold-start SFT teaches the format and leaves the
arithmetic half-learnt; GRPO on `grpo_loss` (LoRA, KL to the SFT model) then improves held-out greedy accuracy.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import LossConfig
from ..rewards import accuracy_reward, combine_rewards, format_reward
from .config import TrainConfig
from .loop import train
from .model import prepare_tokenizer
from .plotting import plot_metrics
from .sampling import decode_completions, generate

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHARS = list("0123456789+=;,- ")


def build_char_tokenizer(chars: list[str] = CHARS, tags: list[str] = TAGS) -> Any:
    """A character-level `PreTrainedTokenizerFast` whose R1 tags are single tokens; `save_pretrained` writes a
    tokenizer.json that `AutoTokenizer.from_pretrained` reads back with no custom code."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *tags, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIAL_TOKENS)
    tokenizer.add_tokens(tags)  # matched before the character split, kept when decoding
    return tokenizer


def build_tiny_model(tokenizer: Any, *, hidden: int = 96, layers: int = 2, heads: int = 4, max_len: int = 64) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def addition_example(a: int, b: int) -> dict[str, str]:
    """`47+38=` -> `<think>7+8=15;4+3+1=8</think><answer>85</answer>`: column sums from the right, with the carry."""
    steps, carry = [], 0
    for da, db in zip(reversed(f"{a:02d}"), reversed(f"{b:02d}")):
        s = int(da) + int(db) + carry
        steps.append(f"{da}+{db}{f'+{carry}' if carry else ''}={s}")
        carry = s // 10
    answer = str(a + b)
    return {
        "prompt": f"{a}+{b}=",
        "answer": answer,
        "completion": f"<think>{';'.join(steps)}</think><answer>{answer}</answer>",
    }


def addition_splits(seed: int, num_eval: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """All 8100 two-digit sums, shuffled; the first `num_eval` are held out from SFT and GRPO alike."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [addition_example(a, b) for a, b in pairs]
    return rows[num_eval:], rows[:num_eval]


def cold_start_sft(
    model: Any, tokenizer: Any, rows: list[dict[str, str]], *, steps: int, batch_size: int, lr: float, seed: int
) -> list[float]:
    """Full fine-tuning on `prompt + completion + EOS`, loss on the completion only (R1's cold start)."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 20))
    tokenizer.padding_side = "right"
    losses = []
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        prompts = [rows[i]["prompt"] for i in idx]
        texts = [rows[i]["prompt"] + rows[i]["completion"] + tokenizer.eos_token for i in idx]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for j, p in enumerate(prompts):
            labels[j, : len(tokenizer(p)["input_ids"])] = -100
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


REWARD_FUNCS = [accuracy_reward, format_reward]
REWARD_WEIGHTS = [1.0, 0.1]


@torch.no_grad()
def evaluate(
    model: Any, tokenizer: Any, rows: list[dict[str, str]], cfg: TrainConfig, batch_size: int = 256
) -> dict[str, float]:
    """Held-out greedy accuracy and mean reward (the GRPO rewards and weights)."""
    prepare_tokenizer(tokenizer)
    correct, reward, n = 0.0, 0.0, 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        samples = generate(model, tokenizer, [r["prompt"] for r in chunk], cfg, greedy=True)
        texts = decode_completions(tokenizer, samples)
        total, per_func = combine_rewards(REWARD_FUNCS, texts, REWARD_WEIGHTS, answer=[r["answer"] for r in chunk])
        correct += sum(per_func[0])
        reward += sum(total)
        n += len(chunk)
    return {"accuracy": correct / n, "reward": reward / n}


@dataclass
class DemoConfig:
    output_dir: str = "runs/demo"
    seed: int = 0
    num_eval: int = 200
    hidden: int = 96
    layers: int = 2
    sft_steps: int = 150
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    grpo: TrainConfig | None = None  # None: `default_grpo_config(output_dir, seed)`
    eval_every: int = 5  # GRPO steps between held-out evaluations (greedy, cheap at this size)
    num_threads: int = 1  # one thread: fastest for a model this small, and the same numbers on any machine


def default_grpo_config(output_dir: str, seed: int) -> TrainConfig:
    return TrainConfig(
        model="(built in code)",
        dataset="(synthetic two-digit addition)",
        output_dir=str(Path(output_dir) / "grpo"),
        system_prompt="none",
        lora_r=16,
        lora_alpha=32,
        lora_target_modules="all-linear",
        prompts_per_step=16,
        num_generations=8,
        max_prompt_length=16,
        max_completion_length=32,
        temperature=1.0,
        reward_funcs="accuracy,format",
        reward_weights=",".join(map(str, REWARD_WEIGHTS)),
        max_steps=60,
        num_iterations=1,
        learning_rate=3e-4,
        lr_scheduler="constant",
        warmup_steps=5,
        loss=LossConfig(loss_type="grpo", beta=0.04),
        max_grad_norm=1.0,
        seed=seed,
        save_steps=0,
        save_total_limit=1,
        overwrite=True,  # the demo is reproducible: a second run replaces the first
    )


@dataclass
class DemoResult:
    before: dict[str, float]
    after: dict[str, float]
    seconds: float
    plot_path: str | None
    output_dir: str


def run_demo(cfg: DemoConfig | None = None, *, progress: bool = True, log: Any = print) -> DemoResult:
    cfg = cfg or DemoConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        return _run_demo(cfg, progress, log)
    finally:
        torch.set_num_threads(threads)


def _run_demo(cfg: DemoConfig, progress: bool, log: Any) -> DemoResult:
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    grpo_cfg = cfg.grpo or default_grpo_config(cfg.output_dir, cfg.seed)
    grpo_cfg = replace(grpo_cfg, progress=progress, num_threads=cfg.num_threads, device="cpu", plot=False)
    train_rows, eval_rows = addition_splits(cfg.seed, cfg.num_eval)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden=cfg.hidden, layers=cfg.layers)
    log(
        f"model: tiny Llama, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(tokenizer)}-token character vocabulary; task: two-digit addition, {len(eval_rows)} held-out sums"
    )
    losses = cold_start_sft(
        model, tokenizer, train_rows, steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, seed=cfg.seed
    )
    before = evaluate(model, tokenizer, eval_rows, grpo_cfg)
    log(f"cold-start SFT: {cfg.sft_steps} steps, final loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
    log(f"before GRPO: held-out accuracy {before['accuracy']:.1%}, mean reward {before['reward']:.3f}")

    trained = train(
        grpo_cfg,
        model=model,
        tokenizer=tokenizer,
        rows=train_rows,
        reward_funcs=REWARD_FUNCS,
        evaluate=lambda m, tok: evaluate(m, tok, eval_rows, grpo_cfg),
        eval_every=cfg.eval_every,
    )
    result_records = trained.records
    last = result_records[-1]  # evaluated after the last step
    after = {k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}
    seconds = time.perf_counter() - t0
    log(f"after GRPO:  held-out accuracy {after['accuracy']:.1%}, mean reward {after['reward']:.3f}")
    out = Path(cfg.output_dir)
    plot_path = plot_metrics(
        result_records,
        out / "training_curves.png",
        title=f"GRPO on two-digit addition: {len(eval_rows)} held-out sums, {len(result_records)} steps",
        before=before,
    )
    log(f"plot: {plot_path}")
    log(f"total time: {seconds:.0f}s")
    result = DemoResult(before, after, seconds, plot_path, str(out))
    write_summary(result, cfg, grpo_cfg, records=result_records)
    return result


def write_summary(result: DemoResult, cfg: DemoConfig, grpo_cfg: TrainConfig, records: list[dict[str, Any]]) -> None:
    """summary.json in the demo's folder: the accuracy before and after, the evaluation curve, both configs and the
    machine it ran on."""
    summary = {
        "before": result.before,
        "after": result.after,
        "seconds": result.seconds,
        "plot": result.plot_path,
        "eval_curve": [
            {"step": 0, **result.before},
            *({"step": r["step"], **{k[5:]: v for k, v in r.items() if k.startswith("eval/")}} for r in records
              if "eval/accuracy" in r),
        ],
        "config": {k: v for k, v in asdict(cfg).items() if k != "grpo"},
        "grpo": grpo_cfg.to_dict(),
        "machine": {
            "cpu": platform.machine(),
            "cores": os.cpu_count(),
            "load_average": round(os.getloadavg()[0], 1),  # times on a shared machine stretch with its load
            "torch": torch.__version__,
        },
    }
    (Path(result.output_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
