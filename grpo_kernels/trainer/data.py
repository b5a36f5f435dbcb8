"""Prompt data for the trainer: load a local file or a hub dataset, map its columns, render prompts.

Rows become plain dicts with `prompt` (the question), and `answer` / `tests` where the dataset has them; every other
column rides along and reaches the reward functions as a keyword argument, as in TRL.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any

import torch

from ..rewards import RewardFunc, accuracy_reward, code_reward, get_reward_funcs, reward_name
from .config import TrainConfig

# DeepSeek-R1-Zero's template (arXiv:2501.12948, Table 1); the question follows it.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


class LoadError(RuntimeError):
    """A model or dataset could not be loaded; the message says what was tried and what to do."""


def hub_offline() -> bool:
    """True when the Hugging Face hub can't be used now: HF_HUB_OFFLINE is set, or its host doesn't answer within
    a few seconds. Checked once, so that a machine without network fails in seconds, not after minutes of retries."""
    return _hub_offline()  # the cached probe, looked up at call time so tests can stand in for the network


@functools.lru_cache(maxsize=1)
def _hub_offline() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return True
    return False


LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(
    dataset: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    tests_column: str = "tests",
    reward_funcs: Sequence[RewardFunc] = (),
) -> list[dict[str, Any]]:
    """Rows of a local JSONL/JSON/CSV/Parquet file or a hub dataset, with columns renamed to prompt/answer/tests.
    A reward of `reward_funcs` that needs a column the dataset lacks is an error (`check_reward_columns`)."""
    if not dataset:
        raise ValueError("dataset must name a local .jsonl/.json/.csv/.parquet file or a Hugging Face dataset")
    ext = os.path.splitext(dataset)[1].lower()
    if os.path.exists(dataset):
        if ext not in LOCAL_FORMATS:
            raise ValueError(
                f"dataset {dataset!r}: unsupported file type {ext!r}; expected one of {sorted(LOCAL_FORMATS)}"
            )
        records = _read_local(dataset, ext, split)
    elif ext in LOCAL_FORMATS:
        raise FileNotFoundError(f"dataset file {dataset!r} does not exist")
    else:
        records = _read_hub(dataset, config_name, split)
    if not records:
        raise ValueError(f"dataset {dataset!r} (split {split!r}) has no rows")
    if not any(prompt_column in r for r in records):
        raise ValueError(f"dataset {dataset!r} has no prompt column {prompt_column!r}; its columns: {list(records[0])}")
    check_reward_columns(reward_funcs, records, f"dataset {dataset!r}", answer=answer_column, tests=tests_column)
    rename = {prompt_column: "prompt", answer_column: "answer", tests_column: "tests"}
    return [{rename.get(k, k): v for k, v in record.items()} for record in records]


def _read_local(path: str, ext: str, split: str) -> list[dict[str, Any]]:
    """The records of a local file; JSON is parsed here so that a bad row is reported by its number."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"dataset {path!r} is empty (0 bytes)")
    if ext in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"dataset {path!r} is empty (only whitespace)")
        if ext == ".json" and text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"dataset {path!r} is not valid JSON: {err}") from err
            bad = next((i for i, r in enumerate(records, 1) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"dataset {path!r}: item {bad} is not a JSON object")
            return records
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"dataset {path!r}: row {number} is not valid JSON ({err.msg} at column {err.colno})")
            if not isinstance(record, dict):
                raise ValueError(f"dataset {path!r}: row {number} is not a JSON object")
            records.append(record)
        return records
    import datasets

    try:
        ds = datasets.load_dataset(LOCAL_FORMATS[ext], data_files={split: path}, split=split)
    except Exception as err:  # datasets wraps the reader's error; its innermost cause is the useful part
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise ValueError(f"dataset {path!r} could not be read as {ext[1:]}: {cause}") from err
    return list(ds)


