"""The trainer's side of the sandbox: pick the layers this machine allows, start a run, watch it, kill all of it.

A run is the sandboxed launcher (`launcher.py`, its own session, under the plan's namespaces, uid, Landlock and
seccomp) and, for tests, the trusted judge (`judge.py`) that holds them. Both are stdlib-only scripts of this folder,
started with a clean environment; they never import the rest of the package.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import json
import math
import os
import platform
import secrets
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from . import wire
from .launcher import SETUP_FAILED, SYSCALLS

_HERE = str(Path(__file__).resolve().parent)
_STUB = "import sys; sys.path.insert(0, sys.argv[1]); import {0}; {0}.main()"
_SAMPLES = itertools.count()
# The judge starts without `site` (its .pth hooks cost more than the rest of its start) and imports the tests'
# third-party modules from these folders.
_SITE = [*site.getsitepackages(), site.getusersitepackages()]


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 5.0  # wall-clock seconds of the whole run, interpreter start included
    cpu_seconds: int = 5  # per process
    memory_mb: int = 512  # the whole sample (see `isolation()["memory"]`); also each process's address space
    max_processes: int = 16  # processes and threads of the sample (see `isolation()["processes"]`)
    disk_mb: int = 64  # the sample's private working folder
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64_000  # of stdout and of stderr kept in the result (the tail)


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    passed: bool  # a program: it exited with status 0; tests: the judge saw them run to their end
    uid: int | None = None  # the fresh uid it ran under (as root), None when it ran as the caller
    limit: str | None = None  # "time", "memory" or "disk" when the run was stopped for that limit


@dataclass(frozen=True)
class _Plan:
    python: str
    drop_uid: bool
    user_ns: bool
    pid_ns: bool
    mount_ns: bool
    net_ns: bool
    landlock_abi: int
    seccomp: bool
    cgroup: str | None  # the parent cgroup (v2, memory and pids controllers) of every sample's own


# ----------------------------------------------------------------------------------------------------------------
# What this machine allows


def _world_reachable(path: str) -> bool:
    """True when a user with no relation to the file's owner can traverse to `path` and execute it."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _landlock_abi() -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
        return max(int(abi), 0)
    except (OSError, AttributeError):
        return 0


