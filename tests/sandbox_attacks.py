"""Attacks on the code sandbox, as a policy optimizing the code reward would find them; stdlib only.

Each attack is the solution to a task whose correct `add` returns a + b, written so that it passes only if the attack
works (or, for the process and resource attacks, so that the damage is measurable). `run_attacks` runs them all
through a sandbox module given as an argument, so the same attacks run in-process as root and, copied to a folder
anyone can read, from a script as an unprivileged user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"
HONEST = "def add(a, b):\n    return a + b\n"

FORGERIES = {
    # print the success nonce the launcher kept in its globals, then leave before the tests run
    "nonce": (
        "import os, sys\nprint('\\n' + str(getattr(sys.modules['__main__'], 'nonce', '')), flush=True)\nos._exit(0)\n"
    ),
    # delete the tests from the launcher's list of units to run
    "delete-tests": (
        "import sys\n"
        "try:\n    sys.modules['__main__'].units[1:] = []\nexcept Exception:\n    pass\n"
        "def add(a, b):\n    return 0\n"
    ),
    # make every later compile() (the tests') compile to `pass`
    "patch-compile": (
        "import builtins\n_compile = builtins.compile\n"
        "builtins.compile = lambda source, filename, *a, **k: _compile('pass', filename, *a, **k)\n"
        "def add(a, b):\n    return 0\n"
    ),
    # find the tests' source anywhere on the call stack and answer from it
    "read-tests": (
        "import re, sys\nfound = {}\n"
        "def strings(obj, depth=0):\n"
        "    if isinstance(obj, str):\n        yield obj\n"
        "    elif depth < 4 and isinstance(obj, (list, tuple)):\n"
        "        for x in obj:\n            yield from strings(x, depth + 1)\n"
        "    elif depth < 4 and isinstance(obj, dict):\n"
        "        for x in list(obj.values()):\n            yield from strings(x, depth + 1)\n"
        "frame = sys._getframe()\n"
        "while frame is not None:\n"
        "    for text in [*strings(frame.f_globals), *strings(frame.f_locals)]:\n"
        "        for a, b, r in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', text):\n"
        "            found[int(a), int(b)] = int(r)\n"
        "    frame = frame.f_back\n"
        "def add(a, b):\n    return found.get((a, b), 0)\n"
    ),
    # a result equal to everything
    "rigged-eq": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()\n"
    ),
    # the same through a subclass of a plain type
    "rigged-int": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(0)\n",
}


# setsid, then a process group of its own where setsid left it in the sample's (the sandbox makes it a no-op)
LEAVE_GROUP = "    os.setsid()\n    if os.getpgid(0) != os.getpid():\n        os.setpgid(0, 0)\n"


def survivor_program(marker: str, kind: str) -> str:
    """A solution that leaves processes named `marker` behind: a fork hopper or a setsid daemon."""
    head = f"import ctypes, os, time\nctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
    if kind == "hopper":  # forks and exits continuously: a snapshot of its pids is stale at once
        body = (
            "if os.fork() == 0:\n    while True:\n        try:\n            if os.fork():\n"
            "                os._exit(0)\n        except OSError:\n            pass\n"
        )
    else:  # leaves the session (where setsid works) and the process group, then sleeps
        body = "if os.fork() == 0:\n" + LEAVE_GROUP
        body += "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
    return head + body + "time.sleep(0.5)\ndef add(a, b):\n    return 0\n"


def marked_processes(marker: str) -> list[int]:
    """Pids whose name (/proc/PID/comm) is `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == marker[:15]:
                    with open(f"/proc/{pid}/stat") as g:
                        if g.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(pid))
        except OSError:
            pass
    return pids


def unix_program(address: str) -> str:
    """A solution that is right only once it has reached a local socket at `address` (a NUL first: abstract);
    straight through the C library, around anything done to Python's socket module."""
    return (
        "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(1, 1, 0)\n"  # AF_UNIX, SOCK_STREAM
        f"path = {address.encode()!r}\n"
        "addr = struct.pack('H108s', 1, path)\n"
        "size = 2 + len(path) + (0 if path[:1] == b'\\0' else 1)\n"
        "assert fd >= 0 and libc.connect(fd, addr, size) == 0, ctypes.get_errno()\n" + HONEST
    )


def memory_bomb(children: int = 6, mb: int = 100) -> str:
    """Each child holds `mb` (touched) under its own address-space limit; together they hold children × mb."""
    return (
        "import os, time\nkids = []\n"
        f"for _ in range({children}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        block = b'x' * ({mb} * 2**20)\n"
        "        time.sleep(2)\n        os._exit(0)\n"
        "    kids.append(pid)\n"
        "for pid in kids:\n    os.waitpid(pid, 0)\n" + HONEST
    )


def disk_filler(total_mb: int = 256) -> str:
    """Writes 16 MB files in its folder up to `total_mb`, prints how many bytes it wrote."""
    return (
        "written = 0\ntry:\n"
        f"    while written < {total_mb} * 2**20:\n"
        "        with open(f'f{written}', 'wb') as f:\n            f.write(b'x' * 2**24)\n"
        "        written += 2**24\nexcept OSError:\n    pass\n"
        "print(written)\ndef add(a, b):\n    return 0\n"
    )


class UnixListeners:
    """A world-writable pathname socket in /tmp and an abstract one, counting who connects."""

    def __init__(self, token: str) -> None:
        self.path = f"/tmp/grpo-unix-{token}.sock"
        self.abstract = f"\0grpo-unix-{token}"
        self.servers = []
        for address in (self.path, self.abstract):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(address)
            server.listen(4)
            server.setblocking(False)
            self.servers.append(server)
        os.chmod(self.path, 0o777)

    def accepted(self) -> int:
        count = 0
        for server in self.servers:
            try:
                while True:
                    server.accept()[0].close()
                    count += 1
            except BlockingIOError:
                pass
        return count

    def close(self) -> None:
        for server in self.servers:
            server.close()
        os.unlink(self.path)


def run_attacks(sandbox: Any, token: str, workers: int = 4, survivors: bool = True) -> dict[str, Any]:
    """Every attack through `sandbox.run_tests` (concurrently); what each scored, and what it left behind.
    `survivors=False` leaves out the hopper and the daemon, for a sandbox known to let them live on."""
    limits = sandbox.SandboxLimits(timeout=20, cpu_seconds=10, memory_mb=256)
    listeners = UnixListeners(token)
    markers = {kind: f"m{kind[0]}{token}"[:15] for kind in ("hopper", "daemon")}
    jobs = {name: (src, TESTS) for name, src in FORGERIES.items()}
    if survivors:
        jobs |= {kind: (survivor_program(m, kind), TESTS) for kind, m in markers.items()}
    jobs |= {
        "unix-path": (unix_program(listeners.path), TESTS),
        "unix-abstract": (unix_program(listeners.abstract), TESTS),
    }
    jobs["memory-bomb"] = (memory_bomb(), TESTS)
    jobs["disk-filler"] = (disk_filler(), TESTS)
    jobs["honest"] = (HONEST, TESTS)
    try:
        with ThreadPoolExecutor(workers) as pool:
            results = dict(zip(jobs, pool.map(lambda job: sandbox.run_tests(*job, limits=limits), jobs.values())))
        out: dict[str, Any] = {name: r.passed for name, r in results.items()}
        out["memory-bomb-limit"] = getattr(results["memory-bomb"], "limit", None)
        out["unix-accepted"] = listeners.accepted()
    finally:
        listeners.close()
    if survivors:
        out["survivors-at-return"] = sum(len(marked_processes(m)) for m in markers.values())
        time.sleep(5)
        out["survivors-after-5s"] = sum(len(marked_processes(m)) for m in markers.values())
    filler = sandbox.run_python(disk_filler(), limits=limits)
    out["disk-written"] = int(filler.stdout.split()[0]) if filler.stdout.split() else None
    for pid in marked_processes(markers["hopper"]) + marked_processes(markers["daemon"]):
        try:
            os.kill(pid, 9)  # what the old sandbox left: don't let it run on
        except OSError:
            pass
    return out


# ----------------------------------------------------------------------------------------------------------------
# Honest code the sandbox must not fail, beside code that uses what a sample may


def holder_program(children: int = 15, seconds: float = 2.0) -> str:
    """A correct solution that keeps `children` processes alive (its own plus those: max_processes) for `seconds`."""
    return (
        "import os, time\n"
        f"for _ in range({children}):\n"
        "    if os.fork() == 0:\n"
        f"        time.sleep({seconds})\n"
        "        os._exit(0)\n" + HONEST
    )


def run_beside_holders(sandbox: Any, honest: int = 64, holders: int = 8, workers: int = 8) -> dict[str, Any]:
    """`honest` honest samples at `workers` at a time (as `code_reward(..., max_workers=8)` runs them) while, in a pool
    of their own, rounds of `holders` correct samples each keep 15 processes alive, until the honest ones are done."""
    limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30, memory_mb=256)
    done = threading.Event()
    held: list[bool] = []

    def hold() -> None:
        with ThreadPoolExecutor(holders) as pool:
            while not done.is_set():
                held.extend(pool.map(lambda _: sandbox.run_tests(holder_program(), TESTS, limits=limits).passed,
                                     range(holders)))  # fmt: skip

    holding = threading.Thread(target=hold)
    holding.start()
    try:
        time.sleep(0.5)  # the first round is forking by now
        with ThreadPoolExecutor(workers) as pool:
            passed = list(pool.map(lambda _: sandbox.run_tests(HONEST, TESTS, limits=limits).passed, range(honest)))
    finally:
        done.set()
        holding.join()
    return {"honest": passed, "holders": held}


def forks(count: int) -> str:
    """A correct solution with `count` live processes (itself included) for a second before it is judged (a watch
    that polls sees them)."""
    return (
        f"import os, time\nfor _ in range({count - 1}):\n    if os.fork() == 0:\n        time.sleep(30)\n"
        "time.sleep(1)\n" + HONEST
    )


def leftovers(marker: str) -> str:
    """One program per stdin/stdout case, reporting what an earlier case left: the files in its folder, and whether
    any other process is alive (kill(-1, 0): in a PID namespace of the sample's own, only its own count). Case 0
    leaves a file and a daemon named `marker` in a session of its own."""
    return (
        "import os, time, ctypes\n"
        "n = int(input())\n"
        "try:\n    os.kill(-1, 0)\n    others = True\nexcept ProcessLookupError:\n    others = False\n"
        "print(n, sorted(os.listdir('.')), others)\n"
        "if n == 0:\n"
        "    open('left', 'w').write('x')\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.getpgid(0) != os.getpid():\n"
        "            os.setpgid(0, 0)\n"
        f"        ctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    time.sleep(0.2)\n"
    )


def leftover_cases(pid_namespace: bool) -> list[tuple[str, str]]:
    """What each case sees when it starts afresh: its own source alone (without a PID namespace, other processes are
    the machine's)."""
    return [(str(n), f"{n} ['solution.py'] {not pid_namespace}") for n in (0, 1)]


def read_keys(paths: list[str]) -> str:
    """A program that prints, as JSON, which of `paths` it could read (after reading the standard library)."""
    return (
        "import fractions, json\nseen = []\n"
        f"for path in {paths!r}:\n"
        "    try:\n        open(path, 'rb').read(1)\n        seen.append(path)\n    except OSError:\n        pass\n"
        "print(json.dumps(seen))\n"
    )


# ----------------------------------------------------------------------------------------------------------------
# As an unprivileged user

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
SETPRIV = shutil.which("setpriv")


def can_become_nobody() -> bool:
    return os.geteuid() == 0 and SYSTEM_PYTHON is not None and SETPRIV is not None


def as_nobody(
    script: str, data: Any = None, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `script` with the system interpreter as `nobody`, this package's sandbox and the attacks importable from
    a copy anyone can read (`nobody` may not read the checkout, nor pytest's temporary folders); `data` is JSON in
    the script's `DATA`; `env` adds to its environment. The copy has the start scripts' bytecode, as an installed
    package has it (pip compiles it), which `nobody` cannot write there; their sources keep their modification
    times, which the bytecode records. Only those files: other test processes write that folder meanwhile."""
    import grpo_kernels.sandbox
    from grpo_kernels.sandbox import runner

    runner._cache_start_bytecode()
    folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-copy-"))
    try:
        source = Path(grpo_kernels.sandbox.__file__).parent
        shutil.copytree(source, folder / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))  # copy2: mtimes kept
        (folder / "sandbox" / "__pycache__").mkdir()
        for name in runner._START_SCRIPTS:
            cached = Path(importlib.util.cache_from_source(str(source / f"{name}.py")))
            with contextlib.suppress(FileNotFoundError):  # none written (no bytecode here): it compiles them
                shutil.copy2(cached, folder / "sandbox" / "__pycache__" / cached.name)
        shutil.copy(__file__, folder)
        (folder / "data.json").write_text(json.dumps(data))
        for p in (folder, *folder.rglob("*")):
            p.chmod(0o755)
        prelude = (
            f"import sys, json\nsys.path.insert(0, {str(folder)!r})\nimport sandbox, sandbox_attacks\n"
            f"DATA = json.load(open({str(folder / 'data.json')!r}))\n"
        )
        nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"]
        return subprocess.run(
            [SETPRIV, *nobody, SYSTEM_PYTHON, "-I", "-c", prelude + script],
            cwd="/", env={"PATH": "/usr/bin:/bin", **(env or {})}, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder)


# As `nobody` on a machine that would not let users make namespaces (the plan made to lack them): the weakest
# sandbox, where a test holds it to the guarantees `isolation()` then states.
WITHOUT_NAMESPACES = (
    "weak = sandbox.plan.weaker(sandbox.runner._plan(), user_ns=False, pid_ns=False, mount_ns=False, net_ns=False)\n"
    "sandbox.runner._probe_plan = lambda: weak\n"
)


# ----------------------------------------------------------------------------------------------------------------
# Honest Python as CPython runs it: each program prints what it would print run as `python solution.py`

INTERPRETER = {  # name: (source, what it prints)
    "exit": ("print('a')\nexit()\nprint('b')\n", "a"),
    "quit": ("import sys\nprint(repr(quit))\nquit(0)\n", "Use quit() or Ctrl-D (i.e. EOF) to exit"),
    "atexit": ("import atexit\natexit.register(print, 'bye')\nprint('hi')\n", "hi\nbye"),
    "thread": (  # a non-daemon thread that outlives the module's code
        (
            "import threading, time\ndef late():\n    time.sleep(0.3)\n    print('late', flush=True)\n"
            "threading.Thread(target=late).start()\n"
        ),
        "late",
    ),
    "unflushed": ("out = open(1, 'w')\nout.write('raw')\n", "raw"),
    # evaluated at once, as `python solution.py` does (the launcher's own `from __future__ import annotations` once
    # reached the program: its annotations were strings)
    "annotations": (
        "def f(x: int) -> str:\n    pass\nprint(f.__annotations__)\n",
        "{'x': <class 'int'>, 'return': <class 'str'>}",
    ),
    "tempfile": (
        (
            "import os, tempfile\nwith tempfile.TemporaryDirectory() as d:\n"
            "    open(os.path.join(d, 'f'), 'w').write('ok')\n    print(open(os.path.join(d, 'f')).read())\n"
        ),
        "ok",
    ),
    "tmp": ("open('/tmp/x', 'w').write('1')\nprint(open('/tmp/x').read())\n", "1"),
    "source": (
        (
            "import inspect, os\ndef f():\n    return 1\n"
            "print(os.path.basename(__file__), inspect.getsource(f).split()[1])\n"
        ),
        "solution.py f():",
    ),
    "pickle": (
        (
            "import pickle\nclass Point:\n    def __init__(self, x):\n        self.x = x\n"
            "print(pickle.loads(pickle.dumps(Point(3))).x)\n"
        ),
        "3",
    ),
    "pool": (
        (
            "from multiprocessing import Pool\ndef square(x):\n    return x * x\n"
            "if __name__ == '__main__':\n    with Pool(2) as pool:\n        print(pool.map(square, range(4)))\n"
        ),
        "[0, 1, 4, 9]",
    ),
    "queue": (
        (
            "from multiprocessing import Process, Queue\ndef put(q):\n    q.put(5)\n"
            "q = Queue()\np = Process(target=put, args=(q,))\np.start()\nprint(q.get())\np.join()\n"
        ),
        "5",
    ),
    "pipe": ("from multiprocessing import Pipe\na, b = Pipe()\na.send([1, 2])\nprint(b.recv())\n", "[1, 2]"),
    "executor": (
        (
            "from concurrent.futures import ProcessPoolExecutor\ndef neg(x):\n    return -x\n"
            "with ProcessPoolExecutor(2) as ex:\n    print(list(ex.map(neg, [1, 2])))\n"
        ),
        "[-1, -2]",
    ),
    "interpreter": (  # the caller's interpreter, started again
        (
            "import subprocess, sys\nargs = [sys.executable, '-c', 'import sys; print(sys.version)']\n"
            "out = subprocess.run(args, capture_output=True, text=True)\n"
            "print(out.stdout.strip() == sys.version, out.stderr[-300:])\n"
        ),
        "True",
    ),
}
# What needs the sample's own /tmp and /dev/shm (the mount namespace): multiprocessing's locks live in /dev/shm
NEEDS_OWN_TMP = ("tmp", "pool", "queue", "executor")


def run_interpreter_programs(sandbox: Any, workers: int = 4) -> dict[str, list]:
    """Every program of `INTERPRETER`: [passed, its stdout stripped, the tail of its stderr]."""
    limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30, memory_mb=512)

    def run(source: str) -> list:
        result = sandbox.run_python(source, limits=limits)
        return [result.passed, result.stdout.strip(), result.stderr[-600:]]

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(INTERPRETER, pool.map(run, [source for source, _ in INTERPRETER.values()])))


def stdio_at_scale(sandbox: Any) -> dict[str, Any]:
    """Large inputs and outputs, and stderr per case: what passes, and what is refused."""
    limits = sandbox.SandboxLimits(timeout=60, cpu_seconds=30, memory_mb=512)
    big = "ab" * (17 * 2**19)  # 17 MiB: the old per-file limit cut it at 16 in silence
    reverse = "import sys\nsys.stdout.write(sys.stdin.read().strip()[::-1])\n"
    large = sandbox.run_stdio(reverse, [(big, big[::-1]), ("xy", "yx")], limits=limits)
    flood = "import sys\nprint('z' * (20 * 2**20))\nprint(input())\n"  # 20 MiB out
    printed = sandbox.run_stdio(flood, [("1", "z" * (20 * 2**20) + "\n1")], limits=limits)
    chatty = "import sys\nsys.stderr.write('e' * 360_000)\nprint(input())\n"  # 60 x 360 KB: 21 MB in all
    stderr = sandbox.run_stdio(chatty, [(str(i), str(i)) for i in range(60)], limits=limits)
    refused = []
    for cases in ([("x" * (64 * 2**20 + 1), "")], [("1", "y" * (64 * 2**20 + 1))]):
        try:
            sandbox.run_stdio("print(1)", cases, limits=limits)
        except ValueError as err:
            refused.append(str(err))
    try:
        sandbox.run_python("print(1)", stdin="x" * (64 * 2**20 + 1), limits=limits)
    except ValueError as err:
        refused.append(str(err))
    return {"large": large, "printed": printed, "stderr": stderr.count(True), "refused": refused}


def many_cases(sandbox: Any, count: int = 3000) -> int:
    """How many of `count` trivial cases pass at time_limit=1 (the init once inherited RLIMIT_CPU = 1 s)."""
    return sandbox.run_stdio("print(input())", [(str(i), str(i)) for i in range(count)], time_limit=1).count(True)


SESSION = (  # a child's setsid: does it leave the sample's session?
    "import os\nsid = os.getsid(0)\npid = os.fork()\nif pid == 0:\n    os.setsid()\n"
    "    os._exit(0 if os.getsid(0) == sid else 3)\n_, status = os.waitpid(pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status))\n"
)


def cpu_shares(sandbox: Any, seconds: float = 2.0) -> dict[str, Any]:
    """On one CPU, a correct sample whose 15 children each call setsid and spin, beside two honest samples that
    spin themselves: the CPU seconds each got in the same `seconds` of wall clock (fair: about the same)."""
    hog = (
        "import os, time\nfor _ in range(15):\n    if os.fork() == 0:\n        os.setsid()\n"
        f"        end = time.monotonic() + {seconds}\n        while time.monotonic() < end:\n            pass\n"
        "        os._exit(0)\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        break\n"
        "t = os.times()\nprint(t.children_user + t.children_system)\n"
    )
    honest = (
        f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
        "print(time.process_time())\n"
    )
    limits = sandbox.SandboxLimits(timeout=30 + 10 * seconds, cpu_seconds=30, memory_mb=256)
    cpu = min(os.sched_getaffinity(0))

    def pinned(source: str) -> Any:
        os.sched_setaffinity(0, {cpu})  # this thread, and so the sandbox it starts
        return sandbox.run_python(source, limits=limits)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(pinned, [hog, honest, honest]))
    if not all(r.passed for r in results):
        return {"failed": [r.stderr[-500:] for r in results]}
    return {"hog": float(results[0].stdout), "honest": [float(r.stdout) for r in results[1:]]}


def fallback_report(sandbox: Any) -> dict[str, Any]:
    """The plan on a machine where no mount namespace can be made (every probe that asks for one fails): what
    `isolation()` says, and the warnings its first and second calls gave."""
    import warnings

    runner, real = sandbox.runner, sandbox.runner._run

    def no_mount_namespace(plan: Any, *args: Any, **kwargs: Any) -> Any:
        if plan.mount_ns:
            raise OSError("mount namespaces are refused here")
        return real(plan, *args, **kwargs)

    runner._run = no_mount_namespace
    runner._probe_plan.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            layers = sandbox.isolation()
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            sandbox.isolation()
    finally:
        runner._run = real
        runner._probe_plan.cache_clear()
    return {"layers": layers, "first": [str(w.message) for w in first], "second": [str(w.message) for w in second]}


OWN_TMP = (  # one stdin/stdout program per case: what an earlier case left in /tmp and /dev/shm, then leave some
    "import os\nfolder = os.path.basename(os.getcwd())\n"
    "print([e for e in os.listdir('/tmp') if e != folder], os.listdir('/dev/shm'))\n"
    "open('/tmp/left', 'w').write('x')\nopen('/dev/shm/left', 'w').write('x')\n"
)
