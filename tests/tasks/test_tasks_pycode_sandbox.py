"""The pycode task and its sandbox: correct code passes; infinite loops, large allocations, writes
outside the temp dir, network access, fork bombs and other malicious answers are stopped and never
affect this (the test) process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_replication.tasks import Example, PyCodeTask, confine, get_task
from composer_replication.tasks.pycode import extract_code, same_value
from composer_replication.tasks.sandbox import (
    SandboxLimits,
    _preexec,
    _resolve_unshare,
    _seccomp_filter,
    run_candidate,
)

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=1)


def _add3() -> Example:
    task = PyCodeTask(families=["add"], n_train=1, n_eval=0)
    tests = [[[x], x + 3] for x in (0, 1, 2, 5, -3, 10, 37)]
    return Example(
        id="p",
        prompt="Write a Python function f(x) that returns x plus 3.",
        answer="def f(x):\n    return x + 3",
        meta={"family": "add", "k": 3, "function": task.function, "tests": tests},
    )


def _parent(pid: int) -> int:
    """`pid`'s parent (0 when it is gone): field 4 of /proc/PID/stat, after the "(comm)"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _ours_or_orphaned(pid: int) -> bool:
    """Whether `pid` descends from this process, or was orphaned (its parent is init): a
    sandbox process that outlived the one that started it is a leak, whoever started it."""
    me, seen = os.getpid(), set()
    if _parent(pid) == 1:
        return True
    while pid > 1 and pid not in seen:
        seen.add(pid)
        pid = _parent(pid)
        if pid == me:
            return True
    return False


