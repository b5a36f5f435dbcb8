"""Run untrusted Python (a policy's code) in a throw-away, locked-down subprocess, for `code_reward`.

Layers, each used where the machine allows it (`isolation()` reports which); a layer that was planned and then
fails to apply fails the run instead of running the code with less protection:
- always: its own session, killed as a whole; a clean environment; `python -I -S -B`; a temporary working folder;
  rlimits on CPU time, address space, file size, open files and processes; a wall-clock timeout; sockets disabled in
  the interpreter before the code runs; the program and tests arrive on stdin (no file for the code to read);
- as root: a fresh uid that owns nothing (it can't read other processes' environment, signal them or write root's
  files; RLIMIT_NPROC caps its processes, and whatever it leaves behind is killed by uid), and a private network
  namespace (only a down loopback);
- Landlock (Linux >= 5.13): writes only inside the working folder, reads only system and interpreter folders (no
  /proc of other processes), no TCP (ABI >= 4), no signals to processes outside the sandbox (ABI >= 6).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

# The launcher runs as the sandboxed interpreter's main program: it reads its job from stdin, applies the limits
# (dropping root last), then runs the code in-process, so nothing is exec'd after the privileges are gone.
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
job = json.loads(sys.stdin.read())
os.close(0)
os.open(os.devnull, os.O_RDONLY)
cfg = job["config"]

def fail(what, err):
    os.write(2, ("sandbox setup failed: %s: %s\n" % (what, err)).encode())
    os._exit(97)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def check(ret, what):
    if ret < 0:
        fail(what, os.strerror(ctypes.get_errno()))
    return ret

for name, value in cfg["rlimits"].items():
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError) as err:
        fail(name, err)

if cfg["netns"]:
    flags = 0x40000000  # CLONE_NEWNET
    if cfg["uid"] is None and os.geteuid() != 0:
        flags |= 0x10000000  # CLONE_NEWUSER: lets an unprivileged user own the network namespace
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(ctypes.c_int(flags)), "unshare")
    if flags & 0x10000000:
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", "%d %d 1" % (uid, uid)),
                           ("/proc/self/gid_map", "%d %d 1" % (gid, gid))):
            with open(path, "w") as f:
                f.write(text)

workdir = cfg["workdir"]
if cfg["uid"] is not None:
    try:
        os.chown(workdir, cfg["uid"], cfg["uid"])
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    except OSError as err:
        fail("setuid", err)
check(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")  # die with the trainer (set after setuid)
check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")

abi = cfg["landlock_abi"]
if abi:
    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    read_only = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
    attr = (ctypes.c_uint64 * 3)(handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # fs, TCP bind/connect, scopes
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = check(libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)), "landlock_create_ruleset")
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    rules = [(p, read_only) for p in ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", *prefixes)]
    rules += [("/dev/null", 2 | 4 | (1 << 14 if abi >= 3 else 0)), ("/dev/urandom", 4), ("/dev/random", 4), (workdir, handled)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a folder this system doesn't have
        rule = PathBeneath(access, fd)
        check(libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule " + path)
        os.close(fd)
    check(libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)

os.chdir(workdir)
import socket, _socket

class NoNetwork(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

socket.socket = socket.SocketType = _socket.socket = NoNetwork
socket.create_connection = socket.socketpair = NoNetwork
sys.argv[:] = ["solution.py"]
sys.orig_argv[:] = [sys.executable, "solution.py"]
nonce, units = job["nonce"], [(job["program"], "solution.py")] + ([(job["tests"], "tests.py")] if job["tests"] is not None else [])
del job, cfg, libc
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    for source, filename in units:
        exec(compile(source, filename, "exec"), scope)
except SystemExit as exc:  # an exit before the tests finished never counts as a pass
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code if code != 0 or len(units) == 1 else 3)
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1)
sys.stdout.write("\n" + nonce + "\n")
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # no atexit hooks or lingering threads of the code under test
"""

SETUP_FAILED = 97


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 5.0  # wall-clock seconds, interpreter start included
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space
    max_processes: int = 16  # processes and threads of the sandbox uid (as root) or over the user's current count
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64_000  # of stdout and of stderr kept in the result (the tail)


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    passed: bool  # exited 0 after running everything (tests included)
    uid: int | None = None  # the fresh uid it ran under (as root), None when it ran as the caller


@dataclass(frozen=True)
class _Plan:
    python: str
    drop_uid: bool
    netns: bool
    landlock_abi: int


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