def own_cgroup2() -> str | None:
    """The folder of this process's cgroup in the cgroup v2 hierarchy, or None where there is none."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        root = next(m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2")
        with open("/proc/self/cgroup") as f:
            own = next(line.strip()[3:] for line in f if line.startswith("0::"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return os.path.join(root, own.lstrip("/"))


def _cgroup_parent() -> str | None:
    """A cgroup v2 folder of our own with the memory and pids controllers for its children, or None."""
    base = own_cgroup2()
    if base is None:
        return None
    try:
        with open(os.path.join(base, "cgroup.controllers")) as f:
            if not {"memory", "pids"} <= set(f.read().split()):
                return None
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")  # EBUSY where our cgroup has processes
        parent = os.path.join(base, f"grpo-sandbox-{os.getpid()}")
        os.makedirs(parent, exist_ok=True)
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    except OSError:
        return None
    atexit.register(_remove_cgroup, parent)
    return parent


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


_PLAN_LOCK = threading.Lock()


def _plan() -> _Plan:
    with _PLAN_LOCK:  # concurrent first runs (a reward's thread pool) probe once
        return _probe_plan()


@functools.lru_cache(maxsize=1)
def _probe_plan() -> _Plan:
    """The strongest set of layers this machine supports, each confirmed by running a trivial program under it."""
    root = os.geteuid() == 0
    python, drop_uid = sys.executable, False
    if root:
        for candidate in (
            sys.executable,
            getattr(sys, "_base_executable", ""),
            "/usr/bin/python3",
            "/usr/local/bin/python3",
        ):
            if candidate and os.path.exists(candidate) and _world_reachable(candidate):
                python, drop_uid = candidate, True
                break
    namespaces = {"user_ns": not root, "pid_ns": True, "mount_ns": True, "net_ns": True}
    plan = _Plan(
        python, drop_uid, **namespaces, landlock_abi=_landlock_abi(), seccomp=platform.machine() in SYSCALLS,
        cgroup=_cgroup_parent() if root else None,
    )  # fmt: skip
    no_ns = {k: False for k in namespaces}
    for weaker in (
        plan,
        replace(plan, cgroup=None),
        replace(plan, cgroup=None, seccomp=False),
        replace(plan, cgroup=None, **no_ns),  # seccomp needs no privilege: keep it where namespaces fail
        replace(plan, cgroup=None, seccomp=False, **no_ns),
        replace(plan, cgroup=None, seccomp=False, landlock_abi=0, **no_ns),
        replace(plan, cgroup=None, seccomp=False, landlock_abi=0, drop_uid=False, **no_ns),
    ):
        try:
            works = _run(weaker, "print(6 * 7)", SandboxLimits(timeout=30)).passed
        except OSError:  # e.g. a cgroup that refuses its limits
            works = False
        if works:
            return weaker
    raise RuntimeError("the sandbox cannot run even a trivial program on this machine")


def isolation() -> dict[str, object]:
    """Which layers protect sandboxed code on this machine, and what each limit guarantees under them."""
    p = _plan()
    own_ns = p.pid_ns and p.mount_ns
    if p.cgroup:
        memory = "cgroup v2 memory.max on the whole sample (no swap)"
    elif own_ns:
        memory = (
            "watched: the sample's total private resident memory, polled every 20 ms, plus each process's address space"
        )
    else:
        memory = "per process only (address space): a sample may hold max_processes × memory_mb"
    if p.cgroup:
        processes = "cgroup v2 pids.max on the whole sample"
    elif p.drop_uid:
        processes = "RLIMIT_NPROC of the sample's own uid: the whole sample"
    else:
        processes = "RLIMIT_NPROC over the user's current count: shared by concurrent samples"
    if own_ns:
        cleanup = "PID namespace: its init exits when the program does, and the kernel kills every process left"
    elif p.drop_uid:
        cleanup = "kill(-1) as the sample's uid, repeated until none of its processes is alive"
    else:
        cleanup = "its process group only: a process that leaves it (setsid) survives the run"
    unix = (
        "; ".join(
            layer
            for layer, on in (
                (
                    "seccomp: socket() and socketpair() fail for every family, AF_UNIX (pathname and abstract) included",
                    p.seccomp,
                ),
                ("the mount namespace hides /tmp, /run, /dev/shm and /var/tmp", p.mount_ns),
                ("Landlock scope: abstract sockets outside the sample are refused", p.landlock_abi >= 6),
            )
            if on
        )
        or "reachable"
    )
    return {
        "python": p.python,
        "separate_uid": p.drop_uid,
        "user_namespace": p.user_ns,
        "pid_namespace": p.pid_ns,
        "mount_namespace": p.mount_ns,
        "network_namespace": p.net_ns,
        "landlock_abi": p.landlock_abi,
        "seccomp": p.seccomp,
        "cgroup": p.cgroup,
        "memory": memory,
        "processes": processes,
        "disk": "a private tmpfs of disk_mb, seen by the sample alone"
        if p.mount_ns
        else "watched: the working folder's size, polled every 20 ms, plus RLIMIT_FSIZE per file",
        "cleanup": cleanup,
        "unix_sockets": unix,
    }


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def run_python(source: str, *, limits: SandboxLimits | None = None, stdin: str | bytes = b"") -> SandboxResult:
    """Run `source` as a program in the sandbox, `stdin` as its input; `passed` when it exits with status 0."""
    return _run(_plan(), source, limits or SandboxLimits(), stdin=stdin)


def run_tests(solution: str, tests: str, *, limits: SandboxLimits | None = None) -> SandboxResult:
    """Judge `solution` by `tests` (Python source, e.g. asserts): the solution runs in the sandbox, the tests in a
    judge process that reaches the solution's top-level names through proxies (plain data each way, see `wire`).
    `passed` only when the tests ran to their end in the judge."""
    return _run(_plan(), solution, limits or SandboxLimits(), tests=tests)


def normalize_output(text: str) -> list[str]:
    """Output as the stdin/stdout form compares it: lines with runs of whitespace collapsed, outer blank lines gone."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def run_stdio(
    program: str,
    cases: Sequence[tuple[str, str]],
    *,
    limits: SandboxLimits | None = None,
    time_limit: float | None = None,
    stop_at_first_failure: bool = False,
) -> list[bool]:
    """Run `program` once per (input, expected output) case, each in a process of its own inside one sandbox, with
    `time_limit` seconds of wall clock each (else `limits.timeout`); a case passes when the program exits 0 and its
    output equals the expected one after `normalize_output`. The comparison happens here, in the caller, which never
    sends the expected outputs into the sandbox."""
    limits = limits or SandboxLimits()
    seconds = limits.timeout if time_limit is None else time_limit
    limits = replace(limits, cpu_seconds=max(1, math.ceil(seconds)))
    expected = [normalize_output(out) for _, out in cases]
    verdicts: list[bool] = []

    def judge(i: int, report: dict) -> bool:
        ok = report.get("status") == 0 and not report.get("timed_out") and not report.get("cut")
        verdicts.append(ok and normalize_output(str(report.get("stdout", ""))) == expected[i])
        return verdicts[-1]

    room = max(limits.max_output_bytes, 2 * max((len(out) for _, out in cases), default=0) + 4096)
    work = Cases([given for given, _ in cases], seconds, room, judge, stop_at_first_failure)
    _run(_plan(), program, limits, cases=work)
    return verdicts + [False] * (len(cases) - len(verdicts))


