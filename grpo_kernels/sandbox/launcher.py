"""The sandboxed side of a run: apply the isolation layers a job asks for, then run the untrusted program.

Started by `runner` as `python -I -S -B -c <stub> <this folder> <job fd>`; stdlib only. Three processes:
- the launcher sets the rlimits, unshares the namespaces and forks
- an init (pid 1 of the new PID namespace) that mounts the sample's private tmpfs and a /proc of its own, watches
  the sample's total memory and reaps; when the program's process ends, the init exits, and with it the kernel
  kills every process left in the namespace;
- the program's process, which drops its privileges (a fresh uid, or no capabilities in a user namespace), restricts
  itself (no new privileges, Landlock, seccomp) and then runs the code: as `__main__` ("program" mode), by serving
  calls from the judge, one plain-data message each way ("functions" mode), or once per stdin input, each in a
  process forked for it, reporting each output to the caller ("cases" mode).
Nothing is exec'd once the privileges are gone, so a setuid binary or a new interpreter grants nothing back.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import time
import types

try:
    from . import restrict, wire
except ImportError:  # run as a script from its folder (see the module docstring)
    import restrict
    import wire

OVER_MEMORY = 96  # the exit status when the init killed the sample for its total memory


# ----------------------------------------------------------------------------------------------------------------
# The three processes


def main() -> None:
    sys.path.pop(0)  # the folder the stub put first: the code under test gets the plain standard library path
    fd = int(sys.argv[2])
    with os.fdopen(fd, "rb") as f:
        job = json.loads(f.read())
    restrict.prctl(restrict.PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")  # die with the trainer
    for name, value in job["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError) as err:
            restrict.fail(name, err)
    ns = job["namespaces"]
    flags = (restrict.CLONE_NEWUSER if ns["user"] else 0) | (restrict.CLONE_NEWPID if ns["pid"] else 0)
    flags |= (restrict.CLONE_NEWNS if ns["mount"] else 0) | (
        restrict.CLONE_NEWNET | restrict.CLONE_NEWIPC if ns["net"] else 0
    )
    if flags:
        uid, gid = os.getuid(), os.getgid()
        restrict.check(restrict.libc.unshare(ctypes.c_int(flags)), "unshare")
        if flags & restrict.CLONE_NEWUSER:  # the caller's own ids, mapped to themselves
            for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
    pid = os.fork()
    if pid == 0:
        init(job)
    for fd in (*job["fds"], job["status_fd"]):
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0 or 128 < code < 128 + signal.NSIG:  # the program died of a signal: so does the launcher
        sig = -code if code < 0 else code - 128
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, and refuse a handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code)


def init(job: dict) -> None:
    """pid 1 of the sample's namespace: the mounts, the memory watch, reaping; exits when the program's process does."""
    restrict.prctl(restrict.PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    ns, workdir, uid = job["namespaces"], job["workdir"], job["uid"]
    owner = uid if uid is not None else os.getuid()
    nosuid = restrict.MS_NOSUID | restrict.MS_NODEV
    try:
        if ns["mount"]:
            restrict.mount(None, "/", None, restrict.MS_REC | restrict.MS_PRIVATE)  # nothing propagates out
            opts = f"size={job['disk_bytes']},nr_inodes=4096,mode=0700,uid={owner},gid={owner}"
            restrict.mount("tmpfs", workdir, "tmpfs", nosuid, opts)
            hide_shared_folders(workdir, owner)
            if ns["pid"]:  # a /proc that shows only the sample's own processes
                restrict.mount("proc", "/proc", "proc", nosuid | restrict.MS_NOEXEC)
        elif uid is not None:
            os.chown(workdir, uid, uid)
    except OSError as err:
        restrict.fail("mount", err)
    restrict.prctl(restrict.PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE")  # the program may not trace us or open our /proc
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: as pid 1, the sample cannot signal us at all
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    child = os.fork()
    if child == 0:
        os.close(job["status_fd"])  # the init's alone: what it reports, the program cannot forge
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        restrict_and_run(job)
    for fd in job["fds"]:
        os.close(fd)
    watch = job["memory_bytes"] if ns["pid"] and ns["mount"] else None
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(1)
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)  # the kernel now kills the rest of the namespace
            if pid == 0:
                break
        if watch is not None and resident_pages() * page > watch:
            os.write(job["status_fd"], b"memory\n")  # before the exit, hence before the judge can see the end
            os._exit(OVER_MEMORY)
        signal.sigtimedwait([signal.SIGCHLD], 0.02)


def hide_shared_folders(workdir: str, owner: int) -> None:
    """Over the folders where local sockets and shared files live, an empty read-only tmpfs (/run, /dev/shm,
    /var/tmp) or the sample's own tmpfs (/tmp, with the working folder inside): nothing there can be reached or
    filled from the sample."""
    for path in ("/run", "/dev/shm", "/var/tmp"):
        if os.path.isdir(path) and not os.path.islink(path):
            flags = restrict.MS_RDONLY | restrict.MS_NOSUID | restrict.MS_NODEV | restrict.MS_NOEXEC
            restrict.mount("tmpfs", path, "tmpfs", flags, "size=4k,nr_inodes=1,mode=0555")
    parent, name = os.path.split(workdir)
    if parent == "/tmp":  # the working folder moves into its own tmpfs, which then covers /tmp
        inner = os.path.join(workdir, name)
        os.mkdir(inner, 0o700)
        os.chown(inner, owner, owner)
        restrict.mount(workdir, "/tmp", None, restrict.MS_BIND)


def resident_pages() -> int:
    """Resident pages not backed by a file, over every process this /proc shows (the sample's, in its own PID
    namespace): what the sample's heaps and stacks hold; its files live in the tmpfs, bounded by the disk quota."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/statm", "rb") as f:
                    fields = f.read().split()
                total += int(fields[1]) - int(fields[2])  # resident - shared (file-backed)
            except (OSError, IndexError, ValueError):
                pass  # it ended meanwhile
    return total


