"""What this machine allows the sandbox: the layers of a run (a `Plan`), how each is detected, and what they guarantee.

`runner` confirms a plan by running a trivial program under it, and falls back layer by layer where one fails
(`weaker`: the layers changed, and the interpreter the sample can then read).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, replace

from . import view


@dataclass(frozen=True)
class Plan:
    python: str
    drop_uid: bool
    user_ns: bool
    pid_ns: bool
    mount_ns: bool
    net_ns: bool
    landlock_abi: int
    seccomp: bool
    cgroup: str | None  # the parent cgroup (v2, memory and pids controllers) of every sample's own
    fallback: str | None = None  # the layers the caller could have had that this machine would not set up, and why


def weaker(plan: Plan, **changes: object) -> Plan | None:
    """`plan` with `changes` to its layers, and the interpreter that the sample can then read (None: none can)."""
    plan = replace(plan, **changes)
    python = python_for(plan)
    return None if python is None else replace(plan, python=python)


def missing_layers(p: Plan, root: bool, seccomp_known: bool) -> list[str]:
    """The layers `p` lacks that its caller (root or not) could have on a machine that allows them all."""
    wanted = [
        ("a separate uid", root and not p.drop_uid),
        ("a user namespace", not root and not p.user_ns),
        ("a PID namespace", not p.pid_ns),
        ("a mount namespace", not p.mount_ns),
        ("a network namespace", not p.net_ns),
        ("Landlock", not p.landlock_abi),
        ("seccomp", seccomp_known and not p.seccomp),
        ("a cgroup v2 of its own (memory, pids)", root and not p.cgroup),
    ]
    return [name for name, lacking in wanted if lacking]


def python_for(plan: Plan) -> str | None:
    """The caller's interpreter, wherever the sample can read it: as the caller, or under a fresh uid through the
    mount namespace, which binds it back in where a private folder (/root, a home) would hide it. Else (a fresh
    uid with no mount namespace) the first interpreter anyone may run and read the standard library of."""
    if not plan.drop_uid or plan.mount_ns:
        return sys.executable
    for candidate in (
        sys.executable,
        getattr(sys, "_base_executable", ""),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ):
        if candidate and os.path.exists(candidate) and world_reachable(candidate):
            try:
                stdlib = [p for p in view.interpreter(candidate)["path"] if os.path.exists(p)]
            except (OSError, subprocess.SubprocessError, ValueError):
                continue
            if all(world_reachable(p, read=True) for p in stdlib):
                return candidate
    return None


def world_reachable(path: str, read: bool = False) -> bool:
    """True when a user with no relation to the file's owner can traverse to `path` and execute it (`read`: read
    it, and list it if it is a folder)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    if read:
        return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))
    return bool(mode & stat.S_IXOTH)


def landlock_abi_of_kernel() -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
        return max(int(abi), 0)
    except (OSError, AttributeError):
        return 0


