"""The rule-based rewards: format (strict, lenient, custom tags), accuracy (math-verify), code,
and their combination."""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

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


# ----------------------------------------------------------------------------------------------------------------
# code: what the judge compares. Each case is (solution, tests, setup, numpy needed, reward); every case of a table runs
# in one batch, as the caller (root in CI) and as `nobody` with and without namespaces.

LIST_NODE = (
    "class ListNode:\n    def __init__(self, val=0, next=None):\n        self.val = val\n        self.next = next\n"
    "    def __eq__(self, other):\n        return isinstance(other, ListNode) and values(self) == values(other)\n"
)
TREE_NODE = (
    "class TreeNode:\n    def __init__(self, val=0, left=None, right=None):\n"
    "        self.val, self.left, self.right = val, left, right\n"
)
LEETCODE = (  # a LeetCode prompt as the trusted setup: the node classes, helpers, and `class Solution:` only declared
    "from typing import List, Optional\n" + LIST_NODE + TREE_NODE
    + "def build(xs):\n    head = None\n    for x in reversed(xs):\n        head = ListNode(x, head)\n    return head\n"
    "def values(node):\n    out = []\n    while node:\n        out.append(node.val)\n        node = node.next\n"
    "    return out\n"
    "class Solution:\n    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:\n        ...\n"
    "    def maxDepth(self, root: Optional[TreeNode]) -> int:\n        pass\n"
)  # fmt: skip
REVERSE = (  # uses the setup's classes and typing names, which it never defines
    "class Solution:\n    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:\n"
    "        prev = None\n        while head:\n            head.next, prev, head = prev, head, head.next\n"
    "        return prev\n"
    "    def maxDepth(self, root: Optional[TreeNode]) -> int:\n"
    "        return 0 if root is None else 1 + max(self.maxDepth(root.left), self.maxDepth(root.right))\n"
)
LEETCODE_TESTS = (
    "assert values(Solution().reverseList(build([1, 2, 3]))) == [3, 2, 1]\n"
    "assert Solution().reverseList(build(list(range(3000)))) == build(list(range(2999, -1, -1)))\n"  # a long chain
    "assert Solution().reverseList(None) is None\n"
    "assert Solution().maxDepth(TreeNode(1, TreeNode(2, TreeNode(3)), TreeNode(4))) == 3\n"
)
CYCLE = (  # a cyclic list both ways: passed in, and made and returned by the solution
    "def has_cycle(head):\n    slow = fast = head\n    while fast and fast.next:\n"
    "        slow, fast = slow.next, fast.next.next\n        if slow is fast:\n            return True\n"
    "    return False\n"
    "def ring():\n    a = ListNode(1, ListNode(2))\n    a.next.next = a\n    return a\n"
)
CYCLE_TESTS = (
    "a = build([1, 2, 3])\na.next.next.next = a\nassert has_cycle(a) and not has_cycle(build([1, 2]))\n"
    "b = ring()\nassert type(b) is ListNode and b.next.next is b and b.next.val == 2\n"
)
TWICE = (  # builds nodes of its own class, named as the tests' class
    "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
    "def twice(head):\n    return Node(head.val, Node(head.val)) if head else None\n"
)
OWN_NODE_TESTS = (  # a node class of the tests' own, walked with `while node:`
    "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
    "def values(node):\n    out = []\n    while node:\n        out.append(node.val)\n        node = node.next\n"
    "    return out\n"
    "if 'second' in globals():\n    assert values(second(Node(1, Node(2, Node(3))))) == [2, 3]\n"
    "if 'twice' in globals():\n    assert values(twice(Node(7))) == [7, 7] and type(twice(Node(1))) is Node\n"
)
ADD_TESTS = "if add(2, 3) != 5: exit(1)\nif add(1, 1) != 2: quit(1)\n"
UNITTEST = (
    "import unittest\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)
WRONG_ADD = "def add(a, b):\n    return a - b\n"
COLLECTIONS = (
    "from collections import Counter, OrderedDict, defaultdict, namedtuple\nPoint = namedtuple('Point', 'x y')\n"
    "def f():\n    d = defaultdict(list)\n    d['a'].append(1)\n"
    "    return Counter('abca'), d, OrderedDict(b=2, a=1), Point(1, 2)\n"
)
COLLECTIONS_TESTS = (
    "c, d, o, p = f()\n"
    "assert c == collections.Counter('abca') and type(c) is collections.Counter and c.most_common(1) == [('a', 2)]\n"
    "assert d == {'a': [1]} and d['new'] == [] and type(o) is collections.OrderedDict and list(o) == ['b', 'a']\n"
    "assert p == (1, 2) and p.x == 1 and p._fields == ('x', 'y')\n"
)
NUMBERS = (
    "import math\nfrom decimal import Decimal\nfrom fractions import Fraction\n"
    "def f():\n    return 1 + 2j, Fraction(1, 3), Decimal('1.10'), range(2, 9, 3)\n"
    "def big(n):\n    return math.factorial(n)\ndef last_digits(n):\n    return n % 10**6\n"
)
NUMBERS_TESTS = (
    "assert f() == (1 + 2j, fractions.Fraction(1, 3), decimal.Decimal('1.10'), range(2, 9, 3))\n"
    "assert str(f()[2]) == '1.10'\nassert big(2000) == math.factorial(2000)\n"  # 5736 digits, back
    "assert last_digits(math.factorial(2000) + 7) == 7\n"  # and there
)
ITERATORS = (
    "def gen(n):\n    yield from range(n)\ndef mapped():\n    return map(str, range(3))\n"
    "def keys():\n    return {1: 'a', 3: 'b'}.keys()\ndef naturals():\n    n = 0\n    while True:\n        yield n\n"
    "        n += 1\ndef broken():\n    yield 1\n    raise ValueError('after one')\n"
)
ITERATORS_TESTS = (
    "assert list(gen(100_000)) == list(range(100_000))\nassert list(mapped()) == ['0', '1', '2']\n"
    "assert keys() == {1, 3}\nit = naturals()\nassert [next(it) for _ in range(3)] == [0, 1, 2]\n"
    "assert sum(x for x, _ in zip(naturals(), range(1000))) == 499500\n"  # past the first chunk of an endless one
    "b = broken()\nassert next(b) == 1\n"
    "try:\n    next(b)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError\n"
)
NUMPY = (
    "import numpy as np\ndef double(a):\n    return np.asarray(a) * 2\n"
    "def scalars():\n    return np.float64(1.5), np.int32(3)\n"
)
NUMPY_TESTS = (
    "assert np.array_equal(double(np.arange(4)), np.array([0, 2, 4, 6]))\n"
    "x, y = scalars()\nassert isinstance(x, np.float64) and x == 1.5 and y.dtype == np.int32\n"
)
ISCLOSE = "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\n"
ODD_ITERATOR = (  # a module-level object that looks like an iterator but whose __iter__ raises: it stays a proxy
    "class Odd:\n    def __next__(self):\n        return 1\n    def __iter__(self):\n        raise ValueError\n"
    "odd = Odd()\n"
)
MATH_CLASS = "class math:\n    isclose = lambda *a, **k: True\ndef area(r):\n    return 1.0\n"
FAKE_COUNTER = (  # a dict subclass that claims to be collections.Counter, equal to everything
    "class Counter(dict):\n    __module__ = 'collections'\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = None\ndef f():\n    return Counter()\n"
)
FAKE_NAMEDTUPLE = (
    "class P(tuple):\n    _fields = ('x',)\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = tuple.__hash__\ndef f():\n    return P((0,))\n"
)
WRONG_REVERSE = "class Solution:\n    def reverseList(self, head):\n        return head\n"

OWN_MODULE = (
    "import inspect, os, pickle\nclass Point:\n    def __init__(self, x):\n        self.x = x\n"
    "def source_lines():\n    return len(inspect.getsource(source_lines).splitlines())\n"
    "def file_name():\n    return os.path.basename(__file__)\n"
    "def round_trip(x):\n    return pickle.loads(pickle.dumps(Point(x))).x\n"
)
OWN_MODULE_TESTS = "assert source_lines() == 2\nassert file_name() == 'solution.py'\nassert round_trip(7) == 7\n"

JUDGED = {
    # names the tests use: standard modules and builtins are the judge's own, whatever the solution binds
    "math-class": (MATH_CLASS, ISCLOSE, None, False, 0),
    "math-namespace": (
        "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\ndef area(r):\n    return 1.0\n",
        ISCLOSE, None, False, 0,
    ),
    "sys-namespace": (
        "import types\nsys = types.SimpleNamespace(exit=print)\n" + WRONG_ADD,
        "import unittest\nif add(2, 3) != 5:\n    sys.exit(1)\n", None, False, 0,
    ),
    "exit-def": ("def exit(*a):\n    pass\ndef quit(*a):\n    pass\n" + WRONG_ADD, ADD_TESTS, None, False, 0),
    "np-class": (
        "class np:\n    allclose = staticmethod(lambda *a, **k: True)\ndef f():\n    return [0.0]\n",
        "assert np.allclose(f(), [1.0])\n", None, False, 0,
    ),
    "math-unimported": ("def area(r):\n    return 3.14159265 * r * r\n", ISCLOSE, None, False, 1),
    "math-imported": ("import math\ndef area(r):\n    return math.pi * r * r\n", ISCLOSE, None, False, 1),
    "exit-quit": ("def add(a, b):\n    return a + b\n", ADD_TESTS, None, False, 1),
    "copy-function": ("def copy(xs):\n    return list(xs)\n", "assert copy((1, 2)) == [1, 2]\n", None, False, 1),
    # annotations evaluated at once, as python does, in the solution and in the tests (the launcher's and the judge's
    # own `from __future__ import annotations` once reached both: they were strings)
    "annotations": (
        "def kinds(x: int) -> str:\n    return [type(v).__name__ for v in kinds.__annotations__.values()]\n",
        "def g(y: int):\n    pass\nassert g.__annotations__['y'] is int\nassert kinds(0) == ['type', 'type']\n",
        None, False, 1,
    ),
    "numpy-as-np": (NUMPY, NUMPY_TESTS, None, True, 1),
    # values rebuilt from trusted types
    "collections": (COLLECTIONS, COLLECTIONS_TESTS, None, False, 1),
    "numbers-and-big-ints": (NUMBERS, NUMBERS_TESTS, None, False, 1),
    "iterators": (ITERATORS, ITERATORS_TESTS, None, False, 1),
    "iterator-of-objects": ("def f():\n    return (object() for _ in range(3))\n", "list(f())\n", None, False, 0),
    "odd-iterator-beside": (ODD_ITERATOR + "def add(a, b):\n    return a + b\n", ADD_TESTS, None, False, 1),
    "fake-counter": (FAKE_COUNTER, "assert f() == {'a': 1}\n", None, False, 0),  # only its items cross
    "fake-namedtuple": (FAKE_NAMEDTUPLE, "assert f() == (1,)\n", None, False, 0),
    # the setup's classes cross by their fields; what it only declares is the solution's
    "leetcode": (REVERSE, LEETCODE_TESTS, LEETCODE, False, 1),
    "leetcode-wrong": (WRONG_REVERSE, LEETCODE_TESTS, LEETCODE, False, 0),
    "leetcode-rigged-node": (  # its own ListNode, equal to everything, and a wrong answer: rebuilt as the setup's
        LIST_NODE.replace("return isinstance(other, ListNode) and values(self) == values(other)", "return True")
        + "class Solution:\n    def reverseList(self, head):\n        return ListNode(0)\n",
        "assert Solution().reverseList(build([1, 2])) == build([2, 1])\n", LEETCODE, False, 0,
    ),
    "leetcode-no-solution": ("def helper():\n    return 1\n", "Solution()\n", LEETCODE, False, 0),
    "cycle": (CYCLE, CYCLE_TESTS, LEETCODE, False, 1),
    # the tests' own classes cross the same way: as a bare class of the name there, or the solution's own
    "tests-own-node": ("def second(head):\n    return head.next\n", OWN_NODE_TESTS, None, False, 1),
    "tests-own-node-made-there": (TWICE, OWN_NODE_TESTS, None, False, 1),
    # the solution is a module of its own, as `python solution.py` would run it
    "own-module": (OWN_MODULE, OWN_MODULE_TESTS, None, False, 1),
    # unittest-style tests
    "unittest-main": ("def add(a, b):\n    return a + b\n", UNITTEST + "unittest.main()\n", None, False, 1),
    "unittest-main-wrong": (WRONG_ADD, UNITTEST + "if __name__ == '__main__':\n    unittest.main()\n", None, False, 0),
    "testcase-only": ("def add(a, b):\n    return a + b\n", UNITTEST, None, False, 1),
    "testcase-only-wrong": (WRONG_ADD, UNITTEST, None, False, 0),
}  # fmt: skip

LARGE = {  # crossing fast, and messages up to 64 MiB
    "million-ints": (
        "def count(n):\n    return list(range(n))\ndef backwards(xs):\n    return xs[::-1]\n",
        "xs = count(10**6)\nassert xs == list(range(10**6))\nassert backwards(xs) == xs[::-1]\n", None, False, 1,
    ),
    "million-floats-and-strs": (
        "def f(n):\n    return [i / 2 for i in range(n)], [str(i) for i in range(n)]\n",
        "a, b = f(10**6)\nassert a == [i / 2 for i in range(10**6)] and b == [str(i) for i in range(10**6)]\n",
        None, False, 1,
    ),
    "64MiB-message": ("def f(n):\n    return b'y' * n\n", "n = 48 * 2**20\nassert f(n) == b'y' * n\n", None, False, 1),
    "20MB-str": ("def f(n):\n    return 'x' * n\n", "assert f(20_000_000) == 'x' * 20_000_000\n", None, False, 1),
}  # fmt: skip

NUMPY_SHOWN = None


def numpy_can_be_shown() -> bool:
    """Whether the sandbox can show this interpreter's numpy (not under a folder a sample gets an empty one of)."""
    import os

    import numpy

    from grpo_kernels.sandbox import view

    home = os.path.realpath(os.path.dirname(numpy.__file__))
    return not any(home == f or home.startswith(f + os.sep) for f in view.SAMPLE_OWN)


def judged(table: dict, who: str, timeout: float) -> dict:
    """The reward of each case of `table` as `who` (caller, nobody, nobody-without-namespaces) scores it: the
    caller through `code_reward`, `nobody` through the sandbox it can import (its interpreter has no numpy: the
    cases that need numpy are left out there)."""
    if who == "caller":
        numpy = numpy_can_be_shown()
        names = [k for k, case in table.items() if numpy or not case[3]]
        rows = [table[k] for k in names]
        rewards = code_reward(
            [fenced(r[0]) for r in rows], tests=[r[1] for r in rows], test_setup=[r[2] for r in rows],
            packages=["numpy"] if numpy else [], timeout=timeout, max_workers=4,
        )  # fmt: skip
        return dict(zip(names, rewards))
    if not sandbox_attacks.can_become_nobody():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
    names = [k for k, case in table.items() if not case[3]]
    script = (sandbox_attacks.WITHOUT_NAMESPACES if who.endswith("without-namespaces") else "") + (
        "from concurrent.futures import ThreadPoolExecutor\n"
        f"limits = sandbox.SandboxLimits(timeout={timeout}, cpu_seconds={int(timeout)})\n"
        "def score(case):\n"
        "    return sandbox.run_tests(case[0], case[1], setup=case[2], limits=limits).passed\n"
        "with ThreadPoolExecutor(4) as pool:\n"
        "    print(json.dumps([sandbox.isolation()['user_namespace'], list(pool.map(score, DATA))]))\n"
    )
    proc = sandbox_attacks.as_nobody(script, data=[table[k] for k in names], timeout=600)
    assert proc.returncode == 0, proc.stderr
    namespaces, passed = json.loads(proc.stdout.splitlines()[-1])
    assert namespaces is not who.endswith("without-namespaces")
    return {k: float(p) for k, p in zip(names, passed)}


WHO = ["caller", "nobody", "nobody-without-namespaces"]


@pytest.mark.parametrize("who", WHO)
def test_the_judge_scores_names_values_and_unittest_as_python_does(who):
    rewards = judged(JUDGED, who, timeout=60.0)
    expected = {k: float(JUDGED[k][4]) for k in rewards}
    assert {k: r for k, r in rewards.items() if r != expected[k]} == {}
    assert len(rewards) >= len(JUDGED) - 1  # only the numpy case may be left out


@pytest.mark.parametrize("who", WHO)
def test_large_values_cross_whole(who):
    rewards = judged(LARGE, who, timeout=60.0)
    assert rewards == dict.fromkeys(LARGE, 1.0)


# Raw replies written past the wire's own encoder, as a solution can: 16 MiB of tiny arrays (a judge that parsed them
# peaked at 336-513 MiB), then 60 MiB of short strings, under the message size and the arrays' count but far over
# what the judge may take to rebuild one reply.
RAW_REPLY = (
    "import os, sys\n"
    "def send(fd, message):\n"
    "    view = memoryview(payload())\n    while view:\n        view = view[os.write(fd, view):]\n"
    "def add(a, b):\n    sys.modules['wire'].send = send\n    return a + b\n"
)
TINY_ARRAYS = 'def payload():\n    return b\'{"ok":["l",[\' + b\'["n"],\' * (16 * 2**20 // 6) + b\'["n"]]]}\\n\'\n'
SHORT_STRINGS = 'def payload():\n    return b\'{"ok":["ls",[\' + b\'"ab",\' * (60 * 2**20 // 5) + b\'"ab"]]}\\n\'\n'
PEAKS = (  # the largest resident size of any process the runs started (the judge's, here), after each
    "import resource\npeaks = []\n"
    "for payload in DATA[1:]:\n"
    "    limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30, memory_mb=512)\n"
    "    result = sandbox.run_tests(payload + DATA[0], 'assert add(2, 3) == 5', limits=limits)\n"
    "    peaks.append([result.passed, result.stderr[-300:], resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss])\n"
    "print(json.dumps(peaks))\n"
)


def as_caller(script: str, data: object) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter of the caller's that imports the sandbox alone (not the package, and so not
    torch, whose pages would count in every child's peak), `data` as its `DATA`."""
    import grpo_kernels.sandbox

    with tempfile.TemporaryDirectory() as folder:
        shutil.copytree(os.path.dirname(grpo_kernels.sandbox.__file__), os.path.join(folder, "sandbox"))
        prelude = f"import sys, json\nsys.path.insert(0, {folder!r})\nimport sandbox\nDATA = {data!r}\n"
        return subprocess.run(
            [sys.executable, "-I", "-c", prelude + script], capture_output=True, text=True, timeout=300, check=False
        )


@pytest.mark.parametrize("who", WHO)
def test_the_judge_holds_a_bounded_amount_of_a_reply(who):
    from grpo_kernels.sandbox import judge

    data = [RAW_REPLY, TINY_ARRAYS, SHORT_STRINGS]
    if who == "caller":
        proc = as_caller(PEAKS, data)
    elif not sandbox_attacks.can_become_nobody():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
    else:
        weak = sandbox_attacks.WITHOUT_NAMESPACES if who.endswith("without-namespaces") else ""
        proc = sandbox_attacks.as_nobody(weak + PEAKS, data=data, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (tiny_passed, tiny_error, tiny_peak), (short_passed, short_error, short_peak) = json.loads(proc.stdout)
    assert not tiny_passed and "arrays and objects" in tiny_error  # refused before it was parsed
    assert tiny_peak < 100 * 2**10  # KiB: the 16 MiB it read, twice, and the interpreter
    assert not short_passed and "MiB to rebuild" in short_error
    assert short_peak < (judge.REPLY_BUDGET >> 10) + 64 * 2**10


# The wire and the name rule, in-process: what each type is rebuilt as, and what is refused


def _round_trip(value, classes=None):
    from grpo_kernels.sandbox import wire

    return wire.decode(json.loads(wire.dumps(wire.encode(value, classes))), classes)


def test_wire_rebuilds_each_type_as_its_own():
    import collections
    import decimal
    import fractions

    import numpy as np

    point = collections.namedtuple("Point", "x y")
    values = [
        collections.Counter("abca"), collections.defaultdict(list, a=[1]), collections.OrderedDict(b=1, a=2),
        point(1, 2), 1 - 2.5j, fractions.Fraction(-1, 3), decimal.Decimal("-1.10"), range(5, -3, -2),
        math.factorial(2000), -(2**5000), list(range(-5, 100)), [0.5, -0.0, math.inf] * 3, ["é", ""] * 5,
        [True] * 9, [2**64] * 9, np.float32(1.5), np.int8(-3), np.bool_(True), np.datetime64("2024-01-02"),
    ]  # fmt: skip
    for value in values:
        back = _round_trip(value)
        assert back == value and type(back).__name__ == type(value).__name__, value
    assert type(_round_trip(collections.defaultdict(list))["new"]) is list  # the factory crosses
    assert str(_round_trip(decimal.Decimal("1.10"))) == "1.10" and math.copysign(1, _round_trip([-0.0] * 9)[0]) < 0
    for array in (np.arange(12, dtype=np.int16).reshape(3, 4)[:, 1:], np.array(["ab", "c"]), np.zeros((0, 2))):
        back = _round_trip(array)
        assert type(back) is np.ndarray and back.dtype == array.dtype and np.array_equal(back, array)
    keys, items = _round_trip({1: 2}.keys()), _round_trip({1: 2}.items())
    assert keys == {1} and type(keys) is type({}.keys()) and items == {(1, 2)} and type(items) is type({}.items())


class Node:
    def __init__(self, val, next=None):
        self.val, self.next = val, next


def test_wire_rebuilds_named_classes_by_their_fields():
    ring = Node(1, Node(2))
    ring.next.next = ring
    back = _round_trip(ring, {"Node": Node})
    assert type(back) is Node and back.next.next is back and back.next.val == 2  # cycles
    chain = None
    for i in range(2_000):  # far past the nesting limit: the objects cross as a table
        chain = Node(i, chain)
    back = _round_trip([chain, chain], {"Node": Node})
    assert back[0] is back[1] and back[0].val == 1_999 and back[0].next.next.val == 1_997


@pytest.mark.parametrize(
    "tree",
    [
        ["G", ["o", 0], [["Evil", {}]]],  # a class the receiver does not name
        ["G", ["o", 1], [["Node", {}]]],  # a reference past the table
        ["G", ["o", 0], [["Node", {"__class__": ["n"]}]]],  # a dunder field
        ["N", "P", ["x", "def"], [["n"], ["n"]]],  # a field namedtuple refuses
        ["N", "P", ["x"], []],  # a wrong arity
        ["A", "|O8", [1], "AAAAAAAAAAA="],  # numpy objects
        ["A", "<i8", [2], "AAAAAAAAAAA="],  # bytes for one item, shape for two
        ["q", "AAA="],  # not whole int64s
        ["x", "12"],  # hex without its prefix
        ["ls", ["a", 1]],  # a packed list of strings with a number in it
        ["D", "eval", []],  # a factory that is not a builtin type
        ["r", ["f", "1.0"], ["i", "2"], ["i", "1"]],  # a range of a float
        ["M", "1" * 20_000],
        ["I", ["l", []], ["n"]],  # an iterator inside a value: only a reply may be one
    ],
)
def test_wire_refuses_malformed_rebuilds(tree):
    from grpo_kernels.sandbox import wire

    with pytest.raises(wire.NotPlain):
        wire.decode(tree, {"Node": Node})


def test_name_rule():
    from grpo_kernels.sandbox import judge

    read, bases = judge.uses(["assert math.isclose(f(), 1)\ncopy(x)\nre", "np.array([1])"])
    assert {"math", "copy", "re", "np", "f", "x"} <= read and bases == {"math", "np"}
    scope: dict = {}
    lent = judge.lend_modules(scope, ["math.pi\ncopy(x)\nre\njson(1)", ""], solution={"math", "copy", "json"})
    assert lent == {"math", "re"} and scope["math"] is math  # copy and json are only called: the solution's
    assert judge.declared_only(LEETCODE) == {"Solution"}
    assert judge.setup_classes(LEETCODE)[0] == ["ListNode", "TreeNode"]


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
