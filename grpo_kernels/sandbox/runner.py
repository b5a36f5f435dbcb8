"""The trainer's side of the sandbox: the entry points, the plan this machine allows, a run and its watch.

A run is the sandboxed launcher (`launcher.py`, its own session, under the plan's namespaces, uid, Landlock and
seccomp) and, for tests, the trusted judge (`judge.py`) that holds them. Both are stdlib-only scripts of this folder
(with `wire` and `restrict`), started with a clean environment; they never import the rest of the package.
Some 690 lines: the three entry points share one run and its watch (and the cases' frames), which read best beside
them.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import math
import os
import platform
import secrets
import select
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from . import view
from .cleanup import count_tasks, kill_run, oom_killed, sample_cgroup
from .plan import (
    Plan,
    cgroup_parent,
    counts_its_own,
    describe,
    landlock_abi_of_kernel,
    missing_layers,
    remove_cgroup,
    weaker,
    write,
)
from .restrict import SETUP_FAILED, SYSCALLS

_HERE = str(Path(__file__).resolve().parent)
_STUB = "import sys; sys.path.insert(0, sys.argv[1]); import {0}; {0}.main()"
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
    limit: str | None = None  # "time", "memory", "disk" or "processes" when the run was stopped for that limit


# ----------------------------------------------------------------------------------------------------------------
# What this machine allows


_PLAN_LOCK = threading.Lock()


def _plan() -> Plan:
    with _PLAN_LOCK:  # concurrent first runs (a reward's thread pool) probe once
        return _probe_plan()


@functools.lru_cache(maxsize=1)
def _probe_plan() -> Plan:
    """The strongest set of layers this machine supports, each confirmed by running a program under it that
    imports from the standard library (which a sample must be able to read). A layer this caller could have but
    that cannot be set up here is named in the plan's `fallback`, with a warning, once."""
    root = os.geteuid() == 0
    namespaces = {"user_ns": not root, "pid_ns": True, "mount_ns": True, "net_ns": True}
    plan = Plan(
        sys.executable, root, **namespaces, landlock_abi=landlock_abi_of_kernel(),
        seccomp=platform.machine() in SYSCALLS, cgroup=cgroup_parent() if root else None,
    )  # fmt: skip
    no_ns = dict.fromkeys(namespaces, False)
    failures: list[str] = []
    for changes in (
        {},
        {"cgroup": None},
        {"cgroup": None, "seccomp": False},
        {"cgroup": None, **no_ns},  # seccomp needs no privilege: keep it where namespaces fail
        {"cgroup": None, "seccomp": False, **no_ns},
        {"cgroup": None, "seccomp": False, "landlock_abi": 0, **no_ns},
        {"cgroup": None, "seccomp": False, "landlock_abi": 0, "drop_uid": False, **no_ns},
    ):
        candidate = weaker(plan, **changes)
        if candidate is None:
            continue
        try:
            probe = _run(candidate, _PROBE, SandboxLimits(timeout=30))
            works, why = probe.stdout == "42\n", probe.stderr.strip().splitlines()[-1:] or ["no output"]
        except OSError as err:  # e.g. a cgroup that refuses its limits
            works, why = False, [str(err)]
        if works:
            return _with_fallback(candidate, failures)
        failures.append(why[0][:300])
    raise RuntimeError(f"the sandbox cannot run even a trivial program on this machine: {failures[:1]}")


def _with_fallback(plan: Plan, failures: list[str]) -> Plan:
    """`plan`, its `fallback` naming every layer the caller could have had that it lacks (and why): a warning."""
    missing = missing_layers(plan, os.geteuid() == 0, platform.machine() in SYSCALLS)
    if not missing:
        return plan
    why = f": {failures[0]}" if failures else ""
    fallback = f"{', '.join(missing)} could not be set up on this machine{why}"
    warnings.warn(
        f"grpo_kernels.sandbox: {fallback}; samples run without (see sandbox.isolation() and docs/sandbox.md)",
        RuntimeWarning,
        stacklevel=4,
    )
    return replace(plan, fallback=fallback)


_PROBE = "import fractions\nprint(fractions.Fraction(84, 2))"  # a module the launcher never imported, and _decimal