# ----------------------------------------------------------------------------------------------------------------
# One run


def _run(
    plan: _Plan,
    program: str,
    limits: SandboxLimits,
    *,
    tests: str | None = None,
    stdin: str | bytes = b"",
    cases: Cases | None = None,
) -> SandboxResult:
    uid = 1_000_000_000 + secrets.randbelow(1_000_000_000) if plan.drop_uid else None  # owns no file, no process
    rlimits = {
        "RLIMIT_CORE": 0,
        "RLIMIT_CPU": limits.cpu_seconds,
        "RLIMIT_AS": limits.memory_mb * 2**20,
        "RLIMIT_FSIZE": limits.max_file_mb * 2**20,
        "RLIMIT_NOFILE": limits.max_open_files,
        # every process of the real uid counts: a fresh uid starts at 0, the user's own at its current count
        "RLIMIT_NPROC": limits.max_processes + (0 if uid is not None else _count_tasks(os.getuid())),
    }
    pipes: list[int] = []

    def pipe() -> tuple[int, int]:
        r, w = os.pipe()
        pipes.extend((r, w))
        return r, w

    workdir = tempfile.mkdtemp(prefix=f"grpo-sandbox-{os.getpid()}-")
    cgroup = None
    procs: list[subprocess.Popen] = []
    try:
        cgroup = _sample_cgroup(plan, limits)
        with _memory_file() as out, _memory_file() as err, _memory_file() as given:
            given.write(stdin.encode() if isinstance(stdin, str) else stdin)
            given.seek(0)
            job_r, job_w = pipe()
            status_r, status_w = pipe()
            fds = []
            if cases is not None:
                reports_r, reports_w = pipe()
                fds = [reports_w]
            if tests is not None:
                calls_r, calls_w = pipe()
                replies_r, replies_w = pipe()
                verdict_r, verdict_w = pipe()
                fds = [calls_r, replies_w]
            job = {
                "mode": "functions" if tests is not None else "cases" if cases is not None else "program",
                "program": program,
                "uid": uid,
                "workdir": workdir,
                "rlimits": rlimits,
                "namespaces": {"user": plan.user_ns, "pid": plan.pid_ns, "mount": plan.mount_ns, "net": plan.net_ns},
                "disk_bytes": limits.disk_mb * 2**20,
                "memory_bytes": None if cgroup else limits.memory_mb * 2**20,
                "landlock_abi": plan.landlock_abi,
                "seccomp": plan.seccomp,
                "fds": fds,
                "status_fd": status_w,
            }
            if cases is not None:
                job |= {"cases": cases.inputs, "case_seconds": cases.seconds, "output_bytes": cases.output_bytes}
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
            start = time.monotonic()
            sandbox = subprocess.Popen(
                [plan.python, "-I", "-S", "-B", "-c", _STUB.format("launcher"), _HERE, str(job_r)],
                stdin=given, stdout=out, stderr=err, cwd=workdir, env=env, start_new_session=True,
                pass_fds=[job_r, status_w, *fds],
            )  # fmt: skip
            procs.append(sandbox)
            if cgroup:
                _write(os.path.join(cgroup, "cgroup.procs"), str(sandbox.pid))  # before it reads its job
            judge_out = None
            if tests is not None:
                judge_out = _memory_file()
                nonce = secrets.token_hex(16)
                judge = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", "-c", _STUB.format("judge"), _HERE],
                    stdin=subprocess.PIPE, stdout=judge_out, stderr=judge_out, cwd="/", start_new_session=True,
                    env={"PATH": env["PATH"], "LANG": "C.UTF-8"}, pass_fds=[calls_w, replies_r, verdict_w],
                )  # fmt: skip
                procs.append(judge)
            for fd in (job_r, status_w, *fds, *((calls_w, replies_r, verdict_w) if tests is not None else ())):
                _close(fd, pipes)
            _feed(job_w, json.dumps(job).encode(), pipes)
            if tests is not None:
                _feed_judge(
                    judge, {"tests": tests, "nonce": nonce, "fds": [calls_w, replies_r, verdict_w], "path": _SITE}
                )
            deadline = start + limits.timeout
            watch_disk = None if plan.mount_ns else limits.disk_mb * 2**20
            if cases is not None:
                over_disk = _collect(cases, reports_r, deadline, workdir, watch_disk)
                verdict, timed_out = None, False
            else:
                verdict, over_disk = _wait(
                    sandbox, verdict_r if tests is not None else None, deadline, workdir, watch_disk
                )
                timed_out = verdict is None and time.monotonic() >= deadline and not over_disk
            _kill(procs, cgroup, uid, plan)
            code = sandbox.returncode
            over_memory = os.read(status_r, 64) == b"memory\n"  # every writer is dead: this cannot block
            stdout, stderr = _tail(out, limits.max_output_bytes), _tail(err, limits.max_output_bytes)
            if judge_out is not None:
                judge_text = _tail(judge_out, limits.max_output_bytes)
                judge_out.close()
                stderr += judge_text
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        while pipes:  # the ends still open when a run stopped early
            _close(pipes[-1], pipes)
        if cgroup:
            _remove_cgroup(cgroup)
        shutil.rmtree(workdir, ignore_errors=True)
    limit = "time" if timed_out else "disk" if over_disk else None
    if over_memory or (cgroup and _oom_killed(cgroup)):
        limit = "memory"
    if code == SETUP_FAILED and "sandbox setup failed" in stderr:
        timed_out = False
    if tests is None:
        passed = not timed_out and not over_disk and code == 0
    else:
        ok = isinstance(verdict, dict) and verdict.get("nonce") == nonce and verdict.get("passed") is True
        passed = ok and not timed_out and not over_disk
        if isinstance(verdict, dict) and verdict.get("error"):
            stderr += str(verdict["error"])
    return SandboxResult(code, stdout, stderr, timed_out, passed, uid, limit)


