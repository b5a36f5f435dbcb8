"""The kernel's restrictions the sandboxed launcher applies to itself: seccomp, Landlock, capabilities.

Stdlib only and imported by `launcher` as a top-level module (see its docstring); the syscall numbers and flags are
the kernel's, for the architectures the seccomp filter knows.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

SETUP_FAILED = 97  # the exit status of a run whose isolation could not be applied (with a message on stderr)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000  # fmt: skip
CLONE_NAMESPACES = CLONE_NEWNS | 0x2000000 | 0x4000000 | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
EPERM, ENOSYS = 1, 38

# Syscalls the sandboxed code never needs and that would reach past the other layers: sockets (AF_UNIX is not
# covered by the network namespace), io_uring (it can open sockets without socket()), new namespaces and mounts (a
# tmpfs of its own would escape the disk quota), tracing other processes, BPF, keyrings. clone3 answers ENOSYS so
# that the C library falls back to clone, whose flags the filter can inspect.
SYSCALLS = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "ptrace": 101, "chroot": 161, "pivot_root": 155, "mount": 165,
        "umount2": 166, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
        "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "clone": 56, "clone3": 435, "capset": 126,
    },
    "aarch64": {
        "socket": 198, "socketpair": 199, "ptrace": 117, "chroot": 51, "pivot_root": 41, "mount": 40, "umount2": 39,
        "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "perf_event_open": 241, "setns": 268,
        "process_vm_readv": 270, "process_vm_writev": 271, "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "clone": 220, "clone3": 435, "capset": 91,
    },
}  # fmt: skip
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NOT_DENIED = ("clone", "clone3", "capset")


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
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    code: list[tuple[int, object, object, int]] = [(ld, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[machine]), (ret, 0, 0, kill)]
    code.append((ld, 0, 0, 0))
    if machine == "x86_64":
        code.append((jge, "deny", 0, 0x40000000))  # the x32 ABI numbers the same calls differently
    code += [(jeq, "deny", 0, n) for name, n in nr.items() if name not in _NOT_DENIED]
    code += [(jeq, "nosys", 0, nr["clone3"]), (jeq, "clone", 0, nr["clone"]), (ret, 0, 0, allow)]
    labels = {"clone": len(code)}
    code += [(ld, 0, 0, 16), (jset, "deny", 0, CLONE_NAMESPACES), (ret, 0, 0, allow)]  # args[0]: clone's flags
    labels["deny"] = len(code)
    code.append((ret, 0, 0, errno | EPERM))
    labels["nosys"] = len(code)
    code.append((ret, 0, 0, errno | ENOSYS))
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
# Landlock: writes only inside the working folder, reads only system and interpreter folders


def apply_landlock(abi: int, workdir: str) -> None:
    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    read_only = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
    # fs accesses, TCP bind and connect (ABI 4), scopes: abstract unix sockets and signals (ABI 6)
    attr = (ctypes.c_uint64 * 3)(handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = check(libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)), "landlock")
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    rules = [(p, read_only) for p in ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", *prefixes)]
    rules += [("/dev/null", 2 | 4 | (1 << 14 if abi >= 3 else 0)), ("/dev/urandom", 4), ("/dev/random", 4)]
    rules.append((workdir, handled))
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a folder this system doesn't have
        rule = PathBeneath(access, fd)
        check(libc.syscall(445, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule " + path)
        os.close(fd)
    check(libc.syscall(446, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def drop_capabilities(machine: str) -> None:
    """Clear every capability (those a user namespace grants its creator)."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    nr = SYSCALLS[machine]["capset"] if machine in SYSCALLS else None
    if nr is None:
        fail("capset", f"unknown syscall number on {machine}")
    check(libc.syscall(nr, header, data), "capset")
