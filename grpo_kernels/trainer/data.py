"""Prompt data for the trainer: load a local file, a hub dataset or a task suite, check every row, render prompts.

Rows stay as the dataset has them, plain dicts under the dataset's own column names; every column reaches the
reward functions as a keyword argument, as in TRL, the prompt's own included, and the answer and tests columns also
as `answer` and `tests` (what the built-in rewards take).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..rewards import RewardFunc, accuracy_reward, get_reward_funcs
from .config import TrainConfig
from .errors import LoadError
from .rowcheck import REWARD_ARGUMENTS, Columns, check_rows
from .suites import DEFAULT_NUM_EXAMPLES, is_suite, load_suite

# DeepSeek-R1-Zero's template (arXiv:2501.12948, Table 1); the question follows it.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


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


@dataclass
class TrainData:
    """The rows a run trains on, as the dataset has them (every column under its own name), which columns hold the
    prompt, answer and tests, and the reward functions that score them (a task suite brings its own accuracy)."""

    rows: list[dict[str, Any]]
    columns: Columns
    reward_funcs: list[RewardFunc]


def load_data(cfg: TrainConfig, reward_funcs: Sequence[RewardFunc]) -> TrainData:
    """The dataset `cfg` names, every row checked (`check_rows`): a local file, a hub dataset, or a
    reasoning-gym task suite."""
    funcs = list(reward_funcs)
    if is_suite(cfg.dataset):
        for flag, value in (("--prompt-column", cfg.prompt_column), ("--answer-column", cfg.answer_column)):
            if value != _DEFAULT_COLUMNS[flag]:
                raise ValueError(
                    f"{flag} does not apply to --dataset {cfg.dataset!r}: reasoning-gym's rows hold the prompt in "
                    "'question' and the gold answer in 'answer'"
                )
        rows, accuracy = load_suite(cfg.dataset, cfg.num_examples or DEFAULT_NUM_EXAMPLES, cfg.seed)
        funcs = [accuracy if f is accuracy_reward else f for f in funcs]
        columns = Columns("question", "answer", cfg.tests_column)
        check_rows(rows, columns, funcs, f"--dataset {cfg.dataset!r}", lambda i: f"example {i + 1}")
        return TrainData(rows, columns, funcs)
    if cfg.num_examples is not None:
        raise ValueError(
            f"--num-examples applies to reasoning-gym task suites (--dataset reasoning-gym:NAME), not to "
            f"--dataset {cfg.dataset!r}, whose rows are all used"
        )
    if os.path.exists(cfg.dataset):
        for flag, value, default in (
            ("--dataset-split", cfg.dataset_split, "train"),
            ("--dataset-config", cfg.dataset_config, None),
        ):
            if value != default:
                raise ValueError(
                    f"{flag} {value!r} applies to hub datasets, not to the local file --dataset {cfg.dataset!r}: a "
                    "local file is one split, all of whose rows are used"
                )
    rows, locate = read_rows(cfg.dataset, split=cfg.dataset_split, config_name=cfg.dataset_config)
    columns = Columns(cfg.prompt_column, cfg.answer_column, cfg.tests_column)
    check_rows(rows, columns, funcs, f"dataset {cfg.dataset!r}", locate)
    return TrainData(rows, columns, funcs)


_DEFAULT_COLUMNS = {"--prompt-column": "prompt", "--answer-column": "answer"}


def rows_data(cfg: TrainConfig, rows: list[dict[str, Any]], reward_funcs: Sequence[RewardFunc]) -> TrainData:
    """Rows passed to `train` directly, checked as a dataset's are; `cfg`'s column names apply to them."""
    columns = Columns(cfg.prompt_column, cfg.answer_column, cfg.tests_column)
    check_rows(rows, columns, reward_funcs, "the rows passed to train", lambda i: f"row {i + 1}")
    return TrainData(rows, columns, list(reward_funcs))


def read_rows(
    dataset: str, *, split: str = "train", config_name: str | None = None
) -> tuple[list[dict[str, Any]], Callable[[int], str]]:
    """The rows of a local JSONL/JSON/CSV/Parquet file or a hub dataset, and `locate(i)`, where row i is in it
    ("line 7" of a JSONL or CSV file, "item 7" of a JSON list, "row 7" of Parquet or a hub split)."""
    if not dataset:
        raise ValueError("--dataset must name a local .jsonl/.json/.csv/.parquet file or a Hugging Face dataset")
    ext = os.path.splitext(dataset)[1].lower()
    if os.path.exists(dataset):
        if ext not in LOCAL_FORMATS:
            raise ValueError(
                f"dataset {dataset!r}: unsupported file type {ext!r}; expected one of {sorted(LOCAL_FORMATS)}"
            )
        records, locate = _read_local(dataset, ext, split)
    elif ext in LOCAL_FORMATS:
        raise FileNotFoundError(f"dataset file {dataset!r} does not exist")
    else:
        records, locate = _read_hub(dataset, config_name, split), lambda i: f"row {i + 1} of split {split!r}"
    if not records:
        raise ValueError(f"dataset {dataset!r} (split {split!r}) has no rows")
    return records, locate


def _read_local(path: str, ext: str, split: str) -> tuple[list[dict[str, Any]], Callable[[int], str]]:
    """The records of a local file; JSON is parsed here so that a bad row is reported by its line."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"dataset {path!r} is empty (0 bytes)")
    if ext in (".jsonl", ".json", ".csv"):
        text = read_text(path)
    if ext == ".csv" and _csv_records(text) == 0:
        raise ValueError(f"dataset {path!r} has no rows: only a header row ({text.splitlines()[0][:80]!r})")
    if ext in (".jsonl", ".json"):
        if not text.strip():
            raise ValueError(f"dataset {path!r} is empty (only whitespace)")
        if ext == ".json" and text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"dataset {path!r} is not valid JSON: {err}") from err
            bad = next((i for i, r in enumerate(records, 1) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"dataset {path!r}, item {bad}: not a JSON object")
            return records, lambda i: f"item {i + 1}"
        records, numbers = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"dataset {path!r}, line {number}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"dataset {path!r}, line {number}: not a JSON object")
            records.append(record)
            numbers.append(number)
        return records, lambda i: f"line {numbers[i]}"
    import datasets

    datasets.disable_progress_bars()  # a local file loads in moments; its bar would only stand above an error
    try:
        ds = datasets.load_dataset(LOCAL_FORMATS[ext], data_files={split: path}, split=split)
    except Exception as err:  # datasets wraps the reader's error; its innermost cause is the useful part
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise ValueError(f"dataset {path!r} could not be read as {ext[1:]}: {cause}") from err
    if ext == ".csv":
        return list(ds), functools.partial(_csv_line, path)
    return list(ds), lambda i: f"row {i + 1}"


def read_text(path: str) -> str:
    """A text file as UTF-8 (a leading byte-order mark dropped); bytes that are not UTF-8 are an error naming the
    file, the line and the column."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"dataset {path!r}, line {line}: not UTF-8 (byte 0x{data[err.start]:02x} at column {column}); save "
            "the file as UTF-8"
        ) from None


def _csv_records(text: str) -> int:
    """How many records a CSV text holds after its header: 0, 1 or 2 (the count stops there)."""
    reader = csv.reader(io.StringIO(text))
    count = -1  # the header
    for row in reader:
        count += bool(row)  # (a blank line is no record)
        if count == 2:
            break
    return max(count, 0)


def _csv_line(path: str, i: int) -> str:
    """Where record i of a CSV file starts, read again only for the row reported (a quoted field may hold newlines)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        line = 1
        for index, _ in enumerate(reader, -1):  # -1: the header
            if index == i:
                return f"line {line}"
            line = reader.line_num + 1
    return f"row {i + 1}"


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


def load_reward_funcs(names: str) -> list[RewardFunc]:
    """The reward functions `names` lists; a `module:function` is looked up in the current folder first, as a
    user who writes ./myrewards.py expects, whether the CLI was started as a script or with `python -m`."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        return get_reward_funcs(names)
    finally:
        sys.path.remove(cwd)


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


def rendered_prompts(tokenizer: Any, data: TrainData, cfg: TrainConfig) -> list[str]:
    """Every row's prompt as the policy sees it (`render_prompt` with the run's system prompt and template)."""
    system = resolve_system_prompt(cfg.system_prompt)
    prompt = data.columns.prompt
    return [render_prompt(tokenizer, row[prompt], system, use_chat_template=cfg.chat_template) for row in data.rows]


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


def reward_columns(rows: Sequence[dict[str, Any]], columns: Columns, repeat: int) -> dict[str, list[Any]]:
    """The keyword arguments of the reward functions: every column of `rows`, each value repeated once per
    completion, under its own name, and the answer and tests columns also as `answer` and `tests`. The names the
    trainer passes itself (`completions`, `prompts`) are not columns."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in REWARD_ARGUMENTS]
    out = {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}
    for alias, name in (("answer", columns.answer), ("tests", columns.tests)):
        if name != alias and name in out:
            out[alias] = out[name]
    return out
