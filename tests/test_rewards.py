"""The rule-based rewards: format (strict, lenient, custom tags), accuracy (math-verify), code,
and their combination."""

import math

import pytest

from grpo_kernels.rewards import (
    accuracy_reward,
    code_reward,
    combine_rewards,
    extract_answer,
    extract_code,
    format_lenient_reward,
    format_reward,
    get_reward_funcs,
    last_boxed,
    make_format_reward,
)
from tests import sandbox_attacks

# ----------------------------------------------------------------------------------------------------------------
# format


@pytest.mark.parametrize(
    "text, strict, lenient",
    [
        ("<think>a</think><answer>b</answer>", 1.0, 1.0),
        ("<think>\nsteps\n</think>\n<answer>\n42\n</answer>\n", 1.0, 1.0),  # R1's own newlines
        ("  <think></think> <answer></answer>  ", 1.0, 1.0),  # empty blocks still have the format
        ("Sure! <think>a</think><answer>b</answer>", 0.0, 1.0),  # text before
        ("<think>a</think><answer>b</answer> done", 0.0, 1.0),  # text after
        ("<think>a</think> and then <answer>b</answer>", 0.0, 1.0),  # text between
        ("<answer>b</answer><think>a</think>", 0.0, 0.0),  # wrong order
        ("<think>a</think>", 0.0, 0.0),  # no answer
        ("<answer>b</answer>", 0.0, 0.0),  # no thinking
        ("<think>a<think>b</think><answer>c</answer>", 0.0, 1.0),  # nested opening tag
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0, 1.0),  # two answers
        ("<think>a</think><answer>b", 0.0, 0.0),  # cut off
        ("", 0.0, 0.0),
    ],
)
def test_format_strict_and_lenient(text, strict, lenient):
    assert format_reward([text]) == [strict]
    assert format_lenient_reward([text]) == [lenient]


def test_format_custom_tags_and_chat_messages():
    reward = make_format_reward(("<reasoning>", "</reasoning>"), ("<final>", "</final>"))
    assert reward(["<reasoning>x</reasoning><final>1</final>", "<think>x</think><answer>1</answer>"]) == [1.0, 0.0]
    conversational = [[{"role": "assistant", "content": "<think>x</think><answer>1</answer>"}]]  # TRL's chat form
    assert format_reward(conversational) == [1.0]


# ----------------------------------------------------------------------------------------------------------------
# accuracy


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<answer>0.5</answer>", "1/2"),
        ("<answer>1/2</answer>", "0.5"),
        ("<answer>\\frac{1}{2}</answer>", "0.5"),
        ("<answer>$\\frac{1}{2}$</answer>", "1/2"),
        ("<answer>x = 7</answer>", "7"),
        ("<answer>7</answer>", "x = 7"),
        ("<answer>1,000</answer>", "1000"),
        ("<answer>1{,}234{,}567</answer>", "1234567"),  # LaTeX thousands separators
        ("<answer>1\\,000</answer>", "1000"),
        ("<answer>50%</answer>", "0.5"),
        ("<answer>50\\%</answer>", "0.5"),
        ("<answer>-3</answer>", -3),  # a numeric gold column
        ("<answer>2.50</answer>", "2.5"),
        ("<answer>\\sqrt{2}/2</answer>", "\\frac{\\sqrt{2}}{2}"),
        ("so the result is \\boxed{\\frac{3}{4}}.", "0.75"),  # no answer block: the last box
        ("\\boxed{1} no wait \\boxed{2}", "2"),  # the last box wins
        ("<answer>1</answer> <answer>2</answer>", "2"),  # the last answer block wins
    ],
)
def test_accuracy_equivalent_answers(completion, gold):
    assert accuracy_reward([completion], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<answer>0.51</answer>", "1/2"),
        ("<answer>12</answer>", "13"),
        ("<answer>1,001</answer>", "1000"),
        ("<answer></answer>", "1"),  # empty answer
        ("the answer is 7", "7"),  # no answer block and no box: nothing was extracted
        ("\\boxed{7", "7"),  # a box cut off before its closing brace
        ("<answer>seven hundred</answer>", "700"),
    ],
)
def test_accuracy_wrong_or_missing_answers(completion, gold):
    assert accuracy_reward([completion], answer=[gold]) == [0.0]


