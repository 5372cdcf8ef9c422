"""A tiny replica for the executor tests (stdlib only, starts in ~50 ms).

Writes what it was given (rank, world size, rendezvous, selected env) to
<store>/rank-<rank>.json, where <store> is the rendezvous URI's file:// path, prints a line,
then sleeps `--sleep` seconds and exits 0, or exits `--exit-code` if its rank is a
`--fail-rank`. Accepts the seed driver's `--rendezvous URI --rank_env NAME` arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--rank_env", default="REPLICA_RANK")
    p.add_argument("--fail-rank", type=int, action="append", default=[])
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--show-env", action="append", default=[])
    args = p.parse_args(argv)
    rank = int(os.environ[args.rank_env])
    world = int(os.environ["WORLD_SIZE"])
    store = args.rendezvous.removeprefix("file://")
    os.makedirs(store, exist_ok=True)
    record = {
        "rank": rank,
        "world_size": world,
        "rendezvous_env": os.environ.get("DILOCO_RENDEZVOUS"),
        "rendezvous_arg": args.rendezvous,
        "replica_rank_env": os.environ.get("REPLICA_RANK"),
        "env": {k: os.environ.get(k) for k in args.show_env},
    }
    with open(os.path.join(store, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"replica {rank} of {world} starting", flush=True)
    if rank in args.fail_rank:
        print(f"boom: replica {rank} simulated failure", file=sys.stderr, flush=True)
        return args.exit_code
    time.sleep(args.sleep)
    print(f"replica {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
