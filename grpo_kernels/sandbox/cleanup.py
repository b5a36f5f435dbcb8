"""Every process of a run dies before it returns: the kill of its process group, cgroup and uid; its cgroup's limits."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterable

from .plan import Plan, remove_cgroup, write


def kill_run(procs: list[subprocess.Popen], cgroup: str | None, uid: int | None, plan: Plan) -> None:
    """SIGKILL the launcher's process group (the launcher and the sample's init: with a PID namespace, the init's
    death takes every process of the sample with it), then the sample's cgroup, then (as root, without a PID
    namespace) every process of its uid."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        wait_group_gone(proc.pid)
    if cgroup:
        kill_cgroup(cgroup)
    if uid is not None and not plan.pid_ns:
        kill_uid(uid, plan.python)


def wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until no process of group `pgid` is alive but as a zombie. A SIGKILL takes effect later than kill()
    returns, and the sample's init (in the launcher's group) dies only once the kernel has killed and reaped every
    process of its PID namespace: until it is a zombie, some of the sample may still be alive (seen on a loaded
    machine). Only the members found at once are waited for, so a later group that reuses the number is not;
    `timeout` bounds the wait should a process hang in the kernel."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return  # no process of the group is left, not even a zombie: as after every run that ended by itself
    except PermissionError:
        pass  # some are left, of another uid
    deadline = time.monotonic() + timeout
    members = _alive_in_group(pgid, filter(str.isdigit, os.listdir("/proc")))
    while members and time.monotonic() < deadline:
        time.sleep(0.002)
        members = _alive_in_group(pgid, members)


def _alive_in_group(pgid: int, pids: Iterable[str]) -> list[str]:
    """Those of `pids` that are alive, not zombies, in process group `pgid`."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            alive.append(pid)
    return alive


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


def kill_uid(uid: int, python: str) -> None:
    # kill(-1) as that uid reaches exactly its processes, atomically: a fork racing it fails, since its parent
    # already has SIGKILL pending. It returns ESRCH only where no other process exists at all, so the helper
    # repeats it until /proc shows none of the uid's processes alive.
    subprocess.run(
        [python, "-I", "-S", "-c", _KILL_UID], user=uid, group=uid, extra_groups=[], env={}, timeout=30, check=False,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


_SAMPLES = itertools.count()


def sample_cgroup(plan: Plan, memory_bytes: int, max_processes: int) -> str | None:
    """A cgroup of the sample's own under the plan's, with its limits; None where the plan has no cgroup."""
    if not plan.cgroup:
        return None
    path = os.path.join(plan.cgroup, f"s{next(_SAMPLES)}")
    os.mkdir(path)
    try:
        for name, value in (
            ("memory.max", memory_bytes),
            ("memory.swap.max", 0),
            ("memory.oom.group", 1),
            ("pids.max", max_processes + 2),  # the launcher and the init count too
        ):
            try:
                write(os.path.join(path, name), str(value))
            except FileNotFoundError:
                if name != "memory.swap.max":  # no swap accounting on this kernel: nothing to limit
                    raise
    except OSError:
        remove_cgroup(path)
        raise
    return path


def kill_cgroup(path: str) -> None:
    kill = os.path.join(path, "cgroup.kill")  # Linux >= 5.14
    for _ in range(1000):
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            return
        if os.path.exists(kill):
            write(kill, "1")
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.001)


def oom_killed(path: str) -> bool:
    try:
        with open(os.path.join(path, "memory.events")) as f:
            return any(line.split()[0] == "oom_kill" and line.split()[1] != "0" for line in f)
    except OSError:
        return False


def count_tasks(uid: int) -> int:
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