def nproc_per_user_namespace() -> bool:
    """Whether RLIMIT_NPROC counts the processes of a user namespace alone (Linux >= 5.14, ucounts); before, a
    namespace's processes counted with all of the user's."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def counts_its_own(p: Plan) -> bool:
    """The kernel counts the sample's processes apart from everyone else's: a fresh uid, or a user namespace."""
    return p.drop_uid or (p.user_ns and nproc_per_user_namespace())


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


def cgroup_parent() -> str | None:
    """A cgroup v2 folder of our own with the memory and pids controllers for its children, or None."""
    base = own_cgroup2()
    if base is None:
        return None
    try:
        with open(os.path.join(base, "cgroup.controllers")) as f:
            available = set(f.read().split())
        if not {"memory", "pids"} <= available:
            return None
        # cpu where it can be had: each sample one weight, however many processes or sessions it makes
        wanted = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in available)
        write(os.path.join(base, "cgroup.subtree_control"), wanted)  # EBUSY where our cgroup has processes
        parent = os.path.join(base, f"grpo-sandbox-{os.getpid()}")
        os.makedirs(parent, exist_ok=True)
        write(os.path.join(parent, "cgroup.subtree_control"), wanted)
    except OSError:
        return None
    atexit.register(remove_cgroup, parent)
    return parent


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def describe(p: Plan, view: object) -> dict[str, object]:
    """What `isolation()` reports for plan `p` and the sample's `view` of the filesystem (`view.View`): its layers,
    and what each limit guarantees under them."""
    return {
        "fallback": p.fallback,
        "python": p.python,
        "callers_python": p.python == sys.executable,
        "separate_uid": p.drop_uid,
        "user_namespace": p.user_ns,
        "pid_namespace": p.pid_ns,
        "mount_namespace": p.mount_ns,
        "network_namespace": p.net_ns,
        "landlock_abi": p.landlock_abi,
        "seccomp": p.seccomp,
        "cgroup": p.cgroup,
        "memory": _memory(p),
        "shared_memory": _shared_memory(p),
        "processes": _processes(p),
        "quotas": "seccomp refuses io_setup, semget, mq_open, inotify and fanotify instances (machine- or user-wide "
        "quotas)"
        if p.seccomp
        else "shared with the machine: a sample can exhaust the AIO, SysV and inotify quotas while it lives",
        "disk": "a private tmpfs of disk_mb, seen by the sample alone: its folder, its /tmp and its /dev/shm"
        if p.mount_ns
        else "watched: the working folder's size, polled every 20 ms, plus RLIMIT_FSIZE per file; /tmp and /dev/shm "
        "are the machine's (refused where Landlock applies)",
        "cpu": _cpu(p),
        "cleanup": _cleanup(p),
        "cases": _cases(p),
        "unix_sockets": _unix_sockets(p),
        "packages": _packages(p),
        "hidden_folders": view.hide,
    }


def _own_namespaces(p: Plan) -> bool:
    """The sample has a PID and a mount namespace of its own: its init sees, counts and ends all of it."""
    return p.pid_ns and p.mount_ns


def _memory(p: Plan) -> str:
    if p.cgroup:
        return "cgroup v2 memory.max on the whole sample (no swap), shared memory included"
    if _own_namespaces(p):
        return (
            "watched: every 20 ms, the sample's total private resident memory plus the whole size of every shared "
            "mapping of each of its processes; plus each process's address space"
        )
    return "per process only (address space): a sample may hold max_processes × memory_mb"


def _shared_memory(p: Plan) -> str:
    shared = [
        layer
        for layer, on in (
            (
                "seccomp refuses memfd_create, memfd_secret, shmget, msgget and shared anonymous mmap over 1 MiB",
                p.seccomp,
            ),
            ("the IPC namespace allows 1 MiB of SysV shared memory and no message queues", p.net_ns),
            ("the watch counts every shared mapping whole", _own_namespaces(p) and not p.cgroup),
            ("the cgroup charges shared pages to the sample", bool(p.cgroup)),
        )
        if on
    ]
    return "; ".join(shared) or "invisible to every limit"


def _processes(p: Plan) -> str:
    if p.cgroup:
        return "cgroup v2 pids.max on the whole sample"
    if p.drop_uid:
        return "RLIMIT_NPROC of the sample's own uid: the whole sample, no one else's processes count"
    if p.user_ns and nproc_per_user_namespace():
        return "RLIMIT_NPROC in the sample's own user namespace: the whole sample, no one else's processes count"
    return (
        "counted by the sample's init every 20 ms (its descendants, threads included), killed over the limit; "
        "RLIMIT_NPROC is only a backstop shared with the user's other processes (64 full samples over their count)"
    )


def _cpu(p: Plan) -> str:
    """How the sample's processes share the CPU with its siblings."""
    try:
        with open(os.path.join(p.cgroup or "", "cgroup.subtree_control")) as f:
            if p.cgroup and "cpu" in f.read().split():
                return "cgroup v2 cpu.weight: the whole sample is one weight, as each sibling is"
    except OSError:
        pass
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroups = f.read().strip() == "1"
        with open("/proc/self/cgroup") as f:  # autogroups apply only in the root cpu cgroup
            in_root = all(line.rstrip("\n").endswith(":/") for line in f if ":cpu" in line or line.startswith("0::"))
    except OSError:
        autogroups = in_root = False
    if autogroups and in_root and p.seccomp:
        return "the sample's session is one scheduler autogroup, as each sibling's (setsid makes no new one)"
    if autogroups and in_root:
        return "the sample's session is one scheduler autogroup, but without seccomp setsid makes it more"
    return "per process: a sample's processes each compete with its siblings (no cgroup cpu controller, no autogroup)"


def _cleanup(p: Plan) -> str:
    if _own_namespaces(p):
        return "PID namespace: its init exits when the program does, and the kernel kills every process left"
    if p.drop_uid:
        return "kill(-1) as the sample's uid, repeated until none of its processes is alive"
    return "its process group only: a process that leaves it (setsid) survives the run"


def _cases(p: Plan) -> str:
    if _own_namespaces(p):
        return "each case: a fresh tmpfs folder; at its end kill(-1) from the init kills every process it started"
    return "each case: the folder emptied; at its end every descendant of the init (their subreaper) is killed" + (
        "" if p.drop_uid or p.user_ns else ", a daemon included (the whole sample's cleanup is weaker)"
    )


def _unix_sockets(p: Plan) -> str:
    layers = (
        (
            (
                "seccomp: socket() fails for every family, AF_UNIX (pathname and abstract) included, and "
                "socketpair() but for a connected AF_UNIX pair (no address: it reaches nothing but itself)"
            ),
            p.seccomp,
        ),
        ("the mount namespace hides the machine's /tmp, /run, /dev/shm and /var/tmp", p.mount_ns),
        ("Landlock scope: abstract sockets outside the sample are refused", p.landlock_abi >= 6),
    )
    return "; ".join(layer for layer, on in layers if on) or "reachable"


def _packages(p: Plan) -> str:
    hiding = [
        layer
        for layer, on in (
            ("Landlock reads only the system folders and the interpreter's standard library", p.landlock_abi),
            ("the mount namespace covers each with an empty read-only tmpfs", p.mount_ns),
        )
        if on
    ]
    if not hiding:
        return "readable: any installed package the file permissions allow"
    return (
        "hidden: site-packages, dist-packages and /usr/local (" + "; ".join(hiding) + "); only those named in "
        "packages=[...] are shown, read only"
    )


def remove_cgroup(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
