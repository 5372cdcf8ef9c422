"""The program the code sandbox runs as `python -I -S _sandbox_child.py` (never imported).

It reads one JSON request from stdin, installs the in-process guard (an audit hook, see
`sandbox.py` for what it blocks and why), then compiles and executes the candidate source and calls
the requested function once per argument list. Results go to fd 1 as lines `NONCE + JSON`; the
candidate's own `print` output goes to a bounded in-memory sink so it cannot flood the channel.

Records: {"kind": "start", "netns": bool} | {"kind": "syntax_error", "error"} |
{"kind": "exec_error", "error"} | {"kind": "missing", "error"} |
{"kind": "call", "i", "plain", "value", "repr"} | {"kind": "call_error", "i", "error"} |
{"kind": "done", "stdout"}.

Only the candidate's return values are reported; the parent compares them with the expected values,
which never enter this process, so a candidate that forges result lines gains nothing.
"""

import builtins
import json
import linecache
import os
import sys
import sysconfig
import traceback
from typing import Any

_TAIL = 1500
_MAX_VALUE_CHARS = 20_000

# Imports that only serve to leave the sandbox (processes, sockets, raw memory/FFI).
_BLOCKED_IMPORTS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_posixsubprocess",
        "subprocess",
        "multiprocessing",
        "_multiprocessing",
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "pty",
        "asyncio",
        "concurrent",
    }
)
# Audit events that create processes, signal other processes, use FFI, walk the heap (which could
# find and tamper with this guard), or raise resource limits.
_BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "pty.spawn",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "resource.setrlimit",
        "resource.prlimit",
        "os.chroot",
        "sys.remote_exec",
    }
)
# Path-changing events: (indices of path arguments, indices of dir_fd arguments).
_PATH_EVENTS = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.link": ((0, 1), (2, 3)),
    "os.symlink": ((0, 1), (2,)),
    "os.mkdir": ((0,), (2,)),
    "os.truncate": ((0,), ()),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.utime": ((0,), (3,)),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _Sink:
    """A stand-in for sys.stdout/sys.stderr that keeps only the last `_TAIL` characters."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text = (self.text + str(s))[-_TAIL:]
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _install_guard(work: str, read_roots: tuple) -> None:
    """Install the audit hook. Called once; the hook is then reachable only by the interpreter."""
    realpath, isdir, fspath = os.path.realpath, os.path.isdir, os.fspath
    sep = os.sep

    def inside(path: str, roots: tuple) -> bool:
        return any(path == r or path.startswith(r + sep) for r in roots)

    def resolve(path: Any) -> str:
        p = fspath(path)
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        return realpath(p)

    work_roots = (work,)
    readable = (work, *read_roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return  # reopening an already-open descriptor
            real = resolve(path)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if inside(real, work_roots):
                return
            if writing:
                raise PermissionError(f"sandbox: writing outside the temp dir is blocked ({real})")
            if isdir(real):
                # A directory descriptor would let os.open(..., dir_fd=) escape the path check.
                raise PermissionError(f"sandbox: opening directories outside is blocked ({real})")
            if not inside(real, readable):
                raise PermissionError(f"sandbox: reading outside the temp dir is blocked ({real})")
            return
        if event in _BLOCKED_EVENTS or event.startswith(("socket.", "ctypes.", "_ctypes.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            name = str(args[0])
            if name.split(".")[0] in _BLOCKED_IMPORTS:
                raise ImportError(f"sandbox: importing {name} is not allowed")
            return
        spec = _PATH_EVENTS.get(event)
        if spec is not None:
            path_idx, fd_idx = spec
            for i in fd_idx:
                if i < len(args) and args[i] is not None and args[i] != -1:
                    raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")
            for i in path_idx:
                if i < len(args) and isinstance(args[i], (str, bytes, os.PathLike)):
                    real = resolve(args[i])
                    if not inside(real, work_roots):
                        raise PermissionError(
                            f"sandbox: {event} outside the temp dir is blocked ({real})"
                        )

    sys.addaudithook(hook)


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` as JSON data if it is built from exact plain types, else raise TypeError."""
    if depth > 20:
        raise TypeError("nested too deeply")
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t in (list, tuple):
        return [_plain(v, depth + 1) for v in value]
    if t is dict and all(type(k) is str for k in value):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(t.__name__)


def _tail(text: str) -> str:
    return text[-_TAIL:]


def _format(exc: BaseException) -> str:
    """The traceback restricted to the candidate's own frames (this harness is noise to it)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<candidate>"]
    head = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
    return _tail(head + "".join(traceback.format_exception_only(exc)))


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    nonce = request["nonce"]

    def emit(record: dict) -> None:
        os.write(1, (nonce + json.dumps(record) + "\n").encode())

    try:
        netns = os.readlink("/proc/self/ns/net") != request.get("parent_netns")
    except OSError:  # no /proc: isolation unknown, report none
        netns = False
    emit({"kind": "start", "netns": netns})
    work = os.path.realpath(os.getcwd())
    roots = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    roots |= {os.path.realpath(r) for r in roots}
    read_roots = tuple(sorted(roots | {"/dev/null", "/dev/urandom"}))
    sink = _Sink()
    sys.stdout = sys.stderr = sink
    _install_guard(work, read_roots)

    source = request["source"]
    # Lets tracebacks quote the candidate's lines.
    linecache.cache["<candidate>"] = (len(source), None, source.splitlines(True), "<candidate>")
    try:
        code = compile(source, "<candidate>", "exec")
    except (SyntaxError, ValueError) as exc:
        emit(
            {"kind": "syntax_error", "error": _tail("".join(traceback.format_exception_only(exc)))}
        )
        return
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except BaseException as exc:  # the candidate may raise anything, SystemExit included
        emit({"kind": "exec_error", "error": _format(exc)})
        return
    fn = namespace.get(request["function"])
    if not callable(fn):
        emit({"kind": "missing", "error": f"no function named {request['function']!r} defined"})
        return
    for i, args_json in enumerate(request["calls"]):
        args = json.loads(args_json)  # fresh objects per call: a mutating candidate cannot leak
        try:
            value = fn(*args)
        except BaseException as exc:
            emit({"kind": "call_error", "i": i, "error": _format(exc)})
            continue
        try:
            text = repr(value)[:200]
        except BaseException:
            text = "<unrepresentable>"
        record = {"kind": "call", "i": i, "plain": False, "value": None, "repr": text}
        try:
            plain = {**record, "plain": True, "value": _plain(value)}
            if len(json.dumps(plain)) <= _MAX_VALUE_CHARS:
                record = plain
            else:
                record["large"] = True
        except (TypeError, ValueError):  # not plain data, or an int too long to print
            pass
        emit(record)
    emit({"kind": "done", "stdout": sink.text})


if __name__ == "__main__":
    main()