@dataclass
class Cases:
    """The stdin/stdout form within one run: the inputs go in, one report per case comes back in `reports`."""

    inputs: list[str]
    seconds: float  # wall clock per case, timed by the sandbox's runner and, with `_GRACE`, here
    output_bytes: int
    judge: Callable[[int, dict], bool]  # a case's verdict from its report; False ends the run when `stop` is set
    stop: bool = False
    reports: list[dict] = field(default_factory=list)


_GRACE = 1.0  # seconds a case's report may come after its time limit before the whole run is stopped


def _collect(cases: Cases, fd: int, deadline: float, workdir: str, watch_disk: int | None) -> bool:
    """Read the case reports until all came, one came late, or a verdict stops the run: over the disk quota?
    Each report must arrive within its case's limit (and `_GRACE`) of the one before, `deadline` for the first:
    the runner inside the sandbox times the cases, and this is the check that does not trust it."""
    reader = wire.Reader(fd)
    due = deadline + cases.seconds
    while len(cases.reports) < len(cases.inputs):
        left = due - time.monotonic()
        if left <= 0:
            return False
        if not select.select([fd], [], [], min(left, 0.02) if watch_disk is not None else left)[0]:
            if watch_disk is not None and _folder_bytes(workdir) > watch_disk:
                return True
            continue
        try:
            report = reader.receive()
        except wire.NotPlain:
            return False
        if report is None or report.get("case") != len(cases.reports):
            return False
        cases.reports.append(report)
        if not cases.judge(len(cases.reports) - 1, report) and cases.stop:
            return False
        due = time.monotonic() + cases.seconds + _GRACE
    return False


def _close(fd: int, pipes: list[int]) -> None:
    if fd in pipes:
        pipes.remove(fd)
        os.close(fd)


def _feed(fd: int, data: bytes, pipes: list[int]) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass  # it died before reading its job; its status tells
    _close(fd, pipes)


