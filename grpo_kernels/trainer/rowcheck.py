"""Every row checked before the model loads: a non-empty prompt (text or chat messages) and the columns that the
chosen rewards need, in one pass; the first bad row is reported by its line (or row) number and column.

What a reward needs: accuracy the gold answer (--answer-column), code the tests (--tests-column), and a reward of
your own every argument it declares without a default (`def r(completions, question, **columns)` needs `question`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards import RewardError, RewardFunc, accuracy_reward, code_reward, reward_label

# What the trainer passes to every reward itself, whatever the columns
REWARD_ARGUMENTS = ("completions", "prompts")
_MISSING = object()


@dataclass(frozen=True)
class Columns:
    """Which dataset columns hold the prompt, the gold answer and the tests (the rows keep their own names)."""

    prompt: str = "prompt"
    answer: str = "answer"
    tests: str = "tests"


@dataclass(frozen=True)
class Need:
    """A column a reward needs in every row: any one of `names`; `strict`: an empty string or list is missing too."""

    names: tuple[str, ...]
    why: str  # "(--answer-column), which reward accuracy needs"
    strict: bool


def reward_needs(funcs: Sequence[RewardFunc], columns: Columns) -> list[Need]:
    """The columns `funcs` need in every row. The built-in rewards take TRL's names for their column too when its
    flag is left at its default (`solution` for the answer; `test_cases`, `verification_info` for the tests)."""
    needs = []
    for func in funcs:
        label = reward_label(func)
        if func is accuracy_reward:
            aliases = ("solution",) if columns.answer == "answer" else ()
            needs.append(Need((columns.answer, *aliases), f"(--answer-column), which reward {label} needs", True))
        elif func is code_reward:
            aliases = ("test_cases", "verification_info") if columns.tests == "tests" else ()
            needs.append(Need((columns.tests, *aliases), f"(--tests-column), which reward {label} needs", True))
        else:
            for name in required_arguments(func):
                names = (name, {"answer": columns.answer, "tests": columns.tests}.get(name, name))
                needs.append(Need(tuple(dict.fromkeys(names)), f"(an argument of reward {label})", False))
    return needs


def required_arguments(func: RewardFunc) -> list[str]:
    """The arguments `func` declares without a default, but the completions and what the trainer passes itself."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin or an object whose signature Python can't read
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [p.name for p in params if p.kind in named and p.default is inspect.Parameter.empty]
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, *named)]
    first = positional[0].name if positional else None  # the completions, whatever the reward calls them
    return [name for name in required if name != first and name not in REWARD_ARGUMENTS]


def _absent(value: Any, strict: bool) -> str | None:
    """Why `value` is no value: "missing", "null", "empty"; None when it is one."""
    if value is _MISSING:
        return "missing"
    if value is None or (isinstance(value, float) and math.isnan(value)):  # JSON null; an empty CSV or Parquet cell
        return "null"
    if strict and isinstance(value, (str, list, tuple)) and (not value or (isinstance(value, str) and value.isspace())):
        return "empty"
    return None


def prompt_problem(value: Any) -> str | None:
    """What is wrong with a prompt: text that is not empty, or a non-empty list of {"role", "content"} messages."""
    if isinstance(value, str):
        return None if value and not value.isspace() else "is empty"
    absent = _absent(value, strict=True)
    if absent:
        return f"is {absent}"
    if not isinstance(value, list):
        return f"must be text or a list of chat messages, got {type(value).__name__} {value!r:.40}"
    for i, message in enumerate(value, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return f"has message {i} that is not a {{'role': ..., 'content': ...}} dict: {message!r:.60}"
    return None


def check_rows(
    rows: Sequence[dict[str, Any]],
    columns: Columns,
    funcs: Sequence[RewardFunc],
    source: str,
    locate: Callable[[int], str],
) -> None:
    """Refuse the first row without a usable prompt or without a column a reward needs, naming `source`, the row
    (`locate(i)`: "line 7", "row 7") and the column. One pass over the rows."""
    if not rows:
        raise ValueError(f"{source} has no rows")
    check_reward_calls(funcs, rows, columns)
    needs = reward_needs(funcs, columns)
    prompt = columns.prompt
    for i, row in enumerate(rows):
        value = row.get(prompt, _MISSING)
        if not (type(value) is str and value and not value.isspace()):  # the common case first, without a copy
            problem = prompt_problem(value)
            if problem:
                known = f"; its columns: {sorted(row)}" if value is _MISSING else ""
                raise ValueError(
                    f"{source}, {locate(i)}: the prompt column {prompt!r} (--prompt-column) {problem}{known}"
                )
        for need in needs:
            if not any(_present(row.get(name, _MISSING), need.strict) for name in need.names):
                absent = [_absent(row.get(name, _MISSING), need.strict) for name in need.names]
                # the column the row has but leaves empty, else the one the flag names
                name, reason = next(
                    ((n, a) for n, a in zip(need.names, absent) if a != "missing"), (need.names[0], "missing")
                )
                known = f"; its columns: {sorted(row)}" if reason == "missing" else ""
                raise ValueError(f"{source}, {locate(i)}: column {name!r} {need.why}, is {reason}{known}")


def check_reward_calls(funcs: Sequence[RewardFunc], rows: Sequence[dict[str, Any]], columns: Columns) -> None:
    """Refuse a reward that cannot take the arguments every call passes it (the completions, `prompts=` and every
    column as a keyword), before the model loads: what a first step would otherwise find after sampling."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in REWARD_ARGUMENTS]
    for alias, name in (("answer", columns.answer), ("tests", columns.tests)):
        if name in keys and alias not in keys:
            keys.append(alias)
    for func in funcs:
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):  # a builtin or an object whose signature Python can't read
            continue
        try:
            signature.bind([], prompts=[], **dict.fromkeys(keys))
        except TypeError as err:
            shown = ", ".join(f"{k}=" for k in ["prompts", *keys][:8]) + (", ..." if len(keys) > 7 else "")
            raise RewardError(
                f"reward {reward_label(func)} cannot take the arguments every reward is called with, "
                f"(completions, {shown}): {err}; declare it as def f(completions, **columns)"
            ) from None


def _present(value: Any, strict: bool) -> bool:
    if type(value) is str:
        return not strict or (bool(value) and not value.isspace())
    return _absent(value, strict) is None