@functools.lru_cache(maxsize=64)
def _view(python: str, private_home: bool, packages: tuple[str, ...]) -> view.View:
    also = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(p)]
    python_info = view.interpreter(python)
    return view.view_of(python_info, view.installed(packages, python_info["path"]), private_home, also)


def isolation() -> dict[str, object]:
    """Which layers protect sandboxed code on this machine, and what each limit guarantees under them."""
    p = _plan()
    return describe(p, _view(p.python, p.drop_uid, ()))


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def run_python(
    source: str, *, limits: SandboxLimits | None = None, stdin: str | bytes = b"", packages: Sequence[str] = ()
) -> SandboxResult:
    """Run `source` as a program in the sandbox, `stdin` (up to `MAX_STDIO_BYTES`) as its input; `passed` when it
    exits with status 0.
    `packages`: installed packages (top-level import names) the program may import, read only; no other is visible."""
    return _run(_plan(), source, limits or SandboxLimits(), stdin=_sized(stdin, "stdin"), packages=packages)


def run_tests(
    solution: str,
    tests: str,
    *,
    limits: SandboxLimits | None = None,
    setup: str | None = None,
    packages: Sequence[str] = (),
) -> SandboxResult:
    """Judge `solution` by `tests` (Python source, e.g. asserts): the solution runs in the sandbox, the tests in a
    judge process that reaches the solution's top-level names through proxies (plain data each way, see `wire`).
    `setup`: trusted source the judge runs before the tests (a benchmark's prompt): the names it defines are the
    tests' own, shadowing the solution's, except functions it only declares (a docstring or `...` for a body),
    which the solution is to define. `passed` only when the tests ran to their end in the judge."""
    return _run(_plan(), solution, limits or SandboxLimits(), tests=tests, setup=setup, packages=packages)


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
    packages: Sequence[str] = (),
) -> list[bool]:
    """Run `program` once per (input, expected output) case, each in a process of its own inside one sandbox, with
    `time_limit` seconds of wall clock each (else `limits.timeout`); a case passes when the program exits 0 and its
    output equals the expected one after `normalize_output`. The comparison happens here, in the caller, which never
    sends the expected outputs into the sandbox. Each case starts from the same empty folder, and every process it
    started dies when it ends (see `isolation()["cases"]`). Inputs and expected outputs of up to `MAX_STDIO_BYTES`
    (64 MiB) each, `ValueError` naming the case above it; an output over it fails its case. Any number of cases:
    the limits are each case's processes' own."""
    limits = limits or SandboxLimits()
    seconds = limits.timeout if time_limit is None else time_limit
    limits = replace(limits, cpu_seconds=max(1, math.ceil(seconds)))  # each case's processes', not the init's
    inputs = [_sized(given, f"cases[{i}]'s input") for i, (given, _) in enumerate(cases)]
    for i, (_, out) in enumerate(cases):
        _sized(out, f"cases[{i}]'s expected output")
    expected = [normalize_output(out) for _, out in cases]
    verdicts: list[bool] = []

    def judge(i: int, report: dict) -> bool:
        ok = report.get("status") == 0 and not report.get("timed_out") and not report.get("cut")
        verdicts.append(ok and normalize_output(report["stdout"].decode("utf-8", "replace")) == expected[i])
        return verdicts[-1]

    work = Cases(inputs, seconds, MAX_STDIO_BYTES, judge, stop_at_first_failure)
    _run(_plan(), program, limits, cases=work, packages=packages)
    return verdicts + [False] * (len(cases) - len(verdicts))


MAX_STDIO_BYTES = 64 * 2**20  # of a stdin/stdout case's input, and of its output (a longer one fails the case)


def _sized(text: str | bytes, what: str) -> bytes:
    """`text` as bytes, refused by name over `MAX_STDIO_BYTES`."""
    data = text.encode() if isinstance(text, str) else text
    if not isinstance(data, bytes):
        raise TypeError(f"{what} must be str or bytes, got {type(text).__name__}")
    if len(data) > MAX_STDIO_BYTES:
        raise ValueError(f"{what} is {len(data)} bytes, over the sandbox's limit of {MAX_STDIO_BYTES} (64 MiB)")
    return data