def _feed_judge(judge: subprocess.Popen, job: dict) -> None:
    try:
        judge.stdin.write(json.dumps(job).encode())
        judge.stdin.close()
    except BrokenPipeError:
        pass


def _wait(
    sandbox: subprocess.Popen, verdict_fd: int | None, deadline: float, workdir: str, watch_disk: int | None
) -> tuple[dict | None, bool]:
    """Wait for the verdict (tests) or the program's end, until `deadline`: (the verdict, over the disk quota)."""
    buffer = b""
    while (left := deadline - time.monotonic()) > 0:
        step = min(left, 0.02) if watch_disk is not None else left
        if verdict_fd is None:
            try:
                sandbox.wait(timeout=step)
                return None, False
            except subprocess.TimeoutExpired:
                pass
        elif select.select([verdict_fd], [], [], step)[0]:
            chunk = os.read(verdict_fd, 1 << 16)
            buffer += chunk
            if not chunk or b"\n" in buffer or len(buffer) > 1 << 20:
                try:
                    return json.loads(buffer.split(b"\n", 1)[0]), False
                except ValueError:
                    return {}, False
        if watch_disk is not None and _folder_bytes(workdir) > watch_disk:
            return None, True
    return None, False


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _memory_file() -> BinaryIO:
    """A file in memory, not on any disk: what the sample writes to stdout and stderr cannot fill a folder of ours
    (RLIMIT_FSIZE bounds it, as any file the sample writes)."""
    return open(os.memfd_create("grpo-sandbox", os.MFD_CLOEXEC), "w+b")


def _tail(f: BinaryIO, limit: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------------------------
# Cleanup: every process of the run dies before it returns


def _kill(procs: list[subprocess.Popen], cgroup: str | None, uid: int | None, plan: _Plan) -> None:
    """SIGKILL the launcher's process group (the launcher and the sample's init: with a PID namespace, the init's
    death takes every process of the sample with it), then the sample's cgroup, then (as root, without a PID
    namespace) every process of its uid."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    if cgroup:
        _kill_cgroup(cgroup)
    if uid is not None and not plan.pid_ns:
        _kill_uid(uid, plan.python)


_KILL_UID = """
import os
def alive():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(pid) != os.getpid() and status["Uid"].split()[0] == str(os.getuid()) and "Z" not in status["State"]:
            return True
    return False
for _ in range(10000):
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        break
    if not alive():
        break
"""


def _kill_uid(uid: int, python: str) -> None:
    # kill(-1) as that uid reaches exactly its processes, atomically: a fork racing it fails, since its parent
    # already has SIGKILL pending. It returns ESRCH only where no other process exists at all, so the helper
    # repeats it until /proc shows none of the uid's processes alive.
    subprocess.run(
        [python, "-I", "-S", "-c", _KILL_UID], user=uid, group=uid, extra_groups=[], env={}, timeout=30, check=False,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _sample_cgroup(plan: _Plan, limits: SandboxLimits) -> str | None:
    if not plan.cgroup:
        return None
    path = os.path.join(plan.cgroup, f"s{next(_SAMPLES)}")
    os.mkdir(path)
    try:
        for name, value in (
            ("memory.max", limits.memory_mb * 2**20),
            ("memory.swap.max", 0),
            ("memory.oom.group", 1),
            ("pids.max", limits.max_processes + 2),  # the launcher and the init count too
        ):
            try:
                _write(os.path.join(path, name), str(value))
            except FileNotFoundError:
                if name != "memory.swap.max":  # no swap accounting on this kernel: nothing to limit
                    raise
    except OSError:
        _remove_cgroup(path)
        raise
    return path


def _kill_cgroup(path: str) -> None:
    kill = os.path.join(path, "cgroup.kill")  # Linux >= 5.14
    for _ in range(1000):
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            return
        if os.path.exists(kill):
            _write(kill, "1")
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.001)


def _oom_killed(path: str) -> bool:
    try:
        with open(os.path.join(path, "memory.events")) as f:
            return any(line.split()[0] == "oom_kill" and line.split()[1] != "0" for line in f)
    except OSError:
        return False


def _remove_cgroup(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _count_tasks(uid: int) -> int:
    """Processes and threads the user runs now (what RLIMIT_NPROC counts)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        if status.get("Uid", "").split("\t")[0] == str(uid):
            total += int(status.get("Threads", "1"))
    return total
