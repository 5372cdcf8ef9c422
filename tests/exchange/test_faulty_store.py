"""`FaultyStore`: faults injected through the `Store` interface, by rule."""

from __future__ import annotations

import threading

import pytest

from composer_replication.exchange.faulty_store import Fault, FaultyStore
from composer_replication.exchange.store import ObjectStore


@pytest.fixture
def real(tmp_path) -> ObjectStore:
    store = ObjectStore(str(tmp_path / "run"))
    for key in ("steps/0000000001/commit.json", "steps/0000000002/commit.json", "a.json"):
        store.put(key, b'{"k": 1}')
    return store


def test_fail_hits_the_nth_matching_call_only_and_stops_the_write(real):
    rule = Fault("put_if_absent", "steps/*/contrib/*", "fail", after=1)
    store = FaultyStore(real, [rule])
    assert store.put_if_absent("steps/0000000001/contrib/00000.safetensors", b"x")  # let through
    assert store.put_if_absent("b.json", b"{}")  # does not match: not counted
    with pytest.raises(OSError, match="injected fault: put_if_absent 'steps/0000000001/contrib"):
        store.put_if_absent("steps/0000000001/contrib/00001.safetensors", b"y")
    assert not real.has_object("steps/0000000001/contrib/00001.safetensors")  # never sent
    assert store.put_if_absent("steps/0000000001/contrib/00001.safetensors", b"y")  # times=1
    assert (rule.seen, rule.hits) == (3, 1)


def test_fail_after_sends_the_request_then_loses_the_answer(real):
    rule = Fault("put_if_absent", "x.bin", "fail_after", error=ConnectionResetError)
    store = FaultyStore(real, [rule])
    with pytest.raises(ConnectionResetError):
        store.put_if_absent("x.bin", b"data")
    assert bytes(real.get("x.bin") or b"") == b"data"  # it was written
    assert store.put_if_absent("x.bin", b"data") is False  # the retry finds it there


def test_corrupt_flips_a_byte_on_read_or_on_write(real):
    store = FaultyStore(real, [Fault("get", "a.json", "corrupt"), Fault("put", "b.bin", "corrupt")])
    assert bytes(store.get("a.json") or b"") != b'{"k": 1}'  # bit rot on the way back
    assert bytes(store.get("a.json") or b"") == b'{"k": 1}'  # once
    store.put("b.bin", b"\x00\x00\x00")
    assert bytes(real.get("b.bin") or b"") == b"\x00\xff\x00"  # stored damaged


def test_drop_hides_objects_listing_entries_and_loses_writes(real):
    store = FaultyStore(
        real,
        [
            Fault("get", "a.json", "drop"),
            Fault("list", "steps/0000000002", "drop"),
            Fault("put", "lost.json", "drop"),
            Fault("delete", "a.json", "drop"),
        ],
    )
    assert store.get("a.json") is None and store.get("a.json") is not None
    assert store.list("steps/") == ["0000000001"]
    assert store.list("steps/") == ["0000000001", "0000000002"]
    store.put("lost.json", b"{}")
    assert real.get("lost.json") is None
    store.delete("a.json")
    assert real.get("a.json") is not None


def test_json_documents_go_through_the_faults(real):
    store = FaultyStore(real, [Fault("get", "a.json", "corrupt", times=None)])
    with pytest.raises(ValueError, match="not a JSON document"):
        store.get_json("a.json")
    assert store.put_json("c.json", {"v": 2}, exclusive=True)
    assert store.get_json("c.json") == {"v": 2}


def test_delay_then_the_request_goes_through(real):
    rule = Fault("get", "a.json", "delay", delay_s=0.01)
    assert bytes(FaultyStore(real, [rule]).get("a.json") or b"") == b'{"k": 1}'
    assert rule.hits == 1


def test_a_shared_rule_hits_exactly_times_across_threads(real):
    rule = Fault("get", "a.json", "fail", times=5)
    stores = [FaultyStore(real, [rule]) for _ in range(4)]
    failures = []

    def hammer(store: FaultyStore) -> None:
        for _ in range(25):
            try:
                store.get("a.json")
            except OSError:
                failures.append(1)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (rule.seen, rule.hits, len(failures)) == (100, 5, 5)


def test_requests_a_fault_stopped_were_never_sent(real):
    before = real.requests.snapshot()
    store = FaultyStore(real, [Fault("get", "a.json", "fail")])
    with pytest.raises(OSError):
        store.get("a.json")
    store.get("a.json")
    assert store.requests.since(before)["get"] == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(op="post"), "unknown op 'post'"),
        (dict(op="get", action="explode"), "unknown action 'explode'"),
        (dict(op="list", action="corrupt"), "'corrupt' applies to get, put, put_if_absent"),
        (dict(op="get", after=-1), "after must be"),
        (dict(op="get", times=0), "times must be"),
        (dict(op="get", action="delay"), "delay_s > 0"),
    ],
)
def test_bad_rules_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fault(**kwargs)