# ----------------------------------------------------------------------------------------------------------------
# One run

# Threads count against max_processes: a numerical library starts one per core unless told otherwise.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Without a namespace or uid of its own, RLIMIT_NPROC counts every process of the user: only a backstop, this many
# full samples over what the user runs already; the sample's own count is the init's watch (`isolation()`).
_SHARED_ROOM = 64


def _process_limit(plan: Plan, uid: int | None, max_processes: int) -> int:
    if uid is not None:  # a fresh uid: its count is the sample's own program and descendants
        return max_processes
    if counts_its_own(plan):  # counted in the sample's user namespace, where the launcher and the init are too
        return max_processes + 2
    return count_tasks(os.getuid()) + (max_processes + 2) * _SHARED_ROOM


def _package_names(packages: Sequence[str], plan: Plan) -> tuple[str, ...]:
    if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
        raise TypeError(f"packages must be a list of top-level module names, got {packages!r:.80}")
    bad = [p for p in packages if not p.isidentifier()]
    if bad:
        raise ValueError(f"packages must be top-level module names (numpy, not numpy.linalg), got {bad!r:.80}")
    if packages and plan.python != sys.executable:
        raise ValueError(
            f"packages={list(packages)!r} needs the sandbox to run this interpreter ({sys.executable}), but on this "
            f"machine it runs {plan.python} (a fresh uid without a mount namespace; see isolation())"
        )
    return tuple(sorted(set(packages)))


def _run(
    plan: Plan,
    program: str,
    limits: SandboxLimits,
    *,
    tests: str | None = None,
    stdin: str | bytes = b"",
    cases: Cases | None = None,
    setup: str | None = None,
    packages: Sequence[str] = (),
) -> SandboxResult:
    seen = _view(plan.python, plan.drop_uid, _package_names(packages, plan))
    uid = 1_000_000_000 + secrets.randbelow(1_000_000_000) if plan.drop_uid else None  # owns no file, no process
    pipes: list[int] = []  # every end still open, closed at the latest when the run ends
    workdir = tempfile.mkdtemp(prefix=f"grpo-sandbox-{os.getpid()}-")
    cgroup, nonce = None, None
    procs: list[subprocess.Popen] = []
    try:
        cgroup = sample_cgroup(plan, limits.memory_mb * 2**20, limits.max_processes)
        with _memory_file() as out, _memory_file() as err, _memory_file() as given:
            given.write(stdin.encode() if isinstance(stdin, str) else stdin)
            given.seek(0)
            ends = _Ends.open(pipes, tests=tests is not None, cases=cases)
            job = _job(plan, program, limits, uid, workdir, seen, cgroup, ends, cases)
            _cache_start_bytecode()  # before the clock starts: the first run of a process may compile them
            start = time.monotonic()
            sandbox = _start_launcher(plan, workdir, str(job["folder"]), given, out, err, ends)
            procs.append(sandbox)
            if cgroup:
                write(os.path.join(cgroup, "cgroup.procs"), str(sandbox.pid))  # before it reads its job
            judge_out = None
            if tests is not None:
                judge_out = _memory_file()
                nonce = secrets.token_hex(16)
                procs.append(_start_judge(judge_out, ends))
            for fd in ends.given_away():
                _close(fd, pipes)
            _feed(ends.job_w, json.dumps(job).encode(), pipes)
            if tests is not None:
                _feed_judge(
                    procs[-1], {"tests": tests, "setup": setup, "nonce": nonce, "fds": ends.judge_fds, "path": _SITE}
                )
            watch_disk = None if plan.mount_ns else limits.disk_mb * 2**20
            verdict, timed_out, over_disk = _watch(sandbox, ends, cases, start + limits.timeout, workdir, watch_disk)
            kill_run(procs, cgroup, uid, plan)
            code = sandbox.returncode
            over = os.read(ends.status_r, 64)  # every writer is dead: this cannot block
            stdout, stderr = _outputs(out, err, judge_out, limits.max_output_bytes)
    finally:
        _release(procs, pipes, cgroup, workdir)
    outcome = _Outcome(code, over, stdout, stderr, verdict, timed_out, over_disk)
    return _result(outcome, tests is not None, nonce, cgroup, uid)


