"""Procedural task suites as a dataset: `--dataset reasoning-gym:NAME[,NAME...]` (the optional `reasoning-gym`
extra), generated in memory from `--num-examples` and `--seed`, and scored by each task's own scorer.

The rows are reasoning-gym's entries as it makes them, `question` (the prompt), `answer` (None for tasks that have
no single right answer) and `metadata`, with the task's name as `task`. The `accuracy` reward becomes the tasks'
own scorers, applied to the completion's last `<answer>` block; a task without a gold answer scores from its
metadata, as reasoning-gym does.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from ..rewards import completion_text
from .errors import LoadError

PREFIX = "reasoning-gym:"
DEFAULT_NUM_EXAMPLES = 1000
INSTALL_HINT = "install the reasoning-gym extra: .venv/bin/pip install -e '.[reasoning-gym]'"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def is_suite(dataset: str) -> bool:
    return dataset.startswith(PREFIX)


def task_names(dataset: str) -> list[str]:
    names = [n.strip() for n in dataset.removeprefix(PREFIX).split(",") if n.strip()]
    if not names:
        raise ValueError(
            f"--dataset {dataset!r} names no task: use reasoning-gym:NAME[,NAME...], e.g. {PREFIX}chain_sum"
        )
    return names


def load_suite(dataset: str, num_examples: int, seed: int) -> tuple[list[dict[str, Any]], Any]:
    """`num_examples` rows of each task that `dataset` names, from `seed`, and the reward that scores them."""
    names = task_names(dataset)
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise LoadError(f"--dataset {dataset!r} needs the reasoning-gym package ({err}): {INSTALL_HINT}") from err
    for name in names:
        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(DATASETS)} tasks, e.g. chain_sum"
            raise ValueError(f"--dataset {dataset!r}: reasoning-gym has no task {name!r}{hint}")
    tasks, rows = {}, []
    for name in names:
        try:
            tasks[name] = reasoning_gym.create_dataset(name, size=num_examples, seed=seed)
            entries = list(tasks[name])
        except Exception as err:  # a task's own configuration checks (composite needs its sub-datasets, ...)
            raise ValueError(f"--dataset {dataset!r}: reasoning-gym could not make task {name!r}: {err}") from err
        rows += [{**entry, "task": name} for entry in entries]
    return rows, _scorer(tasks)


def _scorer(tasks: dict[str, Any]) -> Any:
    def accuracy_reward(
        completions: Sequence[Any],
        task: Sequence[str],
        question: Sequence[str],
        metadata: Sequence[dict],
        **columns: Any,
    ) -> list[float | None]:
        """Each task's own `score_answer` on the completion's last `<answer>` block (None without one), against
        the entry it was made from; a scorer that fails on a malformed answer scores it 0."""
        answers = columns.get("answer") or [None] * len(completions)
        scores: list[float | None] = []
        for completion, name, q, gold, meta in zip(completions, task, question, answers, metadata):
            found = _ANSWER.findall(completion_text(completion))
            entry = {"question": q, "answer": gold, "metadata": meta}
            try:
                scores.append(float(tasks[name].score_answer(found[-1].strip() if found else None, entry)))
            except Exception:  # noqa: BLE001 - some scorers raise on text that is not an answer at all
                scores.append(0.0)
        return scores

    accuracy_reward.reward_label = f"accuracy (reasoning-gym's scorers of {', '.join(tasks)})"
    return accuracy_reward
