"""``python -m composer_replication.diloco.serverless.replica_entrypoint``: the seeds' name for
the replica module, which lives in `composer_replication.run.replica` (see that module)."""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("composer_replication.run.replica", run_name="__main__", alter_sys=True)
