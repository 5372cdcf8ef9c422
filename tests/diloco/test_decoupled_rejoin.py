"""A rejoining decoupled learner downloads only the newest version of each fragment merged
while it was down (none for a fragment still at its resume state's base) and uploads nothing
while binding; `DecoupledLearner.rejoin` reports what it downloaded. Counted through the store
interface: the learner is handed a recording `FaultyStore` (no faults), nothing is patched."""

from __future__ import annotations

from pathlib import Path

import torch
from _decoupled_toy import Blocks, train_step

from composer_replication.diloco.decoupled import DecoupledLearner, LearnerConfig
from composer_replication.exchange.faulty_store import FaultyStore
from composer_replication.exchange.push_store import DecoupledStore, global_key
from composer_replication.exchange.store import ObjectStore, Payload, Store

H, P, K = 8, 4, 5


class _Recording(FaultyStore):
    """Every GET and write of the learner, with the object's size."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, str, int]] = []

    def get(self, key: str) -> bytes | memoryview | None:
        got = super().get(key)
        self.calls.append(("get", key, 0 if got is None else len(got)))
        return got

    def put_if_absent(self, key: str, data: Payload) -> bool:
        self.calls.append(("put_if_absent", key, 0))
        return super().put_if_absent(key, data)

    def put(self, key: str, data: Payload) -> None:
        self.calls.append(("put", key, 0))
        super().put(key, data)

    def on_globals(self) -> list[tuple[str, str, int]]:
        return [c for c in self.calls if "/global/" in c[1]]


def _learner(store: Store, seed: int) -> tuple[Blocks, torch.optim.Optimizer, DecoupledLearner]:
    model = Blocks(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    learner = DecoupledLearner(
        store,
        learner=0,
        n_learners=1,
        config=LearnerConfig(sync_every_h=H, fragments=P, heartbeat_every_s=None),
        model=model,
    )
    return model, opt, learner


def _down_while_merged(
    tmp_path: Path, heads: list[int]
) -> tuple[ObjectStore, dict, list[dict[str, torch.Tensor]]]:
    """A learner trained to a push (its resume state taken there), then down while fragment i
    was merged up to version ``heads[i]`` (every version stored, as the synchronizer does).
    Returns the store, the resume state and each fragment's newest weights."""
    store = ObjectStore(str(tmp_path / "store"))
    model, opt, learner = _learner(store, seed=7)
    learner.bind(optimizer=opt)
    opt.register_step_post_hook(learner._after_step)
    for t in range(H // P):
        train_step(model, opt, 0, t)
    assert learner.last_push_step == learner.step
    state = learner.resume_state()
    docs = DecoupledStore(store)
    newest = []
    for i, head in enumerate(heads):
        tensors = learner.base[i]
        for v in range(1, head + 1):
            tensors = {n: t + 0.01 * v for n, t in learner.base[i].items()}
            docs.publish_global(i, v, tensors)
        newest.append(tensors)
    docs.write_heads(heads)
    docs.write_progress(0, step=learner.step, done=False)
    return store, dict(state), newest


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_restored_learner_downloads_only_each_fragments_newest_version(tmp_path: Path) -> None:
    heads = [K, K - 1, K - 2, 0]  # fragment 3 was not merged while the learner was down
    store, state, newest = _down_while_merged(tmp_path, heads)
    recording = _Recording(store)
    model, opt, learner = _learner(recording, seed=99)
    learner.restore(state)
    learner.bind(optimizer=opt)

    assert learner.versions == heads
    globals_ = recording.on_globals()
    # one GET per fragment merged meanwhile, of its newest version; no write (version 0 exists)
    assert [(op, key) for op, key, _ in globals_] == [
        ("get", global_key(i, v)) for i, v in enumerate(heads) if v > 0
    ]
    wire = sum(n for _, _, n in globals_)
    assert wire > 0
    taken = sum(_nbytes(newest[i]) for i, v in enumerate(heads) if v > 0)
    assert learner.rejoin == {
        "step": H // P,
        "from_versions": [0] * P,
        "versions": heads,
        "merged_meanwhile": sum(heads),
        "objects": 3,
        "bytes": taken,
    }
    assert learner.bytes_downloaded == taken
    # the fragments hold the newest globals, fragment 3 its resume state's base
    for i in range(P):
        expect = newest[i] if heads[i] else state["base"][i]
        for n, t in learner.base[i].items():
            assert torch.equal(t, expect[n]), (i, n)
    for name, p in zip(learner._names[0], learner._params[0]):
        assert torch.equal(p.detach(), newest[0][name])
    # the poller finds nothing newer to download
    assert learner.fetch_new_globals() == 0
    assert recording.on_globals() == globals_


def test_a_learner_up_to_date_with_its_state_downloads_nothing(tmp_path: Path) -> None:
    store, state, _ = _down_while_merged(tmp_path, [0] * P)
    recording = _Recording(store)
    _, opt, learner = _learner(recording, seed=99)
    learner.restore(state)
    learner.bind(optimizer=opt)
    assert recording.on_globals() == []
    assert learner.rejoin is not None
    assert learner.rejoin["objects"] == learner.rejoin["bytes"] == 0
    assert learner.rejoin["merged_meanwhile"] == 0


def test_without_a_state_it_downloads_the_newest_of_every_fragment_once(tmp_path: Path) -> None:
    heads = [K, K, K - 1, 1]
    store, _, newest = _down_while_merged(tmp_path, heads)
    recording = _Recording(store)
    _, opt, learner = _learner(recording, seed=99)
    assert learner.start_step == H // P  # from its progress document
    learner.bind(optimizer=opt)
    assert [(op, key) for op, key, _ in recording.on_globals()] == [
        ("get", global_key(i, v)) for i, v in enumerate(heads)
    ]
    assert learner.rejoin is not None
    assert learner.rejoin["from_versions"] is None
    assert learner.rejoin["merged_meanwhile"] is None
    assert learner.rejoin["objects"] == P
    assert learner.rejoin["bytes"] == sum(_nbytes(t) for t in newest)


def test_a_corrupt_newest_version_falls_back_no_further_than_the_base(tmp_path: Path) -> None:
    heads = [K, 2, 0, 0]
    store, state, _ = _down_while_merged(tmp_path, heads)
    for i, v in ((0, K), (1, 2), (1, 1)):  # fragment 1 has nothing readable past its base
        raw = bytearray(bytes(store.get(global_key(i, v))))
        raw[len(raw) // 2] ^= 0xFF
        store.put(global_key(i, v), bytes(raw))
    recording = _Recording(store)
    _, opt, learner = _learner(recording, seed=99)
    learner.restore(state)
    learner.bind(optimizer=opt)
    assert learner.versions == [K - 1, 0, 0, 0]
    assert [key for _, key, _ in recording.on_globals()] == [
        global_key(0, K),
        global_key(0, K - 1),
        global_key(1, 2),
        global_key(1, 1),
    ]
    assert learner.rejoin is not None and learner.rejoin["objects"] == 4
