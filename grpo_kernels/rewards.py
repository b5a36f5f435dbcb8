"""Deterministic rule-based rewards in TRL's form `f(completions, **columns) -> list[float | None]`.

`None` for a sample means "not applicable" (no gold answer, no tests): `combine_rewards` skips it, as TRL does.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

RewardFunc = Callable[..., list[float | None]]

THINK_TAGS = ("<think>", "</think>")
ANSWER_TAGS = ("<answer>", "</answer>")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or TRL's conversational form `[{"role": "assistant", "content": ...}]`."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    raise TypeError(f"a completion must be a str or a list of chat messages, got {type(completion).__name__}")


# ----------------------------------------------------------------------------------------------------------------
# Format


def make_format_reward(
    think_tags: tuple[str, str] = THINK_TAGS, answer_tags: tuple[str, str] = ANSWER_TAGS, *, strict: bool = True
) -> RewardFunc:
    """A format reward: 1.0 when a think block comes before an answer block, else 0.0.

    strict: the completion is exactly `<think>…</think>` then `<answer>…</answer>` (whitespace between and around),
        each tag exactly once. lenient: a think block followed somewhere later by an answer block, any text around.
    """
    (t_open, t_close), (a_open, a_close) = think_tags, answer_tags
    t_open, t_close, a_open, a_close = map(re.escape, (t_open, t_close, a_open, a_close))
    if strict:

        def inner(o: str, c: str) -> str:
            return f"(?:(?!{o}|{c}).)*"  # no nested or repeated tag inside a block

        pattern = re.compile(
            rf"\s*{t_open}{inner(t_open, t_close)}{t_close}\s*{a_open}{inner(a_open, a_close)}{a_close}\s*", re.DOTALL
        )
        match = pattern.fullmatch
    else:
        match = re.compile(rf"{t_open}.*?{t_close}.*?{a_open}.*?{a_close}", re.DOTALL).search

    def format_reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        return [1.0 if match(completion_text(c)) else 0.0 for c in completions]

    format_reward.__name__ = "format_reward" if strict else "format_lenient_reward"
    return format_reward


format_reward = make_format_reward(strict=True)
format_lenient_reward = make_format_reward(strict=False)


# ----------------------------------------------------------------------------------------------------------------
# Accuracy


def extract_answer(text: str, answer_tags: tuple[str, str] = ANSWER_TAGS) -> str | None:
    """The content of the last `<answer>…</answer>` block, else of the last `\\boxed{…}`, else None."""
    a_open, a_close = map(re.escape, answer_tags)
    blocks = re.findall(rf"{a_open}(.*?){a_close}", text, re.DOTALL)
    if blocks:
        return blocks[-1].strip()
    return last_boxed(text)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` (or `\\fbox{…}`), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the completion was cut off inside the box


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_NUMBER_WITH_COMMAS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _normalize(answer: str) -> str:
    """Spellings math-verify misses: LaTeX thousands separators `1{,}000`/`1\\,000`, `\\%`, `\\$`, `\\!`."""
    answer = answer.strip().strip("$").strip()
    for old, new in (("{,}", ""), ("\\,", ""), ("\\!", ""), ("\\%", "%"), ("\\$", ""), ("\\text{%}", "%")):
        answer = answer.replace(old, new)
    return answer.strip().rstrip(".").strip()


def _as_number(answer: str) -> Fraction | None:
    """An exact value for a plain decimal such as `1,234.5` or `-7`; None for anything else."""
    if _NUMBER_WITH_COMMAS.fullmatch(answer):
        answer = answer.replace(",", "")
    if not _NUMBER.fullmatch(answer):
        return None
    return Fraction(answer)


def _math_verify(gold: str, pred: str) -> bool | None:
    """True/False from math-verify (SymPy); None when the gold answer can't be parsed."""
    from math_verify import parse, verify

    # math-verify times out through SIGALRM, which only the main thread may use.
    main = threading.current_thread() is threading.main_thread()
    if not main:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    timeout = 5 if main else None

    def parse_answer(text: str) -> list:
        # Bare LaTeX such as `\frac{\sqrt{2}}{2}` is only recognized between math delimiters.
        return parse(text, parsing_timeout=timeout) or parse(f"${text}$", parsing_timeout=timeout)

    gold_parsed = parse_answer(gold)
    if not gold_parsed:
        return None
    pred_parsed = parse_answer(pred)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_match(gold: Any, pred: str | None) -> bool | None:
    """Mathematical equivalence of an extracted answer with the gold one ("0.5" = "1/2" = "\\frac{1}{2}",
    "x = 7" = "7", "1,000" = "1000", "50%" = "0.5"). None when the gold answer is missing or can't be parsed."""
    if gold is None or (isinstance(gold, float) and math.isnan(gold)):
        return None
    gold = _normalize(str(gold))
    if not gold:
        return None
    if pred is None:
        return False
    pred = _normalize(pred)
    if not pred:
        return False
    gold_num, pred_num = _as_number(gold), _as_number(pred)
    if gold_num is not None and pred_num is not None:
        return gold_num == pred_num  # the common case, exact and without SymPy
    return _math_verify(gold, pred)