@functools.lru_cache(maxsize=1)
def _plan() -> _Plan:
    """The strongest set of layers this machine supports, each confirmed by running a trivial program under it."""
    root = os.geteuid() == 0
    python = sys.executable
    drop_uid = False
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
    plan = _Plan(python, drop_uid, netns=True, landlock_abi=_landlock_abi())
    for weaker in (
        plan,
        replace(plan, netns=False),
        replace(plan, netns=False, landlock_abi=0),
        replace(plan, drop_uid=False, netns=False, landlock_abi=0),
    ):
        if _run(weaker, "print(6 * 7)", None, SandboxLimits(timeout=30)).passed:
            return weaker
    raise RuntimeError("the sandbox cannot run even a trivial program on this machine")


def isolation() -> dict[str, object]:
    """Which layers protect sandboxed code on this machine."""
    plan = _plan()
    return {
        "python": plan.python,
        "separate_uid": plan.drop_uid,
        "network_namespace": plan.netns,
        "landlock_abi": plan.landlock_abi,
    }


def run_python(source: str, *, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `source` as a program in the sandbox; `passed` when it exits with status 0."""
    return _run(_plan(), source, None, limits or SandboxLimits())


def run_tests(solution: str, tests: str, *, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `solution` and then `tests` in one namespace; `passed` only when the tests ran to their end (an early
    `exit(0)` or `os._exit(0)` in the solution does not pass)."""
    return _run(_plan(), solution, tests, limits or SandboxLimits())


def _run(plan: _Plan, program: str, tests: str | None, limits: SandboxLimits) -> SandboxResult:
    uid = 1_000_000_000 + secrets.randbelow(1_000_000_000) if plan.drop_uid else None  # owns no file, no process
    nonce = secrets.token_hex(16)
    rlimits = {
        "RLIMIT_CORE": 0,
        "RLIMIT_CPU": limits.cpu_seconds,
        "RLIMIT_AS": limits.memory_mb * 2**20,
        "RLIMIT_FSIZE": limits.max_file_mb * 2**20,
        "RLIMIT_NOFILE": limits.max_open_files,
    }
    # RLIMIT_NPROC counts every process of the real uid: a fresh uid starts at 0, the user's own at its current count.
    rlimits["RLIMIT_NPROC"] = limits.max_processes + (0 if uid is not None else _count_tasks(os.getuid()))
    with (
        tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as workdir,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        config = {
            "rlimits": rlimits,
            "netns": plan.netns,
            "uid": uid,
            "workdir": workdir,
            "landlock_abi": plan.landlock_abi,
        }
        job = json.dumps({"config": config, "nonce": nonce, "program": program, "tests": tests}).encode()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        proc = subprocess.Popen(
            [plan.python, "-I", "-S", "-B", "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=workdir,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        timed_out = False
        try:
            try:
                proc.stdin.write(job)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died before reading its job; the return code tells
            proc.wait(timeout=limits.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_everything(proc, uid, plan.python)
        stdout, stderr = _tail(out, limits.max_output_bytes), _tail(err, limits.max_output_bytes)
    code = proc.returncode
    if code == SETUP_FAILED and "sandbox setup failed" in stderr:
        timed_out = False
    passed = not timed_out and code == 0 and stdout.rstrip("\n").endswith(nonce)
    if passed:
        stdout = stdout.rstrip("\n")[: -len(nonce)].removesuffix("\n")
    return SandboxResult(code, stdout, stderr, timed_out, passed, uid)


def _tail(f: tempfile._TemporaryFileWrapper[bytes], limit: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")


def _kill_everything(proc: subprocess.Popen, uid: int | None, python: str) -> None:
    """SIGKILL the sandbox's process group, then (as root) every process of its uid, wherever it moved."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if uid is None:
        return
    for _ in range(10):
        if not _pids_of_uid(uid):
            return
        # kill(-1) as that uid reaches exactly its processes, atomically: a fork racing it is cancelled.
        subprocess.run(
            [python, "-I", "-S", "-c", "import os\ntry: os.kill(-1, 9)\nexcept ProcessLookupError: pass"],
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            stdin=subprocess.DEVNULL,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        time.sleep(0.01)


def _proc_status(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        status = _proc_status(pid)
        if status.get("Uid", "").split("\t")[0] == str(uid) and not status.get("State", "").startswith("Z"):
            pids.append(int(pid))
    return pids


def _count_tasks(uid: int) -> int:
    """Processes and threads the user runs now (what RLIMIT_NPROC counts)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        status = _proc_status(pid)
        if status.get("Uid", "").split("\t")[0] == str(uid):
            total += int(status.get("Threads", "1"))
    return total