def _read_hub(dataset: str, config_name: str | None, split: str) -> list[dict[str, Any]]:
    import datasets
    from huggingface_hub import constants

    if hub_offline() and not constants.HF_HUB_OFFLINE:
        raise LoadError(
            f"dataset {dataset!r} is neither a local file nor reachable: the Hugging Face hub does not answer. "
            "Pass a local .jsonl/.csv/.parquet file, or set HF_HUB_OFFLINE=1 to use a cached copy."
        )
    try:
        return list(datasets.load_dataset(dataset, config_name, split=split))
    except Exception as err:  # the hub raises many types: connection, missing repo, missing split
        raise LoadError(
            f"could not load the dataset {dataset!r} (split {split!r}) from the Hugging Face hub: {err}. "
            "Pass a local .jsonl/.csv/.parquet file, or make the hub reachable (HF_HUB_OFFLINE unset)."
        ) from err


def rows_from_config(cfg: TrainConfig, reward_funcs: Sequence[RewardFunc] = ()) -> list[dict[str, Any]]:
    return load_rows(
        cfg.dataset,
        split=cfg.dataset_split,
        config_name=cfg.dataset_config,
        prompt_column=cfg.prompt_column,
        answer_column=cfg.answer_column,
        tests_column=cfg.tests_column,
        reward_funcs=reward_funcs,
    )


def load_reward_funcs(names: str) -> list[RewardFunc]:
    """The reward functions `names` lists; a `module:function` is looked up in the current folder first, as a
    user who writes ./myrewards.py expects, whether the CLI was started as a script or with `python -m`."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        return get_reward_funcs(names)
    finally:
        sys.path.remove(cwd)


# The built-in rewards that need a dataset column: (the column, its CLI flag, the names TRL also accepts for it)
NEEDED_COLUMNS: dict[Any, tuple[str, str, tuple[str, ...]]] = {
    accuracy_reward: ("answer", "--answer-column", ("solution",)),
    code_reward: ("tests", "--tests-column", ()),
}


def check_reward_columns(
    funcs: Sequence[RewardFunc], rows: Sequence[dict[str, Any]], source: str, *, answer: str, tests: str
) -> None:
    """A reward whose column the rows lack would score every completion None (accuracy quietly 0): refuse.
    `answer`/`tests` name the columns that hold them in `rows`; the default names also accept TRL's aliases."""
    present = {k for row in rows for k in row}
    names = {"answer": answer, "tests": tests}
    for func in funcs:
        if func not in NEEDED_COLUMNS:
            continue
        column, flag, aliases = NEEDED_COLUMNS[func]
        accepted = {names[column], *(aliases if names[column] == column else ())}
        if not present & accepted:
            raise ValueError(
                f"reward {reward_name(func)!r} needs the dataset's {names[column]!r} column ({flag}), which {source} "
                f"lacks; its columns: {sorted(present)}"
            )


def resolve_system_prompt(system_prompt: str) -> str:
    return {"r1": R1_SYSTEM_PROMPT, "none": ""}.get(system_prompt, system_prompt)


def render_prompt(tokenizer: Any, question: Any, system_prompt: str = "", *, use_chat_template: bool = True) -> str:
    """The text the policy continues: the tokenizer's chat template when it has one, else R1's plain layout
    (`<system> User: <question> Assistant:`), else the bare question when there is no system prompt.
    A question may already be a list of chat messages (TRL's conversational format)."""
    messages = question if isinstance(question, list) else [{"role": "user", "content": str(question)}]
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        if system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "\n".join(str(m["content"]) for m in messages)
    if not system_prompt:
        return text
    return f"{system_prompt} User: {text} Assistant:"


def prompt_indices(step: int, batch: int, num_rows: int, seed: int) -> list[int]:
    """The rows of rollout batch `step`: epochs of seeded permutations, a pure function of (step, seed), so a resumed
    run draws exactly the prompts the uninterrupted one would have."""
    perms: dict[int, torch.Tensor] = {}
    out = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][pos]))
    return out


def columns_for(rows: Sequence[dict[str, Any]], repeat: int) -> dict[str, list[Any]]:
    """Dataset columns, each repeated per completion, as keyword arguments for the reward functions."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k != "prompt"]  # every row's columns
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}
