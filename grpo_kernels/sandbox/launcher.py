"""The sandboxed side of a run: apply the isolation layers a job asks for, then run the untrusted program.

Started by `runner` as `python -I -S -B -c <stub> <this folder> <job fd>`; stdlib only. Three kinds of process:
- the launcher unshares the namespaces, sets the rlimits (after a new user namespace, so that its process count is
  the sample's alone) and forks
- an init (pid 1 of the new PID namespace) that mounts the sample's view of the filesystem (`view`), its private
  tmpfs and a /proc of its own, sets its IPC namespace's limits, watches the sample's total memory and reaps; when
  the program's process ends, the init exits, and with it the kernel kills every process left in the namespace;
- the program's process, which drops its privileges (a fresh uid, or no capabilities in a user namespace), restricts
  itself (no new privileges, Landlock, seccomp) and then runs the code: as `__main__` ("program" mode), or by
  serving calls from the judge, one plain-data message each way ("functions" mode). In "cases" mode the init forks
  one such process per stdin input, each from a fresh folder, passes its output on to the caller as it comes, and
  kills every process of the case when it ends. The rlimits but RLIMIT_NPROC are the program's processes' alone.
Nothing is exec'd once the privileges are gone, so a setuid binary or a new interpreter grants nothing back.
"""

from __future__ import annotations

import builtins
import ctypes
import os
import resource
import select
import signal
import sys
import time
import types
from collections.abc import Callable

try:
    from . import restrict, wire
except ImportError:  # run as a script from its folder (see the module docstring)
    import restrict
    import wire

OVER_MEMORY = 96  # the exit status when the init killed the sample for its total memory
OVER_PROCESSES = 95  # ... for its number of processes (counted by the init only where no namespace counts them)
PR_SET_CHILD_SUBREAPER = 36
MNT_DETACH = 2


# ----------------------------------------------------------------------------------------------------------------
# The launcher and the init


