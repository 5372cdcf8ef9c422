"""Code that runs inside a replica's container (not on the driver), shared by cloud backends.

`stream_command` runs the replica command, echoes its output line by line (the platform's log
collector reads stdout) and keeps the last lines. Modal's function body returns them; on
SageMaker this module is the container entrypoint:

    python -m composer_replication.executors.remote --failure-file PATH -- CMD ...

which, when the replica exits non-zero, writes "exit code: N" and the log tail to PATH
(SageMaker's /opt/ml/output/failure), so the service's FailureReason carries the real exit code
and reason. SIGTERM (what stopping a job sends) is forwarded to the replica, which then exits
with 143 like it would as the container's main process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Sequence

__all__ = ["FAILURE_FILE", "stream_command", "write_failure", "main"]

TAIL_LINES = 20
FAILURE_FILE = "/opt/ml/output/failure"
# SageMaker keeps the first 1024 characters of the failure file as FailureReason.
FAILURE_LIMIT = 1024


def stream_command(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run command with os.environ + env, echo its output; return (exit code, last lines).

    A replica killed by signal S reports 128 + S, as container runtimes do.
    """
    proc = subprocess.Popen(
        list(command),
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = _in_main_thread()
    if in_main_thread:  # forward "stop" to the replica instead of dying and orphaning it
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line)
        code = proc.wait()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return (code if code >= 0 else 128 - code), "".join(tail)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def write_failure(path: str, code: int, tail: str) -> None:
    """Write the failure file: "exit code: N" first (it must survive the 1024-char cut)."""
    head = f"exit code: {code}\n"
    body = tail[-(FAILURE_LIMIT - len(head)) :] if tail else ""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(head + body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer_replication.executors.remote")
    parser.add_argument(
        "--failure-file",
        default=FAILURE_FILE,
        help="where to write the reason of a non-zero exit ($VARS expanded)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (use: ... -- CMD ARGS)")
    code, tail = stream_command(command)
    if code != 0:
        write_failure(os.path.expandvars(args.failure_file), code, tail)
    return code


if __name__ == "__main__":
    sys.exit(main())