@dataclass
class _Ends:
    """The pipes of one run, by use: (read end, write end) each; only the mode's own exist."""

    job: tuple[int, int]  # the launcher's job, JSON
    status: tuple[int, int]  # the launcher's word on a limit it stopped the sample for
    reports: tuple[int, int] | None = None  # cases: one report per case, from the sample's runner
    calls: tuple[int, int] | None = None  # tests: the judge's calls into the solution
    replies: tuple[int, int] | None = None  # tests: the solution's replies
    verdict: tuple[int, int] | None = None  # tests: the judge's verdict
    inputs: int | None = None  # cases: every input, one after the other, in a file in memory

    @classmethod
    def open(cls, pipes: list[int], *, tests: bool, cases: Cases | None) -> _Ends:
        """The pipes a run needs (and the cases' inputs), each end listed in `pipes`."""

        def pipe() -> tuple[int, int]:
            r, w = os.pipe()
            pipes.extend((r, w))
            return r, w

        ends = cls(pipe(), pipe())
        if cases is not None:
            ends.reports = pipe()
            ends.inputs = os.memfd_create("grpo-sandbox-inputs", os.MFD_CLOEXEC)
            pipes.append(ends.inputs)
            for given in cases.inputs:
                view = memoryview(given)
                while view:
                    view = view[os.write(ends.inputs, view) :]
        if tests:
            ends.calls, ends.replies, ends.verdict = pipe(), pipe(), pipe()
        return ends

    @property
    def job_w(self) -> int:
        return self.job[1]

    @property
    def status_r(self) -> int:
        return self.status[0]

    @property
    def launcher_fds(self) -> list[int]:
        """The ends the launcher passes on to the sample (the job's "fds")."""
        if self.calls is not None and self.replies is not None:
            return [self.calls[0], self.replies[1]]
        return [self.reports[1], self.inputs] if self.reports is not None and self.inputs is not None else []

    @property
    def judge_fds(self) -> list[int]:
        if self.calls is None or self.replies is None or self.verdict is None:
            return []
        return [self.calls[1], self.replies[0], self.verdict[1]]

    def given_away(self) -> list[int]:
        """The ends the children hold once started, which this process closes."""
        return [self.job[0], self.status[1], *self.launcher_fds, *self.judge_fds]


def _rlimits(plan: Plan, uid: int | None, limits: SandboxLimits) -> dict[str, int]:
    return {
        "RLIMIT_CORE": 0,
        "RLIMIT_CPU": limits.cpu_seconds,
        "RLIMIT_AS": limits.memory_mb * 2**20,
        "RLIMIT_FSIZE": limits.max_file_mb * 2**20,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_NPROC": _process_limit(plan, uid, limits.max_processes),
        "RLIMIT_MSGQUEUE": 0,
    }


def _job(
    plan: Plan,
    program: str,
    limits: SandboxLimits,
    uid: int | None,
    workdir: str,
    seen: view.View,
    cgroup: str | None,
    ends: _Ends,
    cases: Cases | None,
) -> dict[str, object]:
    """What the launcher is to do, as it reads it from its job pipe. The sample's folder: in the mount namespace, one
    in its own /tmp, whatever the caller's temporary folder is; without one, the caller's `workdir`."""
    folder = os.path.join("/tmp", os.path.basename(workdir)) if plan.mount_ns else workdir
    job: dict[str, object] = {
        "mode": "functions" if ends.calls is not None else "cases" if cases is not None else "program",
        "program": program,
        "uid": uid,
        "workdir": workdir,
        "folder": folder,
        "writable": ["/tmp", "/dev/shm"] if plan.mount_ns else [workdir],
        "executable": os.path.realpath(plan.python),
        "rlimits": _rlimits(plan, uid, limits),
        "namespaces": {"user": plan.user_ns, "pid": plan.pid_ns, "mount": plan.mount_ns, "net": plan.net_ns},
        "disk_bytes": limits.disk_mb * 2**20,
        "memory_bytes": None if cgroup else limits.memory_mb * 2**20,
        "landlock_abi": plan.landlock_abi,
        "seccomp": plan.seccomp,
        "view": {"hide": seen.hide, "show": seen.show},
        "readable": seen.roots if plan.mount_ns else seen.read,
        "path": seen.path,
        "max_processes": limits.max_processes,
        "count_processes": not counts_its_own(plan),  # else the init counts them
        "fds": ends.launcher_fds,
        "status_fd": ends.status[1],
    }
    if cases is not None:
        job |= {
            "case_sizes": [len(given) for given in cases.inputs],
            "case_seconds": cases.seconds,
            "output_bytes": cases.output_bytes,
        }
    return job


