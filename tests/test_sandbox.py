"""Hostile programs in the code sandbox: each scores 0, and the trainer process and the machine come out unharmed.

Root (as in CI) gets the strongest layers: a fresh uid, a network namespace and Landlock. The last test runs the
same hostile programs from an unprivileged user, where only Landlock and a user namespace are available.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kernels import sandbox
from grpo_kernels.sandbox import SandboxLimits, isolation, run_python, run_tests

LIMITS = SandboxLimits(timeout=30.0, cpu_seconds=20, memory_mb=256)  # what ends early: roomy, for a loaded machine
HANG = SandboxLimits(timeout=3.0, cpu_seconds=2, memory_mb=256)  # for programs that never end on their own
IS_ROOT = os.geteuid() == 0


def alive(pid: int) -> bool:
    status = sandbox._proc_status(str(pid))
    return bool(status) and not status.get("State", "").startswith("Z")


def assert_nothing_left(result):
    """No process of the sandbox's uid survives it (as root, where it ran under a uid of its own)."""
    if result.uid is not None:
        assert sandbox._pids_of_uid(result.uid) == []


def test_isolation_layers_on_this_machine():
    layers = isolation()
    assert layers["landlock_abi"] >= 0
    if IS_ROOT:
        assert layers["separate_uid"] and layers["network_namespace"], layers


def test_clean_program_and_tests():
    result = run_python("import math, json\nprint(json.dumps(math.factorial(5)))", limits=LIMITS)
    assert result.passed and result.stdout.strip() == "120" and not result.timed_out
    assert run_tests("def f(x):\n    return 2 * x", "assert f(21) == 42", limits=LIMITS).passed
    failed = run_tests("def f(x):\n    return x", "assert f(21) == 42", limits=LIMITS)
    assert not failed.passed and "AssertionError" in failed.stderr


@pytest.mark.parametrize(
    "exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()", "raise SystemExit"]
)
def test_leaving_before_the_tests_end_is_not_a_pass(exit_call):
    assert not run_tests(exit_call, "assert False", limits=LIMITS).passed


def test_writing_its_own_folder_is_allowed():
    result = run_python("open('out.txt', 'w').write('hi')\nprint(open('out.txt').read())", limits=LIMITS)
    assert result.passed and result.stdout.strip() == "hi"


@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"], ids=["busy", "sleep"])
def test_infinite_loop_is_killed(program):
    start = time.monotonic()
    result = run_python(program, limits=HANG)
    assert not result.passed and result.returncode == -signal.SIGKILL
    if "sleep" in program:
        assert result.timed_out  # no CPU used: only the wall clock can stop it
    # the busy loop meets RLIMIT_CPU first on an idle machine, the wall clock first on a loaded one
    assert time.monotonic() - start < HANG.timeout + 5
    assert_nothing_left(result)


@pytest.mark.parametrize(
    "program",
    ["x = bytearray(1 << 40)", "a = []\nwhile True:\n    a.append(bytearray(1 << 24))"],
    ids=["one-block", "growing"],
)
def test_memory_bomb_fails_inside_its_limit(program):
    result = run_python(program, limits=LIMITS)
    assert not result.passed and not result.timed_out and "MemoryError" in result.stderr


def test_fork_bomb_is_capped_and_cleaned_up():
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(program, limits=HANG)
    assert not result.passed
    assert_nothing_left(result)
    assert run_python("print(1)", limits=LIMITS).passed  # and the machine still runs programs for us


def test_escaped_daemon_is_killed():
    # A grandchild leaves the process group (setsid) and sleeps: the group kill can't see it, the uid sweep must.
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    print(os.getpid(), flush=True)\n"
        "    time.sleep(60)\n"
        "time.sleep(0.5)\n"
    )
    result = run_python(program, limits=LIMITS)
    pid = int(result.stdout.split()[0])
    if result.uid is None:
        pytest.skip("not root: the sandbox has no uid of its own to sweep (see the module docstring)")
    time.sleep(0.1)
    assert not alive(pid)
    assert_nothing_left(result)