def accuracy_reward(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 when the completion's answer (`<answer>` block, else last `\\boxed{}`) equals the gold `answer`
    mathematically, 0.0 when it doesn't or there is none, None when the gold answer is missing or unparsable.
    TRL's `solution` column is accepted in place of `answer`."""
    if answer is None:
        answer = columns.get("solution")
    if answer is None:
        return [None] * len(completions)
    if len(answer) != len(completions):
        raise ValueError(f"answer must have one entry per completion ({len(completions)}), got {len(answer)}")
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        ok = answers_match(gold, extract_answer(completion_text(completion)))
        out.append(None if ok is None else float(ok))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Code


def extract_code(text: str, answer_tags: tuple[str, str] = ANSWER_TAGS) -> str | None:
    """The last ```python fenced block of a completion, else the content of its `<answer>` block, else None."""
    blocks = re.findall(r"```(?:python|py|python3)[ \t]*\n(.*?)```", text, re.DOTALL | re.IGNORECASE)
    if blocks:
        return blocks[-1]
    a_open, a_close = map(re.escape, answer_tags)
    answers = re.findall(rf"{a_open}(.*?){a_close}", text, re.DOTALL)
    return answers[-1].strip("\n") if answers else None


TestCases = Sequence[Mapping[str, str]]  # the stdin/stdout form: [{"input": ..., "output": ...}, ...]


def code_reward(
    completions: Sequence[Any],
    tests: Sequence[str | TestCases | None] | None = None,
    *,
    test_cases: Sequence[TestCases | None] | None = None,
    test_setup: str | Sequence[str | None] | None = None,
    packages: Sequence[str] = (),
    timeout: float = 5.0,
    time_limit: float | None = None,
    memory_mb: int = 512,
    all_or_nothing: bool = False,
    max_workers: int | None = None,
    **columns: Any,
) -> list[float | None]:
    """Run each completion's code (`extract_code`) in the sandbox (`grpo_kernels.sandbox`) and score it by its tests.

    A row of `tests` is either Python source (asserts, HumanEval's `check(candidate)`, or unittest `TestCase`s): they
    run in a trusted judge process that calls the solution's top-level names through proxies, values rebuilt from
    trusted types each way; 1.0 when they run to their end (or their TestCases all pass), else 0.0. Builtins and the
    standard modules the tests use without importing (`math`, `re`, `np`, ...) are the judge's own, whatever the
    solution binds (docs/code_reward.md states the rule, the types that cross and the sizes). Or it is a list of
    stdin/stdout cases `[{"input": ..., "output": ...}]` (the form of APPS, CodeContests and open-r1's
    verifiable-coding-problems; also accepted as `test_cases`, or inside an open-r1 `verification_info` column): the
    program runs once per case with `time_limit` seconds (else `timeout`), each
    from a fresh folder, and its output is compared here, whitespace-normalized; the reward is the fraction of cases
    passed, or 1.0/0.0 with `all_or_nothing`. None where a sample has no tests. Nothing the code prints, exits with or
    patches decides.

    `test_setup`: trusted source run in the judge before assert-style tests, one for all or one per completion: the
    names it defines shadow the solution's for the tests, except functions and classes it only declares (LeetCode's
    `class Solution:` stub); instances of the classes it defines (`ListNode`) cross by their fields, and the sandbox
    runs its imports and classes before the solution. HumanEval: the prompt
    as `test_setup`, `test + f"check({entry_point})"` as `tests`. `packages`: installed packages the code may
    import (`["numpy"]`), read only; none is visible otherwise.
    """
    from .sandbox import SandboxLimits, run_stdio, run_tests

    rows = _test_rows(len(completions), tests, test_cases, columns.get("verification_info"))
    if rows is None:
        return [None] * len(completions)
    if timeout <= 0 or (time_limit is not None and time_limit <= 0):
        raise ValueError(f"timeout and time_limit must be positive, got {timeout} and {time_limit}")
    if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
        raise TypeError(f"packages must be a list of package names, got {packages!r:.80}")
    setups = _setup_rows(len(completions), test_setup, rows)
    limits = SandboxLimits(timeout=timeout, cpu_seconds=max(1, math.ceil(timeout)), memory_mb=memory_mb)

    def score(item: tuple[Any, str | list[tuple[str, str]] | None, str | None]) -> float | None:
        completion, row, setup = item
        if not row:
            return None
        code = extract_code(completion_text(completion))
        if code is None:
            return 0.0
        if isinstance(row, str):
            return 1.0 if run_tests(code, row, limits=limits, setup=setup, packages=packages).passed else 0.0
        verdicts = run_stdio(
            code, row, limits=limits, time_limit=time_limit, stop_at_first_failure=all_or_nothing, packages=packages
        )
        return float(all(verdicts)) if all_or_nothing else sum(verdicts) / len(verdicts)

    items = list(zip(completions, rows, setups))
    workers = max_workers or min(8, len(items), (os.cpu_count() or 1) * 2)
    if workers <= 1:
        return [score(it) for it in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each worker mostly waits on its subprocesses
        return list(pool.map(score, items))


def _setup_rows(n: int, test_setup: Any, rows: list[Any]) -> list[str | None]:
    """One trusted setup (or None) per completion, from one for all or one per completion."""
    if test_setup is None or isinstance(test_setup, str):
        setups = [test_setup or None] * n
    elif isinstance(test_setup, Sequence) and len(test_setup) == n:
        setups = list(test_setup)
    else:
        raise ValueError(
            f"test_setup must be source text or have one entry per completion ({n}), got {test_setup!r:.80}"
        )
    for i, (setup, row) in enumerate(zip(setups, rows)):
        if setup is not None and not isinstance(setup, str):
            raise TypeError(f"test_setup entries must be source text or None, got {type(setup).__name__} at {i}")
        if setup and row is not None and not isinstance(row, str):
            raise ValueError(f"test_setup is for assert-style tests, but row {i} has stdin/stdout cases")
    return setups


def _test_rows(
    n: int, tests: Sequence[Any] | None, test_cases: Sequence[Any] | None, verification_info: Sequence[Any] | None
) -> list[str | list[tuple[str, str]] | None] | None:
    """One entry per completion: assert-style source, a list of (input, output) cases, or None."""
    given = [(name, col) for name, col in (("tests", tests), ("test_cases", test_cases)) if col is not None]
    if verification_info is not None and not given:
        given = [("verification_info", verification_info)]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("pass the tests as one of tests or test_cases, not both")
    name, column = given[0]
    if isinstance(column, (str, bytes)) or len(column) != n:
        raise ValueError(f"{name} must have one entry per completion ({n}), got {column!r:.80}")
    return [_test_row(row, name) for row in column]


def _test_row(row: Any, name: str) -> str | list[tuple[str, str]] | None:
    if name == "verification_info" and row is not None:
        if isinstance(row, str):  # the column as JSON text
            try:
                row = json.loads(row)
            except ValueError:
                pass
        if not isinstance(row, Mapping):
            raise TypeError(f"verification_info rows must be dicts with test_cases, got {type(row).__name__}")
        if row.get("language", "python") != "python":
            return None  # a task for another language: not applicable here
        row = row.get("test_cases")
    if row is None or isinstance(row, str):
        return row or None
    if not isinstance(row, Sequence) or not all(isinstance(c, Mapping) for c in row):
        raise TypeError(f"{name} rows must be source text or a list of {{'input', 'output'}} dicts, got {row!r:.80}")
    cases = []
    for case in row:
        given, expected = case.get("input"), case.get("output")
        if not isinstance(given, str) or not isinstance(expected, str):
            raise TypeError(f"each case of {name} needs str 'input' and 'output', got {case!r:.80}")
        cases.append((given, expected))
    return cases or None


# ----------------------------------------------------------------------------------------------------------------
# Combination

REWARD_FUNCS: dict[str, RewardFunc] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "format_lenient": format_lenient_reward,
    "code": code_reward,
}


def get_reward_funcs(names: Sequence[str] | str) -> list[RewardFunc]:
    """Reward functions by name, from a list or a comma-separated string: a key of `REWARD_FUNCS`, or
    `package.module:function` for one of your own."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError(f"reward_funcs must name at least one of {sorted(REWARD_FUNCS)} or a module:function")
    return [_reward_func(name) for name in names]


def _reward_func(name: str) -> RewardFunc:
    if ":" not in name:
        if name not in REWARD_FUNCS:
            raise ValueError(f"unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or module:function")
        return REWARD_FUNCS[name]
    module_name, _, attr = name.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward function {name!r} could not be imported: {err}") from err
    if not callable(func):
        raise RewardError(
            f"reward function {name!r} is a {type(func).__name__}, not a function: name a function "
            "f(completions, **columns) -> list[float | None]"
        )
    return func


def reward_name(func: RewardFunc) -> str:
    name = getattr(func, "__name__", type(func).__name__)
    return name.removesuffix("_reward")


def reward_label(func: RewardFunc) -> str:
    """A reward as the user names it: `accuracy` for a built-in one, `module:function` for one of their own (or
    the function's `reward_label` attribute, where it has one)."""
    if isinstance(getattr(func, "reward_label", None), str):
        return func.reward_label
    module = getattr(func, "__module__", None)
    if module == __name__ or module is None:
        return reward_name(func)
    return f"{module}:{getattr(func, '__qualname__', reward_name(func))}"


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number (or None) per completion; the
    message names the reward."""


def call_reward(func: RewardFunc, completions: Sequence[Any], **columns: Any) -> list[float]:
    """`func(completions, **columns)`, checked: one real number or None per completion. Returns floats, NaN where
    the reward does not apply (None, or NaN). Anything else is a `RewardError` naming the reward."""
    label = reward_label(func)
    try:
        values = func(completions, **columns)
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(f"reward {label} raised {type(err).__name__}: {err}{_where(err, func)}") from err
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):  # a numpy array or a tensor
        values = values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise RewardError(
            f"reward {label} returned a {type(values).__name__}, not a list of one number (or None) per completion"
        )
    if len(values) != len(completions):
        raise RewardError(f"reward {label} returned {len(values)} values for {len(completions)} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a 0-d tensor or numpy array
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise RewardError(
                f"reward {label} returned {v!r:.60} (a {type(v).__name__}) for completion {i + 1} of "
                f"{len(values)}: each value must be a number, or None where the reward does not apply"
            )
        v = float(v)
        if math.isinf(v):
            raise RewardError(
                f"reward {label} returned {v} for completion {i + 1} of {len(values)}: rewards must be finite "
                "(None where the reward does not apply)"
            )
        out.append(v)
    return out


def _where(err: BaseException, func: RewardFunc) -> str:
    """` (at file.py:12)`: the innermost frame of the error's traceback, where the reward failed; or, when the
    call itself failed (arguments the reward does not take), where the reward is defined."""
    tb = err.__traceback__
    if tb is not None and tb.tb_next is not None:  # the first frame is call_reward's
        while tb.tb_next is not None:
            tb = tb.tb_next
        return f" (at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})"
    code = getattr(func, "__code__", None)
    return f" (defined at {os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else ""


def combine_rewards(
    funcs: Sequence[RewardFunc],
    completions: Sequence[Any],
    weights: Sequence[float] | None = None,
    **columns: Any,
) -> tuple[list[float], list[list[float]]]:
    """Score `completions` with every function (`call_reward`) and combine them: Σ_f w_f · r_f over the applicable
    ones.

    Returns:
        (total, per_func): total[i] is the weighted sum over the functions that apply to sample i (0.0 when none
        does, as in TRL); per_func[f][i] is function f's reward, NaN where it returned None.
    """
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"reward weights must have one entry per reward function ({len(funcs)}), got {len(weights)}")
    per_func = [call_reward(func, completions, **columns) for func in funcs]
    total = [sum(w * v[i] for w, v in zip(weights, per_func) if not math.isnan(v[i])) for i in range(len(completions))]
    return total, per_func
