"""Kernel-enforced confinement of the code sandbox: Landlock and a seccomp filter.

Both need no privileges (only `PR_SET_NO_NEW_PRIVS`) and are applied in the forked child before
it execs the interpreter, so they also bind everything the child might start.

**Landlock** (Linux >= 5.13) restricts the child to:

* **file changes only beneath its temp dir**: every write-type access (write, truncate, create,
  remove, rename/link, mkdir, mknod, symlink) is denied elsewhere; reading is left to the audit
  hook (the interpreter must read its stdlib);
* **no TCP bind or connect** (Landlock ABI >= 4);
* **no signals to, and no abstract unix sockets of, processes outside the sandbox** (ABI >= 6),
  so it cannot kill the trainer even when running as root.

**seccomp** (x86_64 and aarch64) denies, whoever the user is (root included, where
RLIMIT_NPROC does not apply): new processes (`fork`, `vfork`, `clone` without `CLONE_THREAD`;
`clone3` answers ENOSYS so libc falls back to `clone` for threads), sockets, signals to other
processes (`kill`, `tkill`, `tgkill`, `rt_*sigqueueinfo`, pidfds), `ptrace`,
`process_vm_readv/writev` and io_uring, plus every syscall of a foreign ABI (x32, i386), the
classic way around a filter.

Unlike the audit hook these hold against anything the child does (threads, native code). Where
they are missing (old kernels, other architectures, some container runtimes) `abi_version()` is 0
or `seccomp_supported()` is False and the sandbox keeps its other layers.

Filters are built in the parent; the forked child only makes the `prctl`/`syscall` calls, with no
imports, which is fine inside `preexec_fn`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# Syscall numbers >= 424 are the same on every Linux architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# LANDLOCK_ACCESS_FS_* bits that change the file system (ABI 1), then REFER (2), TRUNCATE (3).
_FS_WRITE_V1 = (
    (1 << 1)  # WRITE_FILE
    | (1 << 4)  # REMOVE_DIR
    | (1 << 5)  # REMOVE_FILE
    | (1 << 6)  # MAKE_CHAR
    | (1 << 7)  # MAKE_DIR
    | (1 << 8)  # MAKE_REG
    | (1 << 9)  # MAKE_SOCK
    | (1 << 10)  # MAKE_FIFO
    | (1 << 11)  # MAKE_BLOCK
    | (1 << 12)  # MAKE_SYM
)
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_libc: ctypes.CDLL | None = None
_abi: int | None = None


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.prctl.restype = ctypes.c_int
    return _libc


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is unavailable (cached)."""
    global _abi
    if _abi is None:
        if platform.system() != "Linux":  # syscall numbers below are Linux's
            _abi = 0
            return _abi
        try:
            libc = _load_libc()
            version = libc.syscall(
                ctypes.c_long(_CREATE_RULESET),
                ctypes.c_void_p(None),
                ctypes.c_long(0),
                ctypes.c_long(_CREATE_RULESET_VERSION),
            )
            _abi = max(0, int(version))
        except (OSError, AttributeError):
            _abi = 0
    return _abi