def test_writes_outside_its_folder_fail(tmp_path):
    target = tmp_path / "open-to-all"
    target.mkdir()
    target.chmod(0o777)  # even a folder everyone may write to stays out of reach
    victims = [target / "pwned", Path("/tmp") / f"grpo-sandbox-pwned-{os.getpid()}", Path(__file__)]
    program = "\n".join(f"open({str(p)!r}, 'a').write('x')" for p in victims[:2])
    program += f"\nimport os\nos.utime({str(victims[2])!r})"
    before = victims[2].stat().st_mtime_ns
    result = run_python(program, limits=LIMITS)
    assert not result.passed
    for p in victims[:2]:
        assert not p.exists()
    assert victims[2].stat().st_mtime_ns == before
    for p in victims[:2]:  # each write on its own, so the first failure does not hide the second
        assert not run_python(f"open({str(p)!r}, 'w').write('x')", limits=LIMITS).passed and not p.exists()


def test_parent_environment_is_out_of_reach(monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_SECRET", "hunter2")
    assert not run_python(
        "import os\nassert 'GRPO_SANDBOX_SECRET' not in str(os.environ)\nassert 0", limits=LIMITS
    ).passed
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
            "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
            f"import os, signal\nos.kill({canary.pid}, signal.SIGKILL)",
            "import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(os.getppid(), 0)",  # everything it may signal
        ]:
            assert not run_python(program, limits=LIMITS).passed
        assert canary.poll() is None  # still running, and so are we
    finally:
        canary.kill()
        canary.wait()


def test_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        programs = [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            # around the patched socket module, straight to the kernel
            (
                "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
                f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\nassert fd >= 0 and libc.connect(fd, addr, 16) == 0"
            ),
        ]
        for program in programs:
            assert not run_python(program, limits=LIMITS).passed
        with pytest.raises(TimeoutError):
            server.accept()  # nobody got through
    finally:
        server.close()


def test_output_flood_is_cut():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=HANG)
    assert not result.passed and len(result.stdout) <= HANG.max_output_bytes


SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")


@pytest.mark.skipif(not IS_ROOT or SYSTEM_PYTHON is None, reason="needs root to become an unprivileged user")
def test_unprivileged_caller_gets_landlock_protection():
    # The sandbox module runs under the system interpreter as `nobody`, as it would for a non-root trainer.
    # The module's source travels in the script: `nobody` may not be able to read the checkout.
    script = (
        "import sys, types\n"
        "sb = types.ModuleType('sandbox'); sys.modules['sandbox'] = sb\n"
        f"exec(compile({Path(sandbox.__file__).read_text()!r}, 'sandbox.py', 'exec'), sb.__dict__)\n"
        "if not sb.isolation()['landlock_abi']:\n"
        "    print('SKIP'); sys.exit(0)\n"
        "L = sb.SandboxLimits(timeout=3, cpu_seconds=2, memory_mb=256)\n"
        "assert sb.run_python('print(1)', limits=L).passed\n"
        "hostile = ['import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)',\n"
        "           'import os\\nopen(f\"/proc/{os.getppid()}/environ\").read()',\n"
        '           \'open("/tmp/grpo-sandbox-nobody-pwned", "w")\',\n'
        "           'while True: pass',\n"
        "           'x = bytearray(1 << 40)']\n"
        "print(all(not sb.run_python(p, limits=L).passed for p in hostile))\n"
    )
    nobody = 65534
    out = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", script],
        user=nobody,
        group=nobody,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.stdout.strip() == "SKIP":
        pytest.skip("Landlock is not available on this kernel")
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr
    assert not os.path.exists("/tmp/grpo-sandbox-nobody-pwned")


def test_a_limit_that_cannot_apply_fails_the_run():
    impossible = SandboxLimits(timeout=10, max_open_files=2**40)  # above any kernel's hard cap on open files
    result = run_python("print(1)", limits=impossible)
    assert not result.passed and result.returncode == sandbox.SETUP_FAILED and "sandbox setup failed" in result.stderr