def test_accuracy_is_not_applicable_without_a_gold_answer():
    completions = ["<answer>1</answer>"] * 3
    assert accuracy_reward(completions, answer=[None, "", float("nan")]) == [None, None, None]
    assert accuracy_reward(completions) == [None, None, None]  # no answer column at all
    assert accuracy_reward(completions[:1], solution=["1"]) == [1.0]  # TRL's column name


def test_accuracy_checks_lengths():
    with pytest.raises(ValueError, match="one entry per completion"):
        accuracy_reward(["<answer>1</answer>"], answer=["1", "2"])


def test_extractors():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"  # nested braces balanced
    assert last_boxed("none") is None
    assert extract_answer("<answer> 5 </answer> \\boxed{6}") == "5"  # the answer block comes first
    assert extract_answer("<think>\\boxed{6}</think>") == "6"


# ----------------------------------------------------------------------------------------------------------------
# code


def test_extract_code_prefers_the_last_python_block():
    text = "```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\n<answer>x = 3</answer>"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("<answer>\nx = 3\n</answer>") == "x = 3"
    assert extract_code("```js\nlet x\n```") is None


def test_code_reward():
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # right
        "```python\ndef add(a, b):\n    return a - b\n```",  # wrong
        "<answer>\ndef add(a, b): return a + b\n</answer>",  # right, in the answer block
        "```python\ndef add(a, b) return\n```",  # syntax error
        "no code here",
        "```python\nimport sys\nsys.exit(0)\n```",  # leaves before the tests run: not a pass
        "```python\ndef add(a, b):\n    return a + b\n```",  # no tests for this one
    ]
    tests_column = [tests] * 6 + [None]
    assert code_reward(completions, tests=tests_column) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, None]
    assert code_reward(completions[:1]) == [None]


def test_code_reward_hostile_code_scores_zero_quickly():
    hostile = ["```python\nwhile True: pass\n```", "```python\nx = bytearray(1 << 40)\n```"]
    rewards = code_reward(hostile, tests=["assert True"] * 2, timeout=2.0)
    assert rewards == [0.0, 0.0]


def fenced(source):
    return f"```python\n{source}```"


def test_code_reward_forgeries_score_zero():
    # each of these scored 1.0 when the solution and the tests shared one interpreter
    forgeries = [fenced(src) for src in sandbox_attacks.FORGERIES.values()]
    rewards = code_reward(
        [*forgeries, fenced(sandbox_attacks.HONEST)], tests=[sandbox_attacks.TESTS] * (len(forgeries) + 1)
    )
    assert rewards == [0.0] * len(forgeries) + [1.0]


ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2", "output": "4"}, {"input": "5 5", "output": "  10  \n\n"}]


def test_code_reward_stdin_stdout_cases():
    completions = [fenced(ADD), fenced("print(3)\n"), "no code", fenced(ADD)]
    rows = [CASES, CASES, CASES, None]
    assert code_reward(completions, tests=rows) == [1.0, pytest.approx(1 / 3), 0.0, None]
    assert code_reward(completions, test_cases=rows, all_or_nothing=True) == [1.0, 0.0, 0.0, None]
    # open-r1's verifiable-coding-problems column; a task for another language is not applicable
    info = [{"language": "python", "test_cases": [dict(c, type="stdin_stdout") for c in CASES]}] * 3
    info.append({"language": "cpp", "test_cases": CASES})
    assert code_reward(completions, verification_info=info) == [1.0, pytest.approx(1 / 3), 0.0, None]


def test_code_reward_time_limit_per_case():
    slow = fenced("import time\nn = int(input())\ntime.sleep(n)\nprint(n)\n")
    cases = [{"input": "0", "output": "0"}, {"input": "20", "output": "20"}]
    assert code_reward([slow], tests=[cases], time_limit=2.0) == [0.5]