def _sandbox_children() -> list[str]:
    """Processes still running the sandbox program that this test process started (directly or
    not) or that were orphaned (there must be none after a run). The live sandboxes of another
    pytest-xdist worker's test are not counted: they are that test's, and still in use."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"_sandbox_child.py" in cmd and _ours_or_orphaned(int(pid)):
                found.append(pid)
    return found


# ---- the task ------------------------------------------------------------------------------------


def test_pycode_reward_shaping_is_monotone_with_useful_feedback() -> None:
    task = PyCodeTask(limits=FAST)
    ex = _add3()
    answers = {
        "exact": "def f(x):\n    return x + 3",
        "partial": "def f(x):\n    return x + 3 if x < 5 else 0",
        "wrong": "def f(x):\n    return x",
        "no_f": "def g(x):\n    return x + 3",
        "raises": "def f(x):\n    return x + 3\nraise RuntimeError('boom')",
        "syntax_def": "def f(x) return x + 3",
        "syntax": "x plus three",
        "empty": "   ",
    }
    v = {k: task.verify(ex, a) for k, a in answers.items()}
    r = {k: x.reward for k, x in v.items()}
    assert v["exact"].correct and v["exact"].feedback is None and r["exact"] == 1.0
    assert 1.0 > r["partial"] > r["wrong"] == 0.3 > r["no_f"] > r["raises"]
    assert r["raises"] > r["syntax_def"] > r["syntax"] > r["empty"] == 0.0
    assert r["partial"] < 0.9
    assert all(not x.correct and x.feedback for k, x in v.items() if k != "exact")
    assert "Passed 4/7 tests" in v["partial"].feedback
    assert "f(5) returned 0, expected 8." in v["partial"].feedback
    assert "f(0) returned 0, expected 3." in v["wrong"].feedback
    assert "does not define a function `f`" in v["no_f"].feedback
    assert "RuntimeError: boom" in v["raises"].feedback
    assert "raise RuntimeError('boom')" in v["raises"].feedback  # the failing line is quoted
    assert "_sandbox_child" not in v["raises"].feedback  # harness frames are hidden
    assert "SyntaxError" in v["syntax_def"].feedback


def test_pycode_error_timeouts_and_types_in_feedback() -> None:
    task = PyCodeTask(limits=FAST)
    ex = _add3()
    err = task.verify(ex, "def f(x):\n    return x + 3 + 0 // (x - 5)")
    assert "f(5) raised an error" in err.feedback and "ZeroDivisionError" in err.feedback
    assert err.reward == pytest.approx(0.3 + 0.6 * 6 / 7)
    slow = task.verify(ex, "def f(x):\n    while x == 2:\n        pass\n    return x + 3")
    assert "f(2) did not finish (killed:" in slow.feedback
    assert slow.reward == pytest.approx(0.3 + 0.6 * 2 / 7)  # tests before the hang still count
    wrong_type = task.verify(ex, "def f(x):\n    return {x + 3}")
    assert "not plain data" in wrong_type.feedback
    huge = task.verify(ex, "def f(x):\n    return list(range(10**5))")
    assert "too large to check" in huge.feedback and len(huge.feedback) < 1000
    floaty = task.verify(ex, "def f(x):\n    return x + 3.0")
    assert floaty.correct  # numbers compare by value


def test_extract_code_and_strict_equality() -> None:
    assert extract_code("```python\ndef f(x):\n    return x\n```\nDone.") == (
        "def f(x):\n    return x"
    )
    assert extract_code("Answer: def f(x): return x<|im_end|>") == "def f(x): return x"
    assert same_value(True, True) and not same_value(True, 1) and not same_value(0, False)
    assert same_value(3, 3.0) and same_value([1, [2.0]], [1, [2]]) and not same_value([1], [1, 2])
    assert same_value({"a": 1}, {"a": 1}) and not same_value("1", 1)


def test_pycode_levels_and_parallel_verification() -> None:
    easy = get_task("pycode", n_train=100, n_eval=20)
    assert {e.meta["family"] for e in easy.train_examples()} <= {
        "add",
        "sub",
        "mul",
        "square",
        "negate",
    }
    hard = get_task("pycode", level="hard", n_train=200, n_eval=20)
    # A parameterless family is a single prompt, so it lands in either split.
    both = hard.train_examples() + hard.eval_examples()
    assert {"factorial", "gcd", "reverse", "add"} <= {e.meta["family"] for e in both}
    with pytest.raises(ValueError, match="families"):
        PyCodeTask(families=["quantum"])
    assert PyCodeTask(limits={"wall_seconds": 5.0}).limits == SandboxLimits(wall_seconds=5.0)
    with pytest.raises(ValueError, match="unknown sandbox limit"):
        PyCodeTask(limits={"wall_secs": 5})
    with pytest.raises(ValueError, match="wall_seconds"):
        PyCodeTask(limits={"wall_seconds": 0})
    task = PyCodeTask(n_train=6, n_eval=0, workers=2, limits=FAST)
    examples = task.train_examples()
    answers = [
        task.oracle(e) if i % 2 else "def f(x):\n    return None" for i, e in enumerate(examples)
    ]
    parallel = task.verify_many(examples, answers)
    assert [v.correct for v in parallel] == [bool(i % 2) for i in range(6)]
    assert parallel == [task.verify(e, a) for e, a in zip(examples, answers, strict=True)]


# ---- the sandbox ---------------------------------------------------------------------------------


def test_sandbox_runs_correct_code_in_a_fresh_temp_dir() -> None:
    src = (
        "import os, math, collections, itertools, re, json\n"
        "def f(x):\n"
        "    with open('scratch.txt', 'w') as fh:\n"
        "        fh.write(str(x))\n"
        "    print('hello from the candidate')\n"
        "    return [os.listdir('.'), open('scratch.txt').read(), math.isqrt(x)]\n"
    )
    res = run_candidate(src, "f", [[16]], FAST)
    assert res.stage == "done" and res.termination() is None
    assert res.calls[0].value == [["scratch.txt"], "16", 4]
    assert "hello from the candidate" in res.stdout
    if os.geteuid() == 0:  # root may always create a network namespace
        assert res.network_isolation == "netns"
    if confine.abi_version() >= 1:
        assert res.landlock_abi == confine.abi_version()
    assert res.seccomp == confine.seccomp_supported()


def test_sandbox_stops_infinite_loops() -> None:
    start = time.monotonic()
    busy = run_candidate("def f():\n    while True:\n        pass", "f", [[]], FAST)
    assert busy.termination() is not None and "killed" in busy.termination()
    assert 0 not in busy.calls
    sleepy = run_candidate(
        "import time\ndef f():\n    time.sleep(60)",
        "f",
        [[]],
        SandboxLimits(wall_seconds=1.0, cpu_seconds=5),
    )
    assert sleepy.timed_out and "wall-clock" in sleepy.termination()
    assert time.monotonic() - start < 3.0 + 1.0 + 4.0  # both bounded by their limits
    assert _sandbox_children() == []


def test_sandbox_stops_large_allocations() -> None:
    res = run_candidate(
        "def f(n):\n    return len(bytearray(n))\ndef g():\n    return len([0] * 10**9)",
        "f",
        [[2**31], [10]],
        FAST,
    )
    assert "MemoryError" in res.calls[0].error
    assert res.calls[1].value == 10  # the process survives and keeps working
    res2 = run_candidate("x = [0] * 10**9\ndef f():\n    return 1", "f", [[]], FAST)
    assert res2.stage == "exec_error" and "MemoryError" in res2.error


def test_sandbox_blocks_file_writes_outside_its_temp_dir(tmp_path: Path) -> None:
    target = tmp_path / "pwned.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("original")
    keep.chmod(0o644)
    attacks = [
        f"open({str(target)!r}, 'w').write('x')",
        f"open({str(keep)!r}, 'a').write('x')",
        f"import os; os.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
        f"import os; os.symlink({str(target)!r}, 'link'); open('link', 'w').write('x')",
        f"open('inside', 'w').write('x'); import os; os.rename('inside', {str(target)!r})",
        f"import os; os.remove({str(keep)!r})",
        f"import os; os.chmod({str(keep)!r}, 0o777)",
        f"import shutil; open('a', 'w').write('x'); shutil.copy('a', {str(target)!r})",
        f"import os; fd = os.open({str(tmp_path)!r}, os.O_RDONLY); "
        "os.close(os.open('pwned.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
        "open('../escaped', 'w').write('x')",
    ]
    for attack in attacks:
        res = run_candidate(f"def f():\n    {attack}\n    return 'wrote'", "f", [[]], FAST)
        call = res.calls[0]
        assert call.error is not None and "sandbox:" in call.error, (attack, call)
    assert not target.exists()
    assert keep.read_text() == "original" and keep.stat().st_mode & 0o777 == 0o644


def test_sandbox_blocks_network_access() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        for attack in [
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "s = __import__('_socket')",
            "import urllib.request; urllib.request.urlopen('http://127.0.0.1:1/')",
        ]:
            res = run_candidate(f"def f():\n    {attack}\n    return 'connected'", "f", [[]], FAST)
            assert res.calls[0].error is not None and "sandbox:" in res.calls[0].error, attack
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody got through
    finally:
        server.close()


def test_network_namespace_alone_cuts_loopback() -> None:
    """The kernel layer without the audit hook: a bare child in the sandbox's network namespace
    cannot reach a server listening on this process's loopback."""
    unshare = _resolve_unshare()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = (
        "import os, socket\n"
        f"print(os.readlink('/proc/self/ns/net') != {os.readlink('/proc/self/ns/net')!r})\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1); print('reached')\n"
        "except OSError as exc:\n    print('blocked', type(exc).__name__)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", code],
            preexec_fn=_preexec(SandboxLimits(), unshare),
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    finally:
        server.close()
    if out[0] != "True":
        pytest.skip("network namespaces are not permitted here; only the audit hook applies")
    assert out[1].startswith("blocked")