def main() -> None:
    sys.path.pop(0)  # the folder the stub put first: the code under test gets the plain standard library path
    fd = int(sys.argv[2])
    with os.fdopen(fd, "rb") as f:
        job = wire.loads(f.read())
    restrict.prctl(restrict.PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")  # die with the trainer
    ns = job["namespaces"]
    flags = (restrict.CLONE_NEWUSER if ns["user"] else 0) | (restrict.CLONE_NEWPID if ns["pid"] else 0)
    flags |= (restrict.CLONE_NEWNS if ns["mount"] else 0) | (
        restrict.CLONE_NEWNET | restrict.CLONE_NEWIPC if ns["net"] else 0
    )
    if flags:
        uid, gid = os.getuid(), os.getgid()
        restrict.check(restrict.libc.unshare(ctypes.c_int(flags)), "unshare")
        if flags & restrict.CLONE_NEWUSER:  # the caller as the namespace's root: it owns the IPC limits' files
            for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
    # After the unshare: in a user namespace of its own, RLIMIT_NPROC counts the processes of that namespace
    # (Linux >= 5.14), so other samples and other processes of the same user no longer use up this one's. The
    # other limits are the program's processes' own (`set_limits`): none is spent by the launcher or the init,
    # however many cases they run.
    set_limits(job["rlimits"], ("RLIMIT_NPROC",))
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


def set_limits(rlimits: dict[str, int], only: tuple[str, ...] | None = None) -> None:
    """Set each named rlimit (soft and hard) to its value; a limit the kernel refuses fails the run by name."""
    for name, value in rlimits.items():
        if only is None or name in only:
            try:
                resource.setrlimit(getattr(resource, name), (value, value))
            except (ValueError, OSError) as err:
                restrict.fail(name, err)


def init(job: dict) -> None:
    """pid 1 of the sample's namespace: the mounts, the watch, reaping; exits when the program's process does
    (in "cases" mode, when the last case has been reported)."""
    restrict.prctl(restrict.PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    ns, workdir, uid = job["namespaces"], job["workdir"], job["uid"]
    try:
        if ns["mount"]:
            restrict.mount(None, "/", None, restrict.MS_REC | restrict.MS_PRIVATE)  # nothing propagates out
            apply_view(job["view"])
            hide_shared_folders()
            fresh_folder(job, first=True)
            if ns["pid"]:  # a /proc that shows only the sample's own processes
                restrict.mount("proc", "/proc", "proc", restrict.MS_NOSUID | restrict.MS_NODEV | restrict.MS_NOEXEC)
        elif uid is not None:
            os.chown(workdir, uid, uid)
    except OSError as err:
        restrict.fail("mount", err)
    if ns["net"]:  # the IPC namespace came with the network one
        limit_ipc()
    restrict.prctl(restrict.PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE")  # the program may not trace us or open our /proc
    if not ns["pid"]:  # orphans stay our descendants: countable, and killable at the end of a case
        restrict.prctl(PR_SET_CHILD_SUBREAPER, 1, "PR_SET_CHILD_SUBREAPER")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: as pid 1, the sample cannot signal us at all
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    # Each program's process (each case) compiles the program, and a process's first compile() readies the ~120
    # classes of the AST module (to see whether it was given one). A launcher read from bytecode, as an installed
    # package is, has compiled nothing: done here, once, and every fork inherits them.
    compile("", "<init>", "exec", dont_inherit=True)
    if job["mode"] == "cases":
        run_cases(job)
    child = start_program(job, job["fds"])
    for fd in job["fds"]:
        os.close(fd)
    code, _ = supervise(job, child, None)
    os._exit(128 - code if code < 0 else code)  # the kernel now kills the rest of the namespace


def start_program(job: dict, keep: list[int], case: CaseStreams | None = None) -> int:
    """Fork the program's process, with the init's descriptors in `keep` (functions mode: the judge's pipes) and,
    for a case, its streams as stdin, stdout and stderr; it closes every other one the init holds."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    child = os.fork()
    if child == 0:
        os.close(job["status_fd"])  # the init's alone: what it reports, the program cannot forge
        for fd in job["fds"]:
            if fd not in keep:
                os.close(fd)
        if case is not None:
            for target, fd in enumerate(case.given()):
                os.dup2(fd, target)
            case.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        restrict_and_run(job)
    return child


def supervise(job: dict, child: int, deadline: float | None, case: CaseStreams | None = None) -> tuple[int, bool]:
    """Reap until `child` ends or `deadline` passes (then kill it): (its exit status, timed out). Meanwhile watch the
    sample's total memory (own namespaces) or its process count (without them), every 20 ms; over either, report and
    exit. A case's output is passed on as it comes (`CaseStreams.pump`)."""
    ns = job["namespaces"]
    memory = job["memory_bytes"] if ns["pid"] and ns["mount"] else None
    processes = job["max_processes"] if job["count_processes"] else None
    timed_out, last_look = False, 0.0
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(1)
            if pid == child:
                return os.waitstatus_to_exitcode(status), timed_out
            if pid == 0:
                break
        if time.monotonic() - last_look >= 0.02:
            last_look = time.monotonic()
            if memory is not None and sample_memory() > memory:
                over(job, b"memory\n", OVER_MEMORY)
            if processes is not None and sum(descendants().values()) > processes:
                over(job, b"processes\n", OVER_PROCESSES, kill_descendants)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0 and not timed_out:
            os.kill(child, signal.SIGKILL)
            timed_out = True
        wait = 0.02 if left is None or left <= 0 else min(left, 0.02)
        if case is None:
            signal.sigtimedwait([signal.SIGCHLD], wait)
        elif case.pump(wait):
            os.kill(child, signal.SIGKILL)  # over the output limit: it fails whatever it does next


def over(job: dict, what: bytes, code: int, then: Callable[[], None] | None = None) -> None:
    """Report the limit the sample went over, then (after `then`) exit: the report comes first, before the end of
    any process that the caller or the judge could see end."""
    os.write(job["status_fd"], what)
    if then is not None:
        then()
    os._exit(code)


def run_cases(job: dict) -> None:
    """Run the program once per input, each in a process of its own with that input on stdin and `case_seconds`
    of wall clock, from a fresh folder; kill every process the case left; report its status, with its output."""
    reports, inputs, offset = job["fds"][0], job["fds"][1], 0
    for i, size in enumerate(job["case_sizes"]):
        if i:
            fresh_folder(job, first=False)
        case = CaseStreams(i, reports, job["output_bytes"], inputs, offset, size)
        offset += size
        child = start_program(job, [], case)
        case.started(child)
        status, timed_out = supervise(job, child, time.monotonic() + job["case_seconds"], case)
        end_case(job)
        case.finish()
        send_frame(reports, {"case": i, "status": status, "timed_out": timed_out, "cut": case.cut})
    os._exit(0)


class CaseStreams:
    """One case's stdin (a file in memory holding its input) and its stdout and stderr (pipes the init drains: its
    stdout goes on to the caller as it comes, up to `limit` bytes; its stderr is the case's alone, and dropped)."""

    def __init__(self, index: int, reports: int, limit: int, inputs: int, offset: int, size: int) -> None:
        self.index, self.reports, self.limit, self.sent, self.cut = index, reports, limit, 0, False
        self.stdin = os.memfd_create("stdin", os.MFD_CLOEXEC)
        while size > 0:  # a copy inside the kernel: the init never holds the input
            copied = os.sendfile(self.stdin, inputs, offset, size)
            offset, size = offset + copied, size - copied
        os.lseek(self.stdin, 0, os.SEEK_SET)
        (self.out, out_w), (self.err, err_w) = os.pipe(), os.pipe()
        self.ends = [self.stdin, out_w, err_w]
        self.open = [self.out, self.err]  # the streams not yet at their end
        self.pidfd: int | None = None

    def given(self) -> list[int]:
        """The program's stdin, stdout and stderr."""
        return self.ends

    def close(self) -> None:
        """In the program's process, once they are its 0, 1 and 2: every other descriptor of the case."""
        for fd in (*self.ends, self.out, self.err):
            os.close(fd)

    def started(self, child: int) -> None:
        """In the init, once the program's process holds them: its ends go, and its end can wake `pump`."""
        for fd in self.ends:
            os.close(fd)
        try:
            self.pidfd = os.pidfd_open(child)
        except (AttributeError, OSError):
            self.pidfd = None  # before Linux 5.3: `pump` waits its whole timeout

    def pump(self, timeout: float) -> bool:
        """Pass on what the case wrote, waiting up to `timeout` for it (or for the program's end): over the limit?"""
        watched = [fd for fd in (*self.open, self.pidfd) if fd is not None]
        for fd in select.select(watched, [], [], timeout)[0]:
            if fd != self.pidfd and not self.read(fd):
                self.open.remove(fd)  # at its end: no longer ready-to-read news
        return self.cut

    def read(self, fd: int) -> bool:
        """Read one chunk of `fd` on; False at its end (every writer gone)."""
        chunk = os.read(fd, 2**20)
        if fd == self.out and chunk and not self.cut:
            if self.sent + len(chunk) > self.limit:
                self.cut = True
            else:
                send_frame(self.reports, {"case": self.index, "out": len(chunk)}, chunk)
                self.sent += len(chunk)
        return bool(chunk)

    def finish(self) -> None:
        """Every process of the case is dead: read what is left of its output, then close the rest."""
        for fd in self.open:
            while self.read(fd):
                pass
        for fd in (self.out, self.err):
            os.close(fd)
        if self.pidfd is not None:
            os.close(self.pidfd)


def send_frame(fd: int, header: dict, data: bytes = b"") -> None:
    """One frame to the caller: a JSON line, then the `data` bytes its header announces (`out`)."""
    view = memoryview(wire.dumps(header).encode() + b"\n" + data)
    while view:
        view = view[os.write(fd, view) :]


def end_case(job: dict) -> None:
    """Kill every process the case left: in the PID namespace, everything but the init (kill(-1) from pid 1 reaches
    exactly that, and a process it reaches can no longer fork); without one, every descendant (the init is their
    subreaper, so a setsid daemon is one too)."""
    if job["namespaces"]["pid"]:
        for _ in range(10_000):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return
            reap()
            signal.sigtimedwait([signal.SIGCHLD], 0.005)
    else:
        kill_descendants()


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


# ----------------------------------------------------------------------------------------------------------------
# The folders, the IPC limits, the watch


def apply_view(view: dict) -> None:
    """Cover each hidden folder with an empty tmpfs and bind each shown path back, read only, outermost first
    (a shown interpreter may hold a hidden folder of its own). Every shown path is opened before the first mount,
    and bound from that descriptor: once its folder is covered, its name no longer reaches it."""
    sources = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in view["show"] if os.path.exists(p)}
    try:
        mount, nosuid = restrict.mount, restrict.MS_NOSUID | restrict.MS_NODEV
        ro = restrict.MS_RDONLY | nosuid
        steps = sorted([(p, "hide") for p in view["hide"]] + [(p, "show") for p in sources], key=lambda s: s[0])
        for path, kind in steps:
            if kind == "hide":
                mount("tmpfs", path, "tmpfs", nosuid, "size=64k,nr_inodes=256,mode=0755")
                continue
            if os.path.isdir(f"/proc/self/fd/{sources[path]}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            elif not os.path.exists(path):
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            mount(f"/proc/self/fd/{sources[path]}", path, None, restrict.MS_BIND | restrict.MS_REC)
            mount(None, path, None, restrict.MS_REMOUNT | restrict.MS_BIND | ro | _locked(path))
        for path in view["hide"]:  # the skeletons made, nothing more may be written there
            mount(None, path, None, restrict.MS_REMOUNT | ro)
    finally:
        for fd in sources.values():
            os.close(fd)


def _locked(path: str) -> int:
    """The flags of the mount at `path` that a remount in a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    return (f & (os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)) | (0x200000 if f & os.ST_RELATIME else 0)


def fresh_folder(job: dict, *, first: bool) -> None:
    """The sample's folders, empty. In the mount namespace: one tmpfs of `disk_bytes`, made anew for each case,
    whose two halves are its /tmp (its working folder inside) and its /dev/shm, wherever the caller's own folder is;
    without one, the caller's folder emptied."""
    owner = job["uid"] if job["uid"] is not None else os.getuid()
    if not job["namespaces"]["mount"]:
        empty_folder(job["workdir"])
        return
    shm = os.path.isdir("/dev/shm") and not os.path.islink("/dev/shm")
    if not first:  # the binds, then the tmpfs under them
        for path in ("/dev/shm", "/tmp", "/tmp") if shm else ("/tmp", "/tmp"):
            restrict.check(restrict.libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
    opts = f"size={job['disk_bytes']},nr_inodes=4096,mode=0700,uid={owner},gid={owner}"
    restrict.mount("tmpfs", "/tmp", "tmpfs", restrict.MS_NOSUID | restrict.MS_NODEV, opts)
    for half in ("/tmp/tmp", "/tmp/shm"):
        os.mkdir(half, 0o700)
        os.chown(half, owner, owner)
    if shm:
        restrict.mount("/tmp/shm", "/dev/shm", None, restrict.MS_BIND)
    restrict.mount("/tmp/tmp", "/tmp", None, restrict.MS_BIND)
    os.mkdir(job["folder"], 0o700)
    os.chown(job["folder"], owner, owner)


def empty_folder(path: str) -> None:
    """Remove everything inside `path`, whatever modes the sample left on it (we own it, or are root)."""
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            empty_folder(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


def hide_shared_folders() -> None:
    """Over the folders where local sockets and shared files live, an empty read-only tmpfs: nothing there can be
    reached or filled from the sample (/tmp and /dev/shm are its own tmpfs, see `fresh_folder`)."""
    for path in ("/run", "/var/tmp"):
        if os.path.isdir(path) and not os.path.islink(path):
            flags = restrict.MS_RDONLY | restrict.MS_NOSUID | restrict.MS_NODEV | restrict.MS_NOEXEC
            restrict.mount("tmpfs", path, "tmpfs", flags, "size=4k,nr_inodes=1,mode=0555")


def limit_ipc() -> None:
    """The sample's IPC namespace: SysV shared memory of at most `SHARED_MAP_BYTES` in all, no message queues, no
    POSIX message queues (seccomp refuses these calls already; this holds where it cannot apply). Where the kernel
    does not let the namespace's owner set them (before Linux 5.19 in a user namespace), they stay as they were."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name, value in (
        ("kernel/shmmax", restrict.SHARED_MAP_BYTES),
        ("kernel/shmall", restrict.SHARED_MAP_BYTES // page),
        ("kernel/shmmni", 1),
        ("kernel/msgmni", 0),
        ("fs/mqueue/queues_max", 0),
    ):
        try:
            with open(f"/proc/sys/{name}", "w") as f:
                f.write(str(value))
        except OSError:
            pass


def sample_memory() -> int:
    """Bytes the sample holds, over every process this /proc shows (the sample's, in its own PID namespace): its
    resident pages not backed by a file (heaps, stacks) and, whole, every shared mapping, resident or not (a page of
    shared memory is resident in one process at most, yet held by all that map it). Its files live in the tmpfs,
    bounded by the disk quota."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/statm", "rb") as f:
                    fields = f.read().split()
                total += (int(fields[1]) - int(fields[2])) * page  # resident - shared (file-backed and shmem)
                with open(f"/proc/{name}/maps", "rb") as f:
                    total += shared_bytes(f.read())
            except (OSError, IndexError, ValueError):
                pass  # it ended meanwhile
    return total


def shared_bytes(maps: bytes) -> int:
    """The size of the shared mappings in a /proc/PID/maps ("start-end perms ...", perms ending in s)."""
    total = 0
    for line in maps.splitlines():
        span, _, rest = line.partition(b" ")
        if rest[3:4] == b"s":
            start, _, end = span.partition(b"-")
            total += int(end, 16) - int(start, 16)
    return total


def descendants() -> dict[str, int]:
    """The init's descendants, as this /proc numbers them, each with its number of threads (RLIMIT_NPROC counts
    threads)."""
    own = os.readlink("/proc/self")
    found: dict[str, int] = {}
    todo = [own]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # it ended meanwhile
        if pid != own:
            found[pid] = len(tasks)
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += f.read().split()
            except OSError:
                pass
    return found


def kill_descendants() -> None:
    """SIGKILL every descendant until none is left: a process with a kill pending can no longer fork, so each pass
    leaves only what was forked since the last look, and the next one finds those."""
    for _ in range(10_000):
        found = descendants()
        if not found:
            return
        for pid in found:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()
        signal.sigtimedwait([signal.SIGCHLD], 0.005)


# ----------------------------------------------------------------------------------------------------------------
# The program's process


def restrict_and_run(job: dict) -> None:
    """In the program's process: its limits, its identity, the restrictions, then the program, as `python
    solution.py` would run it from its folder (`run_program`), or serving the judge's calls ("functions" mode)."""
    folder, uid, machine = job["folder"], job["uid"], os.uname().machine
    set_limits(job["rlimits"])  # before the uid changes: raising a hard limit may need root
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
        restrict.apply_landlock(job["landlock_abi"], job["writable"], job["readable"], job["path"])
    if job["seccomp"]:
        if machine not in restrict.SYSCALLS:
            restrict.fail("seccomp", f"no syscall table for {machine}")
        restrict.apply_seccomp(machine)
    os.chdir(folder)
    sys.path += job["path"]  # the folders of the packages the caller named (only those are visible there)
    sys.executable = job["executable"]  # the caller's interpreter, where the sample can run it
    sys.argv[:] = ["solution.py"]
    sys.orig_argv[:] = [sys.executable, "solution.py"]
    builtins.exit, builtins.quit = Quitter("exit"), Quitter("quit")  # what `site` adds (the launcher runs with -S)
    if job["mode"] == "functions":
        serve(job["program"], *job["fds"])
    run_program(main_module(job["program"]), job["program"])


class Quitter:
    """`exit` and `quit`, as the interpreter's `site` module defines them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code: object = None) -> None:
        try:
            sys.stdin.close()
        except (OSError, ValueError, AttributeError):
            pass
        raise SystemExit(code)


def main_module(program: str) -> types.ModuleType:
    """The module `__main__` the program runs as: `solution.py` in its folder, holding its source (`__file__`,
    `inspect.getsource`, pickling its own classes and `multiprocessing` all find it there)."""
    path = os.path.join(os.getcwd(), "solution.py")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
    except OSError as err:  # a source over max_file_mb or disk_mb
        restrict.fail("solution.py", err)
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = path, builtins
    sys.modules["__main__"] = module
    return module


def run_program(module: types.ModuleType, program: str) -> None:
    """Run `program` in `module`, then leave as the interpreter does (`shut_down`): an exception's traceback and
    status 1, or the status `SystemExit` gives."""
    try:
        exec(compile(program, module.__file__, "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - the point
    except SystemExit as exc:
        shut_down(module, exit_status(exc.code))
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter would, without this frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        shut_down(module, 1)
    shut_down(module, 0)


def exit_status(code: object) -> int:
    """The status `SystemExit(code)` ends the interpreter with (a code neither None nor an int is printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - a code whose str() raises
        pass
    return 1


def shut_down(module: types.ModuleType, code: int) -> None:
    """The interpreter's own way out, in its order: join the non-daemon threads, run the `atexit` hooks, let the
    program's module go (an open file it holds, `open(1, 'w')`, is flushed and closed), flush the standard streams,
    then exit. The rest of a full interpreter shutdown (tens of ms per stdin/stdout case) is skipped."""
    import atexit

    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
        module.__dict__.clear()
    except BaseException as exc:  # noqa: BLE001 - an exit called from a hook: the interpreter stops there too
        code = exit_status(exc.code) if isinstance(exc, SystemExit) else code
    flush_and_exit(code)


def flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def serve(program: str, calls: int, replies: int) -> None:
    """Run what the judge sends first (the setup's imports and classes, one statement each), then `program`; offer
    its top-level names to the judge, then answer the judge's calls until it hangs up. A value crosses as plain data
    (the setup's classes by their fields), an iterator as its items, a chunk at a time; anything else stays here."""
    module = main_module(program)  # `__file__`, `inspect.getsource` and pickling its classes work here too
    scope = module.__dict__
    objects: list[object] = []
    chunks: dict[int, int] = {}  # an iterator's id -> how many items its next chunk holds
    reader = wire.Reader(calls)
    prelude = reader.receive() or {}
    for statement in prelude.get("source", []):
        try:
            exec(compile(statement, "setup.py", "exec", dont_inherit=True), scope)  # noqa: S102 - trusted
        except Exception:  # noqa: BLE001 - an import this sandbox cannot see: the solution may not need it
            pass
    crossing = [k for k in prelude.get("classes", []) if isinstance(k, str) and k.isidentifier()]
    given = {k: scope[k] for k in crossing if isinstance(scope.get(k), type)}  # the setup's
    made: dict[str, type] = {}  # a bare class of the name, where neither the setup nor the solution defines one

    def classes(decoding: bool) -> dict:  # the classes whose instances cross by their fields, by name
        found = {}
        for k in crossing:
            own = scope[k] if isinstance(scope.get(k), type) else None
            if decoding:
                found[k] = own or given.get(k) or made.setdefault(k, type(k, (), {}))
            else:
                found[k] = tuple(c for c in (own, given.get(k), made.get(k)) if c is not None)
        return found

    def handle(value: object) -> list:
        objects.append(value)
        return ["h", len(objects) - 1]

    def chunk(key: int) -> list:
        items, size, more = [], chunks[key], ["h", key]
        chunks[key] = min(2 * size, 1 << 16)
        try:
            for _ in range(size):
                items.append(next(objects[key]))
        except StopIteration:
            more = ["n"]
        except Exception as exc:  # noqa: BLE001 - raised by the iterator: the judge raises it after the items
            more = ["X", type(exc).__name__, str(exc)[:2000]]
        try:
            return ["I", wire.encode(items, classes(False)), more]
        except wire.NotPlain as exc:
            return ["I", ["l", []], ["X", "TypeError", f"the iterator yielded {exc}"]]

    def offer(value: object) -> list:
        try:
            return wire.encode(value, classes(False))
        except wire.NotPlain:
            pass
        try:
            iterator = hasattr(type(value), "__next__") and iter(value) is value
        except Exception:  # noqa: BLE001 - whatever its __iter__ does, it stays here
            iterator = False
        if iterator:
            handle(value)
            chunks[len(objects) - 1] = 256
            return chunk(len(objects) - 1)
        return handle(value)

    def argument(tree: list) -> object:
        value = wire.decode(tree, classes(True))
        return objects[value.id] if type(value) is wire.Handle else value

    try:
        exec(compile(program, module.__file__, "exec", dont_inherit=True), scope)  # noqa: S102 - the point
    except BaseException:  # noqa: BLE001 - a solution that does not load offers nothing
        import traceback  # only a failing program pays for it

        wire.send(replies, {"error": traceback.format_exc(limit=-3)[-2000:]})
        flush_and_exit(1)
    public = {k: v for k, v in scope.items() if not k.startswith("__")}
    names = {k: offer(v) for k, v in public.items() if not isinstance(v, types.ModuleType)}
    modules = {k: v.__name__ for k, v in public.items() if isinstance(v, types.ModuleType)}
    wire.send(replies, {"names": names, "modules": modules})
    while (message := reader.receive()) is not None:
        try:
            target = message["target"]
            obj = scope[target] if isinstance(target, str) else objects[target]
            if message["op"] == "more":
                reply = {"ok": chunk(target)}
            elif message["op"] == "get":
                reply = {"ok": offer(getattr(obj, message["attr"]))}
            else:
                args = [argument(a) for a in message["args"]]
                kwargs = {k: argument(v) for k, v in message["kwargs"].items()}
                reply = {"ok": offer(obj(*args, **kwargs))}
        except BaseException as exc:  # noqa: BLE001 - every failure of a call goes back to the judge
            try:
                reply = {"raise": [type(exc).__name__, str(exc)[:2000]]}
            except BaseException:  # noqa: BLE001 - an exception whose str() raises
                reply = {"raise": [type(exc).__name__, ""]}
        wire.send(replies, reply)
    flush_and_exit(0)


if __name__ == "__main__":
    main()
