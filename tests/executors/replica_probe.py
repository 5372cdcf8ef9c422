"""A tiny replica for executor tests: records what it was given, then behaves as told.

Run as a script (`python replica_probe.py --store DIR ...`) or as a function entrypoint
(`replica_probe:main` with this folder on PYTHONPATH). It writes `rank-{rank}.json` (or
`rank-{rank}-attempt-{k}.json` for later attempts) to the store: a plain path or any fsspec URL
(file://, memory:// is useless across processes). Options:

  --store URL          where to write (required)
  --sleep S            sleep S seconds after writing the record
  --sleep-rank R       apply --sleep only on rank R (repeatable)
  --exit-code N        exit with N (after sleeping)
  --fail-rank R        apply --exit-code only on rank R (others exit 0)
  --fail-attempts K    apply --exit-code only on the first K attempts (restart tests)
  --grandchild         start a grandchild that sleeps 300 s, record its pid before sleeping
  --ignore-sigterm     ignore SIGTERM (so only SIGKILL can stop it)
  --echo-env NAME      also record env var NAME (repeatable)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import fsspec

RECORDED_ENV = ("REPLICA_RANK", "WORLD_SIZE", "DILOCO_RENDEZVOUS")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="replica_probe")
    p.add_argument("--store", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--sleep-rank", type=int, action="append", default=None)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-attempts", type=int, default=None)
    p.add_argument("--grandchild", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--echo-env", action="append", default=[])
    # Whatever else the driver passes (e.g. --rendezvous, --rank_env) is recorded, not parsed.
    return p


def _attempt(fs: fsspec.AbstractFileSystem, root: str, rank: int) -> int:
    """0 on the first run of this rank, 1 after one restart, ... (counted via the store)."""
    k = 0
    while fs.exists(f"{root}/attempt-{rank}-{k}"):
        k += 1
    with fs.open(f"{root}/attempt-{rank}-{k}", "w") as f:
        f.write(str(os.getpid()))
    return k


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    rank = int(os.environ["REPLICA_RANK"])
    fs, root = fsspec.core.url_to_fs(args.store)
    fs.makedirs(root, exist_ok=True)
    attempt = _attempt(fs, root, rank)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild_pid = None
    if args.grandchild:
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        grandchild_pid = grandchild.pid
    record = {
        "rank": rank,
        "attempt": attempt,
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "grandchild_pid": grandchild_pid,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "extra_args": extra,
        "env": {k: os.environ.get(k) for k in (*RECORDED_ENV, *args.echo_env)},
    }
    name = f"rank-{rank}.json" if attempt == 0 else f"rank-{rank}-attempt-{attempt}.json"
    with fs.open(f"{root}/{name}.tmp", "w") as f:
        json.dump(record, f)
    fs.mv(f"{root}/{name}.tmp", f"{root}/{name}")  # readers never see a half-written record
    print(f"probe rank={rank} attempt={attempt} pid={os.getpid()} started", flush=True)
    if args.sleep_rank is None or rank in args.sleep_rank:
        time.sleep(args.sleep)
    failing = (args.fail_rank is None or args.fail_rank == rank) and (
        args.fail_attempts is None or attempt < args.fail_attempts
    )
    code = args.exit_code if failing else 0
    if code:
        print(f"probe rank={rank} failing on purpose with exit code {code}", file=sys.stderr)
    else:
        print(f"probe rank={rank} done", flush=True)
    return code


def read_records(store: str) -> dict[int, dict]:
    """rank -> first-attempt record, for the tests."""
    fs, root = fsspec.core.url_to_fs(store)
    out: dict[int, dict] = {}
    if not fs.exists(root):
        return out
    for path in fs.ls(root, detail=False):
        base = path.rsplit("/", 1)[-1]
        if base.startswith("rank-") and base.endswith(".json") and "attempt" not in base:
            with fs.open(path) as f:
                rec = json.load(f)
            out[rec["rank"]] = rec
    return out


if __name__ == "__main__":
    sys.exit(main())
