"""The kernel's restrictions the sandboxed launcher applies to itself: seccomp, Landlock, capabilities.

Stdlib only and imported by `launcher` as a top-level module (see its docstring); the syscall numbers and flags are
the kernel's, for the architectures the seccomp filter knows.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct

SETUP_FAILED = 97  # the exit status of a run whose isolation could not be applied (with a message on stderr)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
)  # fmt: skip
CLONE_NAMESPACES = CLONE_NEWNS | 0x2000000 | 0x4000000 | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 28, 38
EPERM, ENOSYS = 1, 38

# Syscalls the sandboxed code never needs and that would reach past the other layers: sockets (AF_UNIX is not
# covered by the network namespace), io_uring (it can open sockets without socket()), new namespaces and mounts (a
# tmpfs of its own would escape the disk quota), tracing other processes, BPF, keyrings. Memory that outlives every
# process or escapes the memory watch: memfd, SysV shared memory and message queues, secret memory. Quotas shared
# with the whole machine or user (AIO contexts, SysV semaphores, POSIX message queues, inotify and fanotify
# instances): one sample could exhaust them for every other process. clone3 answers ENOSYS so that the C library
# falls back to clone, whose flags the filter can inspect; mmap is inspected too (`SHARED_MAP_BYTES`). socketpair is
# allowed for AF_UNIX alone (multiprocessing's Pipe: a connected pair, with no address anyone else could reach).
# setsid "succeeds" without doing anything: a session of its own would be a scheduler autogroup of its own, a share of
# the CPU taken from the sample's siblings (the sample's processes all stay in the session it was started in).
SYSCALLS = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "ptrace": 101, "chroot": 161, "pivot_root": 155, "mount": 165,
        "umount2": 166, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
        "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64, "mq_open": 240,
        "io_setup": 206, "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300,
        "clone": 56, "clone3": 435, "capset": 126, "mmap": 9, "setsid": 112,
    },
    "aarch64": {
        "socket": 198, "socketpair": 199, "ptrace": 117, "chroot": 51, "pivot_root": 41, "mount": 40, "umount2": 39,
        "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "perf_event_open": 241, "setns": 268,
        "process_vm_readv": 270, "process_vm_writev": 271, "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190, "mq_open": 180,
        "io_setup": 0, "inotify_init1": 26, "fanotify_init": 262,
        "clone": 220, "clone3": 435, "capset": 91, "mmap": 222, "setsid": 157,
    },
}  # fmt: skip
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NOT_DENIED = ("clone", "clone3", "capset", "mmap", "setsid", "socketpair")
AF_UNIX = 1
# The largest shared anonymous mapping one mmap may make (MAP_SHARED | MAP_ANONYMOUS, the same on both
# architectures): room for a library's small shared buffer, no more; the memory watch counts every shared mapping.
SHARED_MAP_BYTES = 2**20
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20


def fail(what: str, err: object) -> None:
    os.write(2, f"sandbox setup failed: {what}: {err}\n".encode())
    os._exit(SETUP_FAILED)


def check(ret: int, what: str) -> int:
    if ret < 0:
        fail(what, os.strerror(ctypes.get_errno()))
    return ret


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    raw = [None if x is None else x.encode() for x in (source, target, fstype)]
    check(libc.mount(*raw, flags, None if data is None else data.encode()), f"mount {fstype or source} on {target}")


def prctl(option: int, arg: int, what: str) -> None:
    check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), what)


# ----------------------------------------------------------------------------------------------------------------
# seccomp: a classic BPF program over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}


def seccomp_program(machine: str) -> bytes:
    """The filter for `machine` (`os.uname().machine`): denied syscalls fail with EPERM, any other ABI is killed."""
    nr = SYSCALLS[machine]
    ld, jeq, jgt, jset, ret = 0x20, 0x15, 0x25, 0x45, 0x06
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000

    def arg(i: int, high: bool = False) -> int:  # offset of a 64-bit argument's low (or high) word, little-endian
        return 16 + 8 * i + (4 if high else 0)

    code: list[tuple[int, object, object, int]] = [(ld, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[machine]), (ret, 0, 0, kill)]
    code.append((ld, 0, 0, 0))
    if machine == "x86_64":
        code.append((0x35, "deny", 0, 0x40000000))  # jge: the x32 ABI numbers the same calls differently
    code += [(jeq, "deny", 0, n) for name, n in nr.items() if name not in _NOT_DENIED]
    code += [(jeq, "nosys", 0, nr["clone3"]), (jeq, "clone", 0, nr["clone"]), (jeq, "mmap", 0, nr["mmap"])]
    code += [(jeq, "noop", 0, nr["setsid"]), (jeq, "socketpair", 0, nr["socketpair"])]
    code.append((ret, 0, 0, allow))
    labels = {"socketpair": len(code)}  # every jump goes forward: each block ends in the returns below it
    code += [(ld, 0, 0, arg(0)), (jeq, "allow", "deny", AF_UNIX)]  # a connected pair reaches nothing but itself
    labels["clone"] = len(code)
    code += [(ld, 0, 0, arg(0)), (jset, "deny", "allow", CLONE_NAMESPACES)]  # clone's flags
    labels["mmap"] = len(code)  # shared and anonymous, over the bound: its length (args[1]) past 32 bits or the bound
    code += [(ld, 0, 0, arg(3)), (jset, 0, "allow", MAP_ANONYMOUS), (jset, 0, "allow", MAP_SHARED)]
    code += [(ld, 0, 0, arg(1, high=True)), (jeq, 0, "deny", 0)]
    code += [(ld, 0, 0, arg(1)), (jgt, "deny", "allow", SHARED_MAP_BYTES)]
    labels["deny"] = len(code)
    code.append((ret, 0, 0, errno | EPERM))
    labels["nosys"] = len(code)
    code.append((ret, 0, 0, errno | ENOSYS))
    labels["noop"] = len(code)  # "succeeds" (returns 0) without doing anything
    code.append((ret, 0, 0, errno | 0))
    labels["allow"] = len(code)
    code.append((ret, 0, 0, allow))
    out = b""
    for i, (op, jt, jf, k) in enumerate(code):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        out += struct.pack("HBBI", op, jt, jf, k)
    return out


def apply_seccomp(machine: str) -> None:
    program = seccomp_program(machine)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Prog(len(program) // 8, program)
    check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "seccomp")  # SECCOMP_MODE_FILTER


# ----------------------------------------------------------------------------------------------------------------
# Landlock: writes only inside the sample's own folders, reads only the folders of its view (`view`)


def apply_landlock(abi: int, writable: list[str], readable: list[str], listable: list[str]) -> None:
    """Writes only beneath `writable` (the sample's own folders); reads only beneath `readable`; `listable` folders
    may be listed, no more (the folders of the named packages: Python's import lists them; their shown entries are
    in `readable`)."""

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    read_dir, read_file = 1 | 4 | 8, 1 | 4  # EXECUTE | READ_FILE | READ_DIR (a file's rule may not name READ_DIR)
    # fs accesses, TCP bind and connect (ABI 4), scopes: abstract unix sockets and signals (ABI 6)
    attr = (ctypes.c_uint64 * 3)(handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = check(libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)), "landlock")
    rules = [(p, None) for p in readable] + [(p, 8) for p in listable]
    rules += [("/dev/null", 2 | 4 | (1 << 14 if abi >= 3 else 0)), ("/dev/urandom", 4), ("/dev/random", 4)]
    rules += [(p, handled) for p in writable]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a folder this system doesn't have
        if access is None:
            access = read_dir if stat.S_ISDIR(os.fstat(fd).st_mode) else read_file
        rule = PathBeneath(access, fd)
        check(libc.syscall(445, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule " + path)
        os.close(fd)
    check(libc.syscall(446, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def drop_capabilities(machine: str) -> None:
    """Clear every capability (those a user namespace grants its creator), and lock uid 0 of the namespace out of
    ever regaining them (SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, no ambient ones, each locked)."""
    prctl(PR_SET_SECUREBITS, 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80, "PR_SET_SECUREBITS")
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    nr = SYSCALLS[machine]["capset"] if machine in SYSCALLS else None
    if nr is None:
        fail("capset", f"unknown syscall number on {machine}")
    check(libc.syscall(nr, header, data), "capset")