def test_sandbox_stops_fork_bombs_and_process_creation() -> None:
    attacks = [
        "import os\n    while True:\n        os.fork()",
        "import subprocess; subprocess.run(['true'])",
        "__import__('os').system('true')",
        "import os; os.posix_spawn('/bin/true', ['true'], {})",
        "import os; os.execv('/bin/true', ['true'])",
        "import multiprocessing",
        "import pty; pty.fork()",
    ]
    for attack in attacks:
        res = run_candidate(f"def f():\n    {attack}\n    return 'spawned'", "f", [[]], FAST)
        assert res.calls[0].error is not None and "sandbox:" in res.calls[0].error, attack
    assert _sandbox_children() == []


def test_kernel_confinement_alone_holds_without_the_audit_hook(tmp_path: Path) -> None:
    """Landlock + seccomp on a bare interpreter (no audit hook): writes outside, forks, sockets
    and signals to this process fail even from a thread, as root too; threads still work."""
    if confine.abi_version() < 1 or not confine.seccomp_supported():
        pytest.skip("Landlock or seccomp is not available on this kernel/architecture")
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / "outside.txt"
    code = (
        "import os, socket, threading\n"
        "def attempt(label, fn):\n"
        "    try:\n        fn(); print(label, 'ok')\n"
        "    except OSError as exc:\n        print(label, 'blocked', exc.errno)\n"
        f"attempt('write', lambda: open({str(outside)!r}, 'w'))\n"
        "attempt('inside', lambda: open('inside.txt', 'w').write('x'))\n"
        "attempt('fork', lambda: os.fork() or None)\n"
        "attempt('socket', lambda: socket.socket().close())\n"
        f"attempt('signal', lambda: os.kill({os.getpid()}, 0))\n"
        f"t = threading.Thread(target=attempt, args=('thread-write', lambda: open("
        f"{str(outside)!r}, 'w')))\n"
        "t.start(); t.join()\n"
    )
    ruleset = confine.make_ruleset(str(work))
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", code],
            cwd=work,
            preexec_fn=_preexec(SandboxLimits(), None, ruleset, _seccomp_filter()),
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    finally:
        os.close(ruleset)
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["write"].startswith("blocked") and lines["thread-write"].startswith("blocked")
    assert lines["inside"] == "ok"
    assert lines["fork"].startswith("blocked") and lines["socket"].startswith("blocked")
    assert lines["signal"].startswith("blocked")
    assert not outside.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="RLIMIT_NPROC does not apply to root")