_PATH = "/usr/bin:/bin"  # the children's PATH


_START_SCRIPTS = ("launcher", "judge", "wire", "restrict")  # what the launcher and the judge import from _HERE


@functools.cache
def _cache_start_bytecode() -> None:
    """Once per process, the bytecode of the scripts the launcher and the judge import (some 1,800 lines), written
    beside them as importing them here would write it: not where `sys.dont_write_bytecode` is set, and silently not
    where the folder is read-only. Both start with -B, so they read it but never write it; without it, as in an
    editable install (pip compiles an installed package's, not a source tree's), every run compiled them again: a
    source tree now runs as an installed package does (a sample of run_tests takes 12-20 % less CPU)."""
    for name in _START_SCRIPTS:
        path = os.path.join(_HERE, f"{name}.py")
        importlib.machinery.SourceFileLoader(name, path).get_code(name)  # compiles and writes it if it is stale


def _start_launcher(
    plan: Plan, workdir: str, folder: str, given: BinaryIO, out: BinaryIO, err: BinaryIO, ends: _Ends
) -> subprocess.Popen:
    """The sandboxed launcher, in a session of its own, with a clean environment; it waits for its job. `folder`:
    the sample's own, as it sees it."""
    env = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder, **_ONE_THREAD}
    return subprocess.Popen(
        [plan.python, "-I", "-S", "-B", "-c", _STUB.format("launcher"), _HERE, str(ends.job[0])],
        stdin=given, stdout=out, stderr=err, cwd=workdir, env=env, start_new_session=True,
        pass_fds=[ends.job[0], ends.status[1], *ends.launcher_fds],
    )  # fmt: skip


