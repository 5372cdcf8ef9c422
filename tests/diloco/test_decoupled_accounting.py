"""A push claims only work that is in it (issue 23): `steps_since_push` counts the inner steps
since the learner's previous push of the fragment OR since a newer global replaced the fragment,
whichever is later, so work overwritten by a new global is never claimed twice (or at all).

One learner, one fragment, H = 8 (a push every 8 steps), a file:// store, no synchronizer: the
test publishes a newer global itself, between two of the learner's steps, as a synchronizer
would.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _decoupled_toy import Blocks, train_step  # noqa: E402

from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig  # noqa: E402
from composer_replication.exchange.push_store import DecoupledStore  # noqa: E402
from composer_replication.exchange.store import ObjectStore  # noqa: E402


def _pushes(store: ObjectStore) -> list[dict]:
    docs = DecoupledStore(store)
    out = []
    for pid in docs.list_pushes():
        push, _ = docs.fetch_push(pid, None)
        assert push is not None and not isinstance(push, str), push
        out.append(
            {
                "base": pid.base,
                "steps": push.steps,
                "since": push.steps_since_push,
                "at": push.learner_step,
            }
        )
    return sorted(out, key=lambda p: p["at"])


def test_a_newer_global_resets_the_work_a_push_claims(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "store"))
    model = Blocks(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = DecoupledLearner(
        store,
        learner=0,
        n_learners=1,
        config=LearnerConfig(
            sync_every_h=8,
            fragments=1,
            poll_interval_s=0.05,
            drain_timeout_s=0.5,
            heartbeat_every_s=None,
        ),
        model=model,
        inner_optimizer=opt,
    )
    docs = DecoupledStore(store)
    with learner:
        for t in range(10):  # a push at step 8 (8 steps), then steps 9 and 10
            train_step(model, opt, 0, t)
        assert learner.wait_for_uploads(30)
        # a synchronizer publishes version 1 of the fragment: the learner takes it before its
        # next step ends, and the work of steps 9-11 on the old fragment is overwritten
        newer = {n: t + 0.01 for n, t in learner.base[0].items()}
        docs.publish_global(0, 1, newer)
        docs.write_heads([1])
        learner.fetch_new_globals()  # (or its fetch thread does: ready before the next step)
        for t in range(10, 16):  # step 11 applies version 1; steps 12-16 train on it
            train_step(model, opt, 0, t)
        assert learner.wait_for_uploads(30)
    pushes = _pushes(store)
    regular = [p for p in pushes if p["at"] in (8, 16)]
    assert [(p["base"], p["steps"], p["since"]) for p in regular] == [
        (0, 8, 8),  # steps 1-8 on version 0
        (1, 5, 5),  # steps 12-16 on version 1, not the 8 steps since the previous push
    ]
    # the final push (leaving the context) has trained nothing since: none was written
    assert all(p["at"] in (8, 16) for p in pushes)
    assert learner.written == sorted(p.name for p in docs.list_pushes())