def make_ruleset(writable_dir: str) -> int | None:
    """A ruleset fd allowing file changes only beneath `writable_dir` (see module docstring), or
    None when Landlock is unavailable. The caller closes the fd after spawning the child."""
    abi = abi_version()
    if abi < 1:
        return None
    fs = _FS_WRITE_V1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(
        fs,
        (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
        (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    # Older kernels reject a struct larger than they know unless the extra fields are zero;
    # pass exactly the part this ABI understands.
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    libc = _load_libc()
    ruleset = int(
        libc.syscall(
            ctypes.c_long(_CREATE_RULESET),
            ctypes.byref(attr),
            ctypes.c_long(size),
            ctypes.c_long(0),
        )
    )
    if ruleset < 0:
        return None
    dir_fd = os.open(writable_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rule = _PathBeneathAttr(fs, dir_fd)
        rc = libc.syscall(
            ctypes.c_long(_ADD_RULE),
            ctypes.c_long(ruleset),
            ctypes.c_long(_RULE_PATH_BENEATH),
            ctypes.byref(rule),
            ctypes.c_long(0),
        )
    finally:
        os.close(dir_fd)
    if rc != 0:
        os.close(ruleset)
        return None
    return ruleset


def restrict_self(ruleset_fd: int) -> bool:
    """Enforce the ruleset on the calling process (and everything it execs or forks).

    Called in the forked child before exec: two syscalls through the libc handle loaded by
    `make_ruleset` in the parent, no imports.
    """
    libc = _libc
    if libc is None:
        return False
    zero = ctypes.c_ulong(0)  # prctl rejects NO_NEW_PRIVS unless args 3-5 are exactly 0
    if libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero) != 0:
        return False
    return (
        libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_long(ruleset_fd), ctypes.c_long(0))
        == 0
    )


# ---- seccomp --------------------------------------------------------------------------------------

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_CLONE_THREAD = 0x00010000
# BPF opcodes: load word at absolute offset, jump-if-equal / >= / bit-set on a constant, return.
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06

# (audit arch, x32 bit or None, clone, numbers denied with EPERM, socket)
_ARCH = {
    "x86_64": (
        0xC000003E,
        0x40000000,
        56,
        # fork vfork kill ptrace rt_sigqueueinfo tkill tgkill rt_tgsigqueueinfo
        # process_vm_readv/writev pidfd_send_signal io_uring_setup pidfd_open pidfd_getfd
        (57, 58, 62, 101, 129, 200, 234, 297, 310, 311, 424, 425, 434, 438),
        41,
    ),
    "aarch64": (
        0xC00000B7,
        None,
        220,
        # kill tkill tgkill ptrace rt_sigqueueinfo rt_tgsigqueueinfo process_vm_readv/writev
        # pidfd_send_signal io_uring_setup pidfd_open pidfd_getfd
        (129, 130, 131, 117, 138, 240, 270, 271, 424, 425, 434, 438),
        198,
    ),
}
_CLONE3 = 435


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    """A seccomp filter program (`build_seccomp_filter`); ``_keep`` holds its array alive."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_supported() -> bool:
    """Whether this machine's architecture has a filter here (x86_64, aarch64 on Linux)."""
    return platform.system() == "Linux" and platform.machine() in _ARCH


def build_seccomp_filter() -> SockFprog | None:
    """The filter program (a `sock_fprog` whose array it keeps alive), or None if unsupported."""
    if not seccomp_supported():
        return None
    arch, x32, clone, denied, socket_nr = _ARCH[platform.machine()]
    deny, deny_net, nosys, allow = "deny", "deny_net", "nosys", "allow"
    # Each entry: (code, jump-if-true label or 0, jump-if-false label or 0, k). Labels are resolved
    # to the relative offsets BPF wants below.
    prog: list[tuple[int, str | int, str | int, int]] = [  # jumps: a label, or 0
        (_LD, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 0, deny, arch),
        (_LD, 0, 0, 0),  # seccomp_data.nr
    ]
    if x32 is not None:
        prog.append((_JGE, deny, 0, x32))
    prog += [(_JEQ, deny, 0, nr) for nr in denied]
    prog += [
        (_JEQ, deny_net, 0, socket_nr),
        (_JEQ, nosys, 0, _CLONE3),
        (_JEQ, 0, allow, clone),
        (_LD, 0, 0, 16),  # low 32 bits of args[0] (clone flags), little-endian
        (_JSET, allow, deny, _CLONE_THREAD),
    ]
    labels = {allow: len(prog), deny: len(prog) + 1, deny_net: len(prog) + 2, nosys: len(prog) + 3}
    prog += [
        (_RET, 0, 0, _RET_ALLOW),
        (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
        (_RET, 0, 0, _RET_ERRNO | errno.EACCES),
        (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS),
    ]

    def rel(i: int, target: str | int) -> int:
        return 0 if isinstance(target, int) else labels[target] - i - 1

    array = (_SockFilter * len(prog))(
        *[_SockFilter(code, rel(i, jt), rel(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]
    )
    fprog = SockFprog(len(prog), array)
    fprog._keep = array  # the struct only points at the array
    _load_libc()
    return fprog


def apply_seccomp(fprog: SockFprog | None) -> bool:
    """Install `fprog` on the calling process (in the forked child before exec)."""
    libc = _libc
    if libc is None or fprog is None:
        return False
    zero = ctypes.c_ulong(0)
    if libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero) != 0:
        return False
    return (
        libc.prctl(
            ctypes.c_int(_PR_SET_SECCOMP),
            ctypes.c_ulong(_SECCOMP_MODE_FILTER),
            ctypes.byref(fprog),
            zero,
            zero,
        )
        == 0
    )