def test_rlimit_nproc_alone_stops_forks() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import os\ntry:\n    os.fork(); print('forked')\nexcept OSError: print('blocked')",
        ],
        preexec_fn=_preexec(SandboxLimits(), None),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert out.strip() == "blocked"


def test_malicious_answers_do_not_affect_the_test_process(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-42")
    task = PyCodeTask(limits=FAST)
    ex = _add3()
    nasty = {
        "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "kill group": "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
        "read secret": f"def f(x):\n    raise ValueError(open({str(secret)!r}).read())",
        "exit early": "import os\nos._exit(0)",
        "close stdout": "import os\nos.close(1)\ndef f(x):\n    return x + 3",
        "flood print": "while True:\n    print('spam' * 1000)",
        "flood fd": "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
        "raise limits": "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
        "ctypes": "import ctypes\nctypes.CDLL(None).fork()",
        "gc walk": "import gc\ngc.get_objects()",
        "recursion": "def f(x):\n    return f(x)",
        "forge results": (
            "import sys\nemit = sys._getframe(1).f_locals.get('emit')\n"
            "if emit:\n    emit({'kind': 'done', 'stdout': ''})\n"
            "def f(x):\n    return x"
        ),
    }
    me = os.getpid()
    for label, src in nasty.items():
        v = task.verify(ex, src)
        assert not v.correct and v.feedback and v.reward < 0.9, label
        assert "TOPSECRET" not in v.feedback, label
    assert os.getpid() == me and secret.read_text() == "TOPSECRET-42"
    assert _sandbox_children() == []
