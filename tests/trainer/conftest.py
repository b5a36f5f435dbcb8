"""Fixtures for the trainer tests: a tiny model folder written by save_pretrained, and a small JSONL dataset."""

import json

import pytest
import torch

from grpo_kernels.trainer.config import TrainConfig
from grpo_kernels.trainer.demo import addition_splits, build_char_tokenizer, build_tiny_model

from ..once import computed_once


@pytest.fixture(scope="session")
def model_dir(shared_tmp):
    """A 1-layer Llama and its character tokenizer, saved as any hub model folder is (config, safetensors,
    tokenizer); one folder for the whole run, so that runs shared by the xdist workers name the same model."""

    def build():
        torch.manual_seed(0)
        folder = shared_tmp / "tiny-model"
        tokenizer = build_char_tokenizer()
        build_tiny_model(tokenizer, hidden=32, layers=1, heads=2).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return computed_once(shared_tmp, "tiny-model", build)


@pytest.fixture(scope="session")
def dataset_file(shared_tmp):
    """Two-digit sums as JSONL, with the question and answer under non-default column names (one for the run)."""

    def write():
        rows, _ = addition_splits(seed=0, num_eval=0)
        path = shared_tmp / "sums.jsonl"
        path.write_text("".join(json.dumps({"question": r["prompt"], "solution": r["answer"]}) + "\n"
                                for r in rows[:64]))  # fmt: skip
        return path

    return computed_once(shared_tmp, "sums", write)


def tiny_values(model_dir, dataset_file, output_dir, **overrides) -> dict:
    """Two steps of 2 prompts x 4 completions of at most 12 tokens: seconds on one CPU core."""
    values = {
        "model": str(model_dir),
        "dataset": str(dataset_file),
        "prompt_column": "question",
        "answer_column": "solution",
        "output_dir": str(output_dir),
        "system_prompt": "none",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": "all-linear",
        "prompts_per_step": 2,
        "num_generations": 4,
        "max_completion_length": 12,
        "max_steps": 2,
        "learning_rate": 1e-2,
        "reward_funcs": "accuracy,format_lenient",
        "seed": 0,
        "save_steps": 1,
        "progress": False,
        "plot": False,
        "num_threads": 1,
    }
    return values | overrides


def tiny_config(model_dir, dataset_file, output_dir, **overrides) -> TrainConfig:
    return TrainConfig.from_flat(tiny_values(model_dir, dataset_file, output_dir, **overrides))


def tiny_argv(model_dir, dataset_file, output_dir, **overrides) -> list[str]:
    """The same run as `tiny_config`, as `grpo-kernels train` flags."""
    argv = ["train"]
    for name, value in tiny_values(model_dir, dataset_file, output_dir, **overrides).items():
        flag = name.replace("_", "-")
        argv += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return argv
