"""diloco_driver.py: launch N DiLoCo replicas and wait for them (seed Recipe 4, runnable).

    python examples/diloco_driver.py                                  # file://./runs/..., 4 replicas
    python examples/diloco_driver.py --uri s3://bucket/diloco-runs/run42/ \
        --endpoint-url http://127.0.0.1:8333                          # a local S3 server

Credentials for S3 come from the usual AWS variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY);
``--endpoint-url`` points s3fs at a local server (SeaweedFS ``weed mini``, ``moto_server``) and is
passed to the replicas as COMPOSER_STORAGE_OPTIONS. Every replica runs examples/diloco_replica.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from composer_replication.diloco.serverless import (
    LocalProcessExecutor,  # for dev: runs replicas as local subprocesses
    ObjectStoreAllReduce,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--uri", default="file://" + os.path.abspath("runs/diloco-example/store"))
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (local server)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sync-every-h", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600.0)
    a = ap.parse_args()
    storage_options = {"endpoint_url": a.endpoint_url} if a.endpoint_url else {}

    # ---- the seed's Recipe 4 driver ---------------------------------------------------------
    rendezvous = ObjectStoreAllReduce(
        uri=a.uri,  # or s3://my-bucket/diloco-runs/run42/
        world_size=a.replicas,
        storage_options=storage_options,
    )
    executor = LocalProcessExecutor()
    handles = executor.launch_replicas(
        n_replicas=a.replicas,
        entrypoint=str(Path(__file__).with_name("diloco_replica.py")),
        entrypoint_args={
            "rendezvous": rendezvous.uri,
            "rank_env": "REPLICA_RANK",
            "steps": a.steps,
            "sync-every-h": a.sync_every_h,
        },
        env={"COMPOSER_STORAGE_OPTIONS": json.dumps(storage_options)},
    )
    result = executor.collect(handles, timeout=a.timeout)
    print({h.replica_id: h.exit_code for h in result})
    # -----------------------------------------------------------------------------------------

    for h in result:
        print(f"--- replica {h.replica_id} ({h.status}):")
        print(executor.logs(h, tail=1).strip())
    latest = rendezvous.fetch_state()
    if latest is not None:
        print(f"latest published global state: round {latest[0]} in {rendezvous.uri}")
    raise SystemExit(0 if all(h.exit_code == 0 for h in result) else 1)


if __name__ == "__main__":
    main()
