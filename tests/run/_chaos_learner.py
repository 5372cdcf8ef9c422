"""One decoupled learner process for the chaos tests (run as a script by LocalProcessExecutor).

The toy model of tests/diloco/_decoupled_toy.py, its rank from $REPLICA_RANK. Every start appends
the global versions it started from to OUT/learner<rank>-starts.jsonl; at the end it writes
OUT/learner<rank>.json: the final versions, a digest of the global weights it holds, the
digest of every global version it loaded and the pushes it wrote (what check_decoupled_run
compares with the store).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "diloco"))

import torch  # noqa: E402
from _decoupled_toy import Blocks, train_step  # noqa: E402

from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig  # noqa: E402
from composer_replication.exchange.protocol import tensors_digest  # noqa: E402
from composer_replication.exchange.store import ObjectStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uri", required=True)
    ap.add_argument("--storage-options", default="{}")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rank = int(os.environ["REPLICA_RANK"])
    torch.set_num_threads(1)
    out = Path(a.out)
    store = ObjectStore(a.uri, json.loads(a.storage_options))
    model = Blocks(seed=100 + rank, width=a.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    learner = DecoupledLearner(
        store,
        learner=rank,
        n_learners=a.n,
        config=LearnerConfig(
            sync_every_h=a.h,
            fragments=a.p,
            poll_interval_s=0.05,
            drain_timeout_s=180,
            heartbeat_every_s=0.5,
        ),
        model=model,
        inner_optimizer=opt,
    )
    with open(out / f"learner{rank}-starts.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "step": learner.start_step,
                    "versions": learner.start_versions,
                    "time": time.time(),
                }
            )
            + "\n"
        )
    with learner:
        for t in range(learner.start_step, a.steps):
            t0 = time.monotonic()
            train_step(model, opt, rank, t)
            time.sleep(max(0.0, a.step_s - (time.monotonic() - t0)))
    learner.load_global_weights()
    starts = [json.loads(line) for line in open(out / f"learner{rank}-starts.jsonl")]
    report = {
        "final_versions": learner.final_versions,
        "digest": tensors_digest(learner.global_parameters()),
        "loaded": learner.loaded,
        "starts": [s["versions"] for s in starts],
        "pushes": learner.pushes,
        "written": learner.written,
        "step": learner.step,
    }
    (out / f"learner{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
