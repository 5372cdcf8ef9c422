"""Run untrusted candidate Python in a child process with limits, and report what its function returns.

`run_candidate(source, function, calls, limits)` starts `python -I -S _sandbox_child.py` (isolated
mode: no site-packages, no user site, no PYTHON* environment, stdlib only) with a fresh temp dir as
its cwd and calls `function(*args)` for each argument list. Layers, outermost first:

Kernel-enforced (they hold whatever the code does: threads, native code, crashes):

* **wall clock**: the child leads its own session and process group; when `wall_seconds` pass,
  the whole group is SIGKILLed. The group is also killed after a normal exit, before the child is
  reaped (so its id cannot have been reused), so nothing it started can outlive it.
* **rlimits** (set in `preexec_fn`): RLIMIT_AS (memory: a large allocation fails with
  MemoryError), RLIMIT_CPU (SIGXCPU, SIGKILL a second later), RLIMIT_FSIZE (no file, stdout
  included, grows past `file_bytes`), RLIMIT_NOFILE, RLIMIT_CORE=0, RLIMIT_NPROC=0 (no new
  processes; Linux exempts root from this one, which is why seccomp below exists).
* **Landlock** (`confine.py`, Linux >= 5.13): file changes only beneath the temp dir; no TCP
  bind/connect (ABI >= 4); no signals to processes outside the sandbox (ABI >= 6).
* **seccomp** (`confine.py`, x86_64/aarch64): no fork/vfork/non-thread clone, no sockets, no
  kill/tgkill/ptrace/process_vm_*/pidfd/io_uring, no foreign-ABI syscalls; works for root.
* **network namespace**: `unshare(CLONE_NEWNET)` (root) or `CLONE_NEWUSER | CLONE_NEWNET`
  (unprivileged user namespaces): the child sees only a downed loopback.
* stdout is a file in the sandbox dir (capped by RLIMIT_FSIZE), never a pipe the parent could
  block on or buffer without bound; the parent reads at most `file_bytes` of it.

In-process (an audit hook installed by the child before the candidate's code is compiled, see
`_sandbox_child.py`): blocks `open` for writing outside the temp dir (paths resolved with realpath,
so symlinks do not help), reads outside the temp dir and the stdlib, directory descriptors outside
the temp dir, path-changing calls outside it or with `dir_fd`, sockets, fork/exec/spawn/system,
`os.kill`, ctypes, heap walking via `gc`, raising rlimits, and imports of `ctypes`, `subprocess`,
`socket`, `multiprocessing` and friends. It turns most attempts into a clear PermissionError for
the feedback, and it is the read restriction's only layer.

Limits: where the kernel lacks Landlock/seccomp/namespaces (old kernels, other architectures,
some container runtimes) the corresponding guarantees fall back to the audit hook, which is not a
security boundary against a determined attacker (e.g. a thread racing a symlink swap, or an
interpreter memory-corruption bug). `SandboxResult` reports which layers applied
(`landlock_abi`, `seccomp`, `network_isolation`). Reads of world-readable files are blocked only
by the hook. Run verification in a container or VM if candidates may be adversarial rather than
merely wrong.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from composer_replication.json_types import JSONDict, JSONValue
from composer_replication.tasks import confine

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_unshare: Callable[[int], int] | Literal[False] | None = (
    None  # libc.unshare, resolved once in the parent (never import inside preexec_fn)
)
# preexec_fn runs Python in the forked child; forking from several of our threads at once is the
# documented deadlock risk of preexec_fn, so spawns are serialised (waiting still runs in parallel).
_SPAWN_LOCK = threading.Lock()
_seccomp: confine.SockFprog | Literal[False] | None = None  # built once (False where unsupported)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    wall_seconds: float = 3.0
    cpu_seconds: int = 2
    memory_bytes: int = 256 * 2**20
    file_bytes: int = 2**20
    open_files: int = 64
    isolate_network: bool = True
    kernel_confinement: bool = True  # Landlock + seccomp where the kernel supports them

    def __post_init__(self) -> None:
        if self.wall_seconds <= 0 or self.cpu_seconds < 1:
            raise ValueError("wall_seconds must be > 0 and cpu_seconds >= 1")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError("memory_bytes below 64 MiB cannot start the Python interpreter")
        if self.file_bytes < 4096 or self.open_files < 8:
            raise ValueError("file_bytes must be >= 4096 and open_files >= 8")


@dataclass(frozen=True)
class CallResult:
    """The outcome of one call: a plain (JSON) return value, or an error traceback tail."""

    index: int
    value: JSONValue = None
    plain: bool = False
    repr: str = ""
    error: str | None = None
    too_large: bool = False  # plain data, but too large to report (over 20k JSON characters)


@dataclass(frozen=True)
class SandboxResult:
    """What happened in one sandboxed run.

    `stage` is the furthest stage reached: "none" (nothing reported), "start", "syntax_error",
    "exec_error", "missing" (function not defined), "calls" (running calls), "done".
    """

    stage: str
    calls: dict[int, CallResult] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    signal_name: str | None = None
    returncode: int | None = None
    stdout: str = ""
    network_isolation: str = "audit-hook"
    landlock_abi: int = 0
    seccomp: bool = False
    seconds: float = 0.0
    output_full: bool = False

    def termination(self) -> str | None:
        """A human sentence for an abnormal end (timeout, a limit signal), else None."""
        if self.timed_out:
            return "killed: wall-clock time limit exceeded (an infinite loop?)"
        if self.signal_name == "SIGXCPU" or self.signal_name == "SIGKILL":
            return "killed: CPU time limit exceeded (an infinite loop?)"
        if self.signal_name == "SIGXFSZ":
            return "killed: output/file size limit exceeded"
        if self.signal_name is not None:
            return f"crashed with {self.signal_name}"
        if self.output_full:
            return "stopped: output/file size limit exceeded"
        if self.stage not in ("done", "syntax_error", "exec_error", "missing"):
            return f"exited early with code {self.returncode} before all calls finished"
        return None


def _resolve_unshare() -> Callable[[int], int] | Literal[False]:
    global _unshare
    if _unshare is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.unshare
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _unshare = fn
        except (OSError, AttributeError):
            _unshare = False
    return _unshare


def _preexec(
    limits: SandboxLimits,
    unshare: Callable[[int], int] | Literal[False] | None,
    ruleset: int | None = None,
    seccomp: confine.SockFprog | None = None,
) -> Callable[[], None]:
    mem, cpu, fsize = limits.memory_bytes, limits.cpu_seconds, limits.file_bytes
    nofile = limits.open_files
    restrict_self, apply_seccomp = confine.restrict_self, confine.apply_seccomp

    def setup() -> None:  # runs in the forked child before exec: only C calls, no imports
        if unshare:
            if unshare(_CLONE_NEWNET) != 0:
                unshare(_CLONE_NEWUSER | _CLONE_NEWNET)  # ignore failure: the hook still applies
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        # Popen re-raises these in the parent, which then retries without kernel confinement.
        if ruleset is not None and not restrict_self(ruleset):
            raise OSError("landlock_restrict_self failed")
        if seccomp is not None and not apply_seccomp(seccomp):
            raise OSError("installing the seccomp filter failed")

    return setup


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until the child exits, WITHOUT reaping it; False on timeout."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if pidfd is not None:
                ready, _, _ = select.select([pidfd], [], [], remaining)
                return bool(ready)
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                return True
            time.sleep(min(0.01, remaining))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _parse(raw: bytes, nonce: str) -> tuple[list[JSONDict], bool]:
    records: list[JSONDict] = []
    netns = False
    prefix = nonce.encode()
    for line in raw.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix) :])
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    for record in records:
        if record.get("kind") == "start":
            netns = bool(record.get("netns"))
            break
    return records, netns


def _spawn(
    limits: SandboxLimits,
    unshare: Callable[[int], int] | Literal[False] | None,
    work: Path,
    stdin: BinaryIO,
    stdout: BinaryIO,
) -> tuple[subprocess.Popen[bytes], int, bool]:
    """Start the child; returns it, the Landlock ABI enforced on it (0 = none) and whether the
    seccomp filter is installed."""
    ruleset = confine.make_ruleset(str(work)) if limits.kernel_confinement else None
    seccomp = _seccomp_filter() if limits.kernel_confinement else None
    try:
        with _SPAWN_LOCK:
            for attempt in ((ruleset, seccomp), (None, None)):
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", _CHILD],
                        cwd=work,
                        stdin=stdin,
                        stdout=stdout,
                        stderr=subprocess.STDOUT,
                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work)},
                        start_new_session=True,
                        close_fds=True,
                        preexec_fn=_preexec(limits, unshare, *attempt),
                    )
                except subprocess.SubprocessError:
                    if attempt == (None, None):
                        raise
                    stdin.seek(0)
                    continue
                abi = confine.abi_version() if attempt[0] is not None else 0
                return proc, abi, attempt[1] is not None
            raise AssertionError("unreachable: the last attempt raises or returns")
    finally:
        if ruleset is not None:
            os.close(ruleset)


def _seccomp_filter() -> confine.SockFprog | None:
    global _seccomp
    if _seccomp is None:
        _seccomp = confine.build_seccomp_filter() or False
    return _seccomp or None


def run_candidate(
    source: str,
    function: str,
    calls: Sequence[Sequence[JSONValue]],
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Execute `source` in the sandbox and call `function(*args)` for each entry of `calls`.

    `calls` must be JSON-serialisable argument lists. The first report of each call index wins
    (a candidate that forges result lines cannot overwrite real ones that came first).
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            "the code sandbox needs Linux (rlimits, namespaces, Landlock, seccomp); run pycode "
            "verification on a Linux machine or container"
        )
    limits = limits or SandboxLimits()
    nonce = "@@" + secrets.token_hex(16) + "@@"
    try:
        parent_netns = os.readlink("/proc/self/ns/net")
    except OSError:
        parent_netns = ""
    request = {
        "nonce": nonce,
        "source": source,
        "function": function,
        "calls": [json.dumps(list(args)) for args in calls],
        "parent_netns": parent_netns,
    }
    unshare = _resolve_unshare() if limits.isolate_network else None
    root = Path(tempfile.mkdtemp(prefix="cr-sandbox-"))
    started = time.monotonic()
    try:
        work = root / "work"
        work.mkdir(mode=0o700)
        (root / "request.json").write_text(json.dumps(request))
        with (
            open(root / "request.json", "rb") as stdin,
            open(root / "out", "wb") as out,
        ):
            proc, landlock_abi, seccomp = _spawn(limits, unshare, work, stdin, out)
            exited = _wait(proc, limits.wall_seconds)
            # Kill the whole group before reaping, so its id cannot have been reused yet.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            returncode = proc.wait()
        with open(root / "out", "rb") as f:
            raw = f.read(limits.file_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    records, netns = _parse(raw, nonce)
    stage, error, printed = "none", None, ""
    results: dict[int, CallResult] = {}
    for record in records:
        kind = record.get("kind")
        if kind == "start" and stage == "none":
            stage = "start"
        elif kind in ("syntax_error", "exec_error", "missing") and stage in ("none", "start"):
            stage, error = kind, str(record.get("error", ""))
        elif kind in ("call", "call_error") and stage in ("start", "calls"):
            stage = "calls"
            i = record.get("i")
            if isinstance(i, int) and 0 <= i < len(calls) and i not in results:
                if kind == "call":
                    results[i] = CallResult(
                        i,
                        record.get("value"),
                        bool(record.get("plain")),
                        str(record.get("repr")),
                        too_large=bool(record.get("large")),
                    )
                else:
                    results[i] = CallResult(i, error=str(record.get("error", "")))
        elif kind == "done" and stage in ("start", "calls"):
            stage, printed = "done", str(record.get("stdout", ""))
    # Our own SIGKILL of the group after a clean exit is not the child's fault.
    signal_name = None
    if returncode < 0 and not (exited and stage == "done"):
        try:
            signal_name = signal.Signals(-returncode).name
        except ValueError:
            signal_name = f"signal {-returncode}"
    return SandboxResult(
        stage=stage,
        calls=results,
        error=error,
        timed_out=not exited,
        signal_name=signal_name,
        returncode=returncode,
        stdout=printed,
        network_isolation="netns" if netns else "audit-hook",
        landlock_abi=landlock_abi,
        seccomp=seccomp,
        seconds=time.monotonic() - started,
        output_full=len(raw) >= limits.file_bytes,
    )
