"""Hostile programs in the code sandbox: each scores 0, and the trainer process and the machine come out unharmed.

Root (as in CI) gets every layer: a fresh uid, PID, mount and network namespaces, a private tmpfs, Landlock and
seccomp. `test_attacks` runs the attacks of `sandbox_attacks` both in-process (root, or whoever runs the suite) and,
where root can become one, as an unprivileged user; where a layer cannot apply there, the test asserts the weaker
guarantee `isolation()` states instead.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_kernels import sandbox
from grpo_kernels.rewards import code_reward
from grpo_kernels.sandbox import SandboxLimits, cleanup, isolation, plan, run_python, run_stdio, run_tests, runner
from grpo_kernels.sandbox.restrict import AUDIT_ARCH, SYSCALLS, seccomp_program
from tests import sandbox_attacks

LIMITS = SandboxLimits(timeout=30.0, cpu_seconds=20, memory_mb=256)  # what ends early: roomy, for a loaded machine
HANG = SandboxLimits(timeout=3.0, cpu_seconds=2, memory_mb=256)  # for programs that never end on their own
IS_ROOT = os.geteuid() == 0
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
SETPRIV = shutil.which("setpriv")


def test_isolation_layers_on_this_machine():
    layers = isolation()
    assert layers["landlock_abi"] >= 0
    if IS_ROOT:
        assert layers["separate_uid"] and layers["network_namespace"], layers
    if layers["pid_namespace"] and layers["mount_namespace"]:
        assert layers["cleanup"].startswith("PID namespace") and layers["disk"].startswith("a private tmpfs")
    assert layers["unix_sockets"].startswith("seccomp") == layers["seccomp"]


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


def as_nobody(script: str) -> subprocess.CompletedProcess:
    """Run `script` with the system interpreter as `nobody`, this package's sandbox and the attacks importable from
    a copy anyone can read (`nobody` may not read the checkout, nor pytest's temporary folders)."""
    folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-copy-"))
    try:
        shutil.copytree(Path(sandbox.__file__).parent, folder / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(sandbox_attacks.__file__, folder)
        for p in (folder, *folder.rglob("*")):
            p.chmod(0o755)
        prelude = f"import sys, json\nsys.path.insert(0, {str(folder)!r})\nimport sandbox, sandbox_attacks\n"
        nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"]
        return subprocess.run(
            [SETPRIV, *nobody, SYSTEM_PYTHON, "-I", "-c", prelude + script],
            cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder)


# As `nobody` where the kernel lets users make namespaces, and as `nobody` on a machine that would not (the plan
# made to lack them): the weakest sandbox, where the test holds it to the guarantees `isolation()` then states.
WITHOUT_NAMESPACES = (
    "from dataclasses import replace\n"
    "weak = replace(sandbox.runner._plan(), user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)\n"
    "sandbox.runner._probe_plan = lambda: weak\n"
)


@pytest.mark.parametrize("who", ["caller", "nobody", "nobody-without-namespaces"])
def test_attacks(who):
    token = f"{who[0]}{who[-1]}{os.getpid() % 10**6}"
    if who == "caller":
        layers, out = isolation(), sandbox_attacks.run_attacks(sandbox, token)
    else:
        if not IS_ROOT or SYSTEM_PYTHON is None or SETPRIV is None:
            pytest.skip("needs root, setpriv and a system python3 to become an unprivileged user")
        weak = who.endswith("without-namespaces")
        run = f"sandbox_attacks.run_attacks(sandbox, {token!r}, survivors={not weak})"  # a hopper would live on
        script = (WITHOUT_NAMESPACES if weak else "") + f"print(json.dumps([sandbox.isolation(), {run}]))"
        proc = as_nobody(script)
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
        assert not run_python(f"open({str(p)!r}, 'w').write('x')", limits=LIMITS).passed and not p.exists()
    before = Path(__file__).stat().st_mtime_ns
    assert not run_python(f"import os\nos.utime({__file__!r})", limits=LIMITS).passed
    assert Path(__file__).stat().st_mtime_ns == before


def test_parent_environment_is_out_of_reach(monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_SECRET", "hunter2")
    leaks = [
        "import os\nassert 'hunter2' in str(os.environ)",
        "import os\nassert b'hunter2' in open(f'/proc/{os.getppid()}/environ', 'rb').read()",
        f"assert b'hunter2' in open('/proc/{os.getpid()}/environ', 'rb').read()",
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
            f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\nassert fd >= 0 and libc.connect(fd, addr, 16) == 0"
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


WIRE_VALUES = [None, True, -(2**70), 1.5, math.inf, "é", b"\x00", [1, (2, 3)], {1: {"a": frozenset({2})}}, set()]


@pytest.mark.parametrize("value", WIRE_VALUES, ids=range(len(WIRE_VALUES)))
def test_wire_round_trip(value):
    back = sandbox.wire.decode(json.loads(json.dumps(sandbox.wire.encode(value))))
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
    with pytest.raises(sandbox.wire.NotPlain):
        sandbox.wire.decode(tree)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


NOT_PLAIN = [type("Int", (int,), {})(1), object(), [1, object()], 10**5000, nested(100)]


@pytest.mark.parametrize("value", NOT_PLAIN, ids=["int-subclass", "object", "inside-a-list", "5000-digits", "deep"])
def test_wire_refuses_what_is_not_plain(value):
    with pytest.raises(sandbox.wire.NotPlain):
        sandbox.wire.encode(value)


@pytest.mark.parametrize("layer", ["seccomp", "mount_namespace"])
def test_each_layer_alone_keeps_local_sockets_out_of_reach(layer):
    plan = runner._plan()
    if not getattr(plan, {"seccomp": "seccomp", "mount_namespace": "mount_ns"}[layer]):
        pytest.skip(f"{layer} is not available on this machine")
    alone = {
        "seccomp": replace(plan, landlock_abi=0, user_ns=False, pid_ns=False, mount_ns=False, net_ns=False),
        "mount_namespace": replace(plan, landlock_abi=0, seccomp=False),  # /tmp is the sample's own tmpfs
    }[layer]
    listeners = sandbox_attacks.UnixListeners(f"l{layer[0]}{os.getpid()}")
    try:
        result = runner._run(alone, sandbox_attacks.unix_program(listeners.path), LIMITS)
        assert not result.passed and "AssertionError" in result.stderr
        assert listeners.accepted() == 0
        # the same program reaches it with neither layer: the test can fail
        neither = replace(alone, seccomp=False, user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)
        assert runner._run(neither, sandbox_attacks.unix_program(listeners.path), LIMITS).passed
        assert listeners.accepted() == 1
    finally:
        listeners.close()


@pytest.mark.skipif(not IS_ROOT, reason="the uid sweep needs a uid of the sample's own")
@pytest.mark.parametrize("kind", ["hopper", "daemon"])
def test_without_a_pid_namespace_the_uid_sweep_kills_everything(kind):
    # the fallback where no PID namespace can be made: kill(-1) as the sample's uid until none of its processes lives
    plan = replace(runner._plan(), user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)
    marker = f"w{kind[0]}{os.getpid() % 10**6}"
    try:
        result = runner._run(plan, sandbox_attacks.survivor_program(marker, kind), LIMITS)
        assert result.passed and result.uid is not None  # it ran, and left its processes behind it
        assert sandbox_attacks.marked_processes(marker) == []
        time.sleep(1)
        assert sandbox_attacks.marked_processes(marker) == []
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_wire_reader_frames_and_refuses():
    r, w = os.pipe()
    try:
        reader = sandbox.wire.Reader(r)
        sandbox.wire.send(w, {"a": 1})
        os.write(w, b'{"b": [2]}\n[1, 2]\n{"c"')
        assert reader.receive() == {"a": 1} and reader.receive() == {"b": [2]}
        with pytest.raises(sandbox.wire.NotPlain, match="malformed message"):
            reader.receive()  # a JSON list, not an object
        os.write(w, b": 3}\n" + b"[" * 5000 + b"\n")  # under a pipe buffer: nobody reads yet
        assert reader.receive() == {"c": 3}
        with pytest.raises(sandbox.wire.NotPlain):
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
        for use in (bool, lambda x: x == 0, lambda x: 0 != x, lambda x: x in [0]):
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
        time.sleep(0.3)
        assert sandbox_attacks.marked_processes(marker)
        cleanup.kill_cgroup(folder)
        proc.wait()
        assert Path(folder, "cgroup.procs").read_text() == "" and sandbox_attacks.marked_processes(marker) == []
    finally:
        for pid in sandbox_attacks.marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
        plan.remove_cgroup(folder)
    assert not os.path.exists(folder)
