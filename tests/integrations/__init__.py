"""Tests of the trainer integrations; the helpers below build tiny local models (no download) for them."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ..ranks import rank_results

# A character-level vocabulary: every lowercase letter is one token, so a rule-based reward reads them back.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARS = "abcdefghijklmnopqrstuvwxyz "
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)  # 30
PAD_ID, EOS_ID = 0, 1


def save_tiny_model(path: Path, *, moe: bool = False, seed: int = 0) -> Path:
    """A 2-layer, hidden-32 Qwen2 (or Qwen2-MoE) causal LM and a char tokenizer, saved under `path` (load by path)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(CHARS)})
    # BPE without merges and without a pre-tokenizer: each character of the text is its own token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    if moe:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(
            **common,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
        )
        model = Qwen2MoeForCausalLM(config)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def char_fraction_reward(chars: str = "abcdefghijklm"):
    """A rule-based reward: the fraction of the completion's characters that are in `chars`."""

    def reward(completions, **kwargs):
        return [sum(c in chars for c in completion) / max(len(completion), 1) for completion in completions]

    reward.__name__ = "char_fraction"
    return reward


# ----------------------------------------------------------------------------------------------------------------
# Data-parallel runs: processes joined as torchrun / accelerate launch would join them


def _rank_entry(rank: int, world: int, port: int, tmp: str, check: Callable, model_dir: str) -> list[str]:
    # the variables torchrun / accelerate launch set; accelerate then joins a gloo group on CPU
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    try:
        return check(rank, model_dir, os.path.join(tmp, f"out{rank}"))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        return [traceback.format_exc()]


def run_ranks(check: Callable[[int, str, str], list[str]], model_dir: Path, world: int) -> list[list[str]]:
    """Run `check(rank, model_dir, output_dir)` in `world` processes that see the torchrun variables; return each
    rank's verdicts ("ok" or what went wrong), an exception's traceback included."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        return rank_results(_rank_entry, (port, tmp, check, str(model_dir)), world, group=False)