def _start_judge(out: BinaryIO, ends: _Ends) -> subprocess.Popen:
    """The trusted judge, outside the sandbox, in a session of its own; it waits for its job on stdin."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", "-c", _STUB.format("judge"), _HERE],
        stdin=subprocess.PIPE, stdout=out, stderr=out, cwd="/", start_new_session=True,
        env={"PATH": _PATH, "LANG": "C.UTF-8"}, pass_fds=ends.judge_fds,
    )  # fmt: skip


def _watch(
    sandbox: subprocess.Popen, ends: _Ends, cases: Cases | None, deadline: float, workdir: str, watch_disk: int | None
) -> tuple[dict | None, bool, bool]:
    """Watch the run until it ends or `deadline`: (the judge's verdict, timed out, over the disk quota)."""
    if cases is not None:
        return None, False, _collect(cases, ends.reports[0], deadline, workdir, watch_disk)
    verdict_fd = ends.verdict[0] if ends.verdict is not None else None
    verdict, over_disk = _wait(sandbox, verdict_fd, deadline, workdir, watch_disk)
    timed_out = verdict is None and time.monotonic() >= deadline and not over_disk
    return verdict, timed_out, over_disk


def _release(procs: list[subprocess.Popen], pipes: list[int], cgroup: str | None, workdir: str) -> None:
    """What a run holds, however it ended: its processes, the pipe ends still open, its cgroup and its folder."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while pipes:  # the ends still open when a run stopped early
        _close(pipes[-1], pipes)
    if cgroup:
        remove_cgroup(cgroup)
    shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class _Outcome:
    """What a run left: the launcher's exit status and word on a limit, the output, the watch's findings."""

    code: int | None
    over: bytes  # b"memory\n" or b"processes\n" when the launcher stopped the sample for that limit
    stdout: str
    stderr: str
    verdict: dict | None  # the judge's (tests)
    timed_out: bool
    over_disk: bool


def _result(outcome: _Outcome, tests: bool, nonce: str | None, cgroup: str | None, uid: int | None) -> SandboxResult:
    """The run's result: which limit stopped it, and whether it passed (tests: the judge's verdict, with our nonce)."""
    code, verdict, over_disk = outcome.code, outcome.verdict, outcome.over_disk
    timed_out, stderr = outcome.timed_out, outcome.stderr
    limit = "time" if timed_out else "disk" if over_disk else None
    if outcome.over == b"memory\n" or (cgroup and oom_killed(cgroup)):
        limit = "memory"
    elif outcome.over == b"processes\n":
        limit = "processes"
    if code == SETUP_FAILED and "sandbox setup failed" in stderr:
        timed_out = False
    if not tests:
        passed = not timed_out and not over_disk and code == 0
    else:
        ok = isinstance(verdict, dict) and verdict.get("nonce") == nonce and verdict.get("passed") is True
        passed = ok and not timed_out and not over_disk
        if isinstance(verdict, dict) and verdict.get("error"):
            stderr += str(verdict["error"])
    return SandboxResult(code, outcome.stdout, stderr, timed_out, passed, uid, limit)


@dataclass
class Cases:
    """The stdin/stdout form within one run: the inputs go in, one report per case comes back in `reports`."""

    inputs: list[bytes]
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
    frames = _Frames(fd, cases.output_bytes)
    due = deadline + cases.seconds
    while len(cases.reports) < len(cases.inputs):
        try:
            report = frames.next()
        except ValueError:
            return False
        if report is None:
            left = due - time.monotonic()
            if left <= 0:
                return False
            if not select.select([fd], [], [], min(left, 0.02) if watch_disk is not None else left)[0]:
                if watch_disk is not None and _folder_bytes(workdir) > watch_disk:
                    return True
                continue
            if not frames.fill():
                return False  # the sandbox ended before its last report
            continue
        if report.get("case") != len(cases.reports):
            return False
        cases.reports.append(report)
        if not cases.judge(len(cases.reports) - 1, report) and cases.stop:
            return False
        due = time.monotonic() + cases.seconds + _GRACE
    return False


class _Frames:
    """The case reports as the sandbox's init sends them: a JSON line per frame; a frame with `out` is followed by
    that many bytes of the case's stdout, and the case's last frame (its status) completes its report."""

    def __init__(self, fd: int, output_bytes: int) -> None:
        self.fd, self.limit = fd, output_bytes
        self.buffer = bytearray()
        self.output: list[bytes] = []
        self.size = 0

    def fill(self) -> bool:
        chunk = os.read(self.fd, 2**20)
        self.buffer += chunk
        return bool(chunk)

    def next(self) -> dict | None:
        """The next whole report (stdout as bytes), None until one has come; `ValueError` for a malformed frame."""
        while True:
            end = self.buffer.find(b"\n", 0, 4096)
            if end < 0:
                if len(self.buffer) >= 4096:
                    raise ValueError("a frame header over 4 KiB")
                return None
            header = json.loads(self.buffer[:end])
            if not isinstance(header, dict):
                raise ValueError("a frame that is not a JSON object")
            if "out" not in header:
                del self.buffer[: end + 1]
                header["stdout"] = b"".join(self.output)
                self.output, self.size = [], 0
                return header
            size = header["out"]
            if type(size) is not int or size < 0 or self.size + size > self.limit:
                raise ValueError("an output frame over the limit")
            if len(self.buffer) < end + 1 + size:
                return None
            self.output.append(bytes(self.buffer[end + 1 : end + 1 + size]))
            self.size += size
            del self.buffer[: end + 1 + size]


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


def _outputs(out: BinaryIO, err: BinaryIO, judge_out: BinaryIO | None, limit: int) -> tuple[str, str]:
    """The tails of the sample's stdout and stderr, the judge's output (which it closes) after the stderr."""
    stdout, stderr = _tail(out, limit), _tail(err, limit)
    if judge_out is not None:
        judge_text = _tail(judge_out, limit)
        judge_out.close()
        stderr += judge_text
    return stdout, stderr


def _tail(f: BinaryIO, limit: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------------------------
# Cleanup: every process of the run dies before it returns