# Each case needs 0.6 s of work under a 0.3 s limit. Case 0 starts a daemon that works out every case's answer at
# once, into the folder: where it outlived its case and the folder was shared, the later cases only read them.
POOLED = (
    "import os, time\nn = int(input())\n"
    "if not os.path.exists('started'):\n"
    "    open('started', 'w').close()\n"
    "    if os.fork() == 0:\n"
    "        os.setsid()\n"
    "        for k in range(3):\n"
    "            if os.fork() == 0:\n"
    "                time.sleep(0.6)\n"
    "                open(f'tmp{k}', 'w').write(str(k * k))\n"
    "                os.rename(f'tmp{k}', f'ans{k}')\n"
    "                os._exit(0)\n"
    "        os._exit(0)\n"
    "while not os.path.exists(f'ans{n}'):\n"
    "    time.sleep(0.01)\n"
    "print(open(f'ans{n}').read())\n"
)


def test_code_reward_cases_do_not_pool_their_time():
    cases = [{"input": str(k), "output": str(k * k)} for k in range(3)]
    assert code_reward([fenced(POOLED)], tests=[cases], time_limit=0.3) == [0.0]


SETUP = 'def double(x):\n    return 2 * x\n\ndef f(x):\n    """f(x) = double(x) + 1"""\n'


def test_code_reward_test_setup():
    right = fenced("def double(x):\n    return 2 * x\ndef f(x):\n    return double(x) + 1\n")
    rigged = fenced("def double(x):\n    return x\ndef f(x):\n    return x + 1\n")  # wrong, with the helper to match
    tests = ["assert f(3) == double(3) + 1"] * 2
    assert code_reward([right, rigged], tests=tests) == [1.0, 1.0]  # judged by the solution's own helper
    assert code_reward([right, rigged], tests=tests, test_setup=SETUP) == [1.0, 0.0]  # one setup for all
    assert code_reward([right, rigged], tests=tests, test_setup=[SETUP, None]) == [1.0, 1.0]  # one per completion


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tests": ["assert True"] * 2}, ValueError, "tests must have one entry per completion"),
        ({"tests": ["assert True"], "test_setup": ["x"] * 2}, ValueError, "test_setup must be source text or have"),
        ({"tests": [[{"input": "", "output": ""}]], "test_setup": "x = 1"}, ValueError, "test_setup is for assert"),
        ({"tests": ["assert True"], "test_setup": [3]}, TypeError, "test_setup entries must be source text"),
        ({"tests": ["assert True"], "packages": "numpy"}, TypeError, "packages must be a list"),
        ({"tests": ["assert True"], "packages": ["numpy.linalg"]}, ValueError, "packages must be top-level"),
        (
            {"tests": ["assert True"], "packages": ["no_such_package_xyz"]},
            ValueError,
            "packages: 'no_such_package_xyz'",
        ),
        ({"tests": [[{"input": "1"}]]}, TypeError, "needs str 'input' and 'output'"),
        ({"tests": [42]}, TypeError, "tests rows must be source text or a list"),
        ({"tests": ["x"], "test_cases": [None]}, ValueError, "not both"),
        ({"verification_info": ["x"]}, TypeError, "verification_info rows must be dicts"),
        ({"tests": ["assert True"], "timeout": 0}, ValueError, "timeout and time_limit must be positive"),
    ],
)
def test_code_reward_bad_columns(kwargs, error, match):
    with pytest.raises(error, match=match):
        code_reward(["```python\npass\n```"], **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# combination


def test_combine_rewards_weights_and_not_applicable():
    def half(completions, **kw):
        return [0.5] * len(completions)

    total, per_func = combine_rewards(
        [accuracy_reward, half],
        ["<answer>1</answer>", "<answer>2</answer>", "<answer>1</answer>"],
        [2.0, 1.0],
        answer=["1", "1", None],
    )
    assert total == [2.5, 0.5, 0.5]  # the third sample has no gold answer: accuracy is skipped, not 0
    assert per_func[0][:2] == [1.0, 0.0] and math.isnan(per_func[0][2])
    with pytest.raises(ValueError, match="one entry per reward function"):
        combine_rewards([half], ["x"], [1.0, 2.0])


def test_reward_funcs_by_name():
    assert get_reward_funcs("accuracy, format") == [accuracy_reward, format_reward]
    assert get_reward_funcs("tests.trainer.helpers:digit_reward")[0](["a1"]) == [0.5]
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'"):
        get_reward_funcs("acuracy")
    with pytest.raises(ValueError, match="could not be imported"):
        get_reward_funcs("tests.trainer.helpers:nope")
