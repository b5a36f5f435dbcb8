"""What this machine allows the sandbox: the layers of a run (a `Plan`), how each is detected, and what they guarantee.

`runner` confirms a plan by running a trivial program under it, and falls back layer by layer where one fails.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import stat
from dataclasses import dataclass


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


def world_reachable(path: str) -> bool:
    """True when a user with no relation to the file's owner can traverse to `path` and execute it."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def landlock_abi_of_kernel() -> int:
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


def cgroup_parent() -> str | None:
    """A cgroup v2 folder of our own with the memory and pids controllers for its children, or None."""
    base = own_cgroup2()
    if base is None:
        return None
    try:
        with open(os.path.join(base, "cgroup.controllers")) as f:
            if not {"memory", "pids"} <= set(f.read().split()):
                return None
        write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")  # EBUSY where our cgroup has processes
        parent = os.path.join(base, f"grpo-sandbox-{os.getpid()}")
        os.makedirs(parent, exist_ok=True)
        write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    except OSError:
        return None
    atexit.register(remove_cgroup, parent)
    return parent


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def describe(p: Plan) -> dict[str, object]:
    """What `isolation()` reports for plan `p`: its layers, and what each limit guarantees under them."""
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


def remove_cgroup(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