def restrict_and_run(job: dict) -> None:
    workdir, uid, machine = job["workdir"], job["uid"], os.uname().machine
    if uid is not None:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as err:
            restrict.fail("setuid", err)
    elif job["namespaces"]["user"]:
        restrict.drop_capabilities(machine)
    restrict.prctl(restrict.PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")  # set after setuid, which clears it
    restrict.prctl(restrict.PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")
    if job["landlock_abi"]:
        restrict.apply_landlock(job["landlock_abi"], workdir)
    if job["seccomp"]:
        if machine not in restrict.SYSCALLS:
            restrict.fail("seccomp", f"no syscall table for {machine}")
        restrict.apply_seccomp(machine)
    os.chdir(workdir)
    sys.argv[:] = ["solution.py"]
    sys.orig_argv[:] = [sys.executable, "solution.py"]
    if job["mode"] == "functions":
        serve(job["program"], *job["fds"])
    if job["mode"] == "cases":
        run_cases(job["program"], job["cases"], *job["fds"], job["case_seconds"], job["output_bytes"])
    run_program(job["program"])


def run_program(program: str | types.CodeType) -> None:
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        code = compile(program, "solution.py", "exec") if isinstance(program, str) else program
        exec(code, scope)  # noqa: S102 - running it is the point, in here
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        flush_and_exit(code)
    except BaseException:  # noqa: BLE001 - any way out but an exit is a failure
        import traceback  # only a failing program pays for it

        traceback.print_exc()
        flush_and_exit(1)
    flush_and_exit(0)


def run_cases(program: str, inputs: list[str], replies: int, seconds: float, output_bytes: int) -> None:
    """Run `program` once per input, each in a process of its own forked from here with that input on stdin, and
    report each exit status and output to the caller, which compares them (and times the reports itself)."""
    try:
        code = compile(program, "solution.py", "exec")
    except (SyntaxError, ValueError) as err:
        code = None
        error = f"{type(err).__name__}: {err}"
    for i, given in enumerate(inputs):
        if code is None:
            wire.send(replies, {"case": i, "status": 1, "stdout": "", "error": error})
            continue
        stdin, stdout = os.memfd_create("stdin"), os.memfd_create("stdout")
        os.write(stdin, given.encode())
        os.lseek(stdin, 0, os.SEEK_SET)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            os.dup2(stdin, 0)
            os.dup2(stdout, 1)
            for fd in (stdin, stdout, replies):
                os.close(fd)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            run_program(code)
        status, timed_out = wait_for(pid, seconds)
        try:
            os.killpg(pid, signal.SIGKILL)  # what this case left running (a setsid one dies with the sample)
        except OSError:
            pass
        size = os.lseek(stdout, 0, os.SEEK_END)
        os.lseek(stdout, 0, os.SEEK_SET)
        out = os.read(stdout, output_bytes + 1) if size else b""
        os.close(stdin)
        os.close(stdout)
        report = {"case": i, "status": status, "timed_out": timed_out, "stdout": out.decode("utf-8", "replace")}
        wire.send(replies, report | {"cut": size > output_bytes})
    flush_and_exit(0)


def wait_for(pid: int, seconds: float) -> tuple[int, bool]:
    """(exit status, timed out) of child `pid`, killed after `seconds` of wall clock."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        signal.sigtimedwait([signal.SIGCHLD], min(left, 0.05))


def flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)  # no atexit hooks or lingering threads of the code under test


def serve(program: str, calls: int, replies: int) -> None:
    """Run `program`, offer its top-level names to the judge, then answer the judge's calls until it hangs up."""
    scope = {"__name__": "__main__", "__builtins__": builtins}
    objects: list[object] = []

    def offer(value: object) -> list:
        try:
            return wire.encode(value)
        except wire.NotPlain:
            objects.append(value)
            return ["h", len(objects) - 1]

    def argument(tree: list) -> object:
        value = wire.decode(tree)
        return objects[value.id] if type(value) is wire.Handle else value

    try:
        exec(compile(program, "solution.py", "exec"), scope)  # noqa: S102 - running it is the point, in here
    except BaseException:  # noqa: BLE001 - a solution that does not load offers nothing
        import traceback  # only a failing program pays for it

        wire.send(replies, {"error": traceback.format_exc(limit=-3)[-2000:]})
        flush_and_exit(1)
    public = {k: v for k, v in scope.items() if not k.startswith("__")}
    names = {k: offer(v) for k, v in public.items() if not isinstance(v, types.ModuleType)}
    modules = {k: v.__name__ for k, v in public.items() if isinstance(v, types.ModuleType)}
    wire.send(replies, {"names": names, "modules": modules})
    reader = wire.Reader(calls)
    while (message := reader.receive()) is not None:
        try:
            target = message["target"]
            obj = scope[target] if isinstance(target, str) else objects[target]
            if message["op"] == "get":
                value = getattr(obj, message["attr"])
            else:
                args = [argument(a) for a in message["args"]]
                kwargs = {k: argument(v) for k, v in message["kwargs"].items()}
                value = obj(*args, **kwargs)
            reply = {"ok": offer(value)}
        except BaseException as exc:  # noqa: BLE001 - every failure of a call goes back to the judge
            try:
                reply = {"raise": [type(exc).__name__, str(exc)[:2000]]}
            except BaseException:  # noqa: BLE001 - an exception whose str() raises
                reply = {"raise": [type(exc).__name__, ""]}
        wire.send(replies, reply)
    flush_and_exit(0)


if __name__ == "__main__":
    main()
