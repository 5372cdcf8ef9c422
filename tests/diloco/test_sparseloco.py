"""SparseLoCo: the replica's error feedback keeps every bit of the pseudo-gradients (sent +
residual == the decayed sum of the deltas, failed rounds and retries included), two real replica
processes over file:// agree bit for bit and match an independent reference written out here,
and the run config's keys are checked."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tolerances import assert_close

from composer_replication.config.loader import load_config
from composer_replication.diloco.sparseloco import ErrorFeedbackManager, sparseloco_outer_optimizer
from composer_replication.exchange import codecs
from composer_replication.exchange.sparse import SparseSpec

sys.path.insert(0, str(Path(__file__).parent))

SPEC = SparseSpec(density=0.05, chunk=64, bits=2)


def ref_compress(x: torch.Tensor, chunk: int, k: int, bits: int) -> torch.Tensor:
    """Chunk-wise top-k and 2**bits levels on [-m, m], written out with Python loops (float64)."""
    flat = x.reshape(-1).double().tolist()
    out = [0.0] * len(flat)
    levels = 2**bits - 1
    for c0 in range(0, len(flat), chunk):
        idx = list(range(c0, min(len(flat), c0 + chunk)))
        top = sorted(idx, key=lambda i: -abs(flat[i]))[: min(k, len(idx))]
        m = max(abs(flat[i]) for i in top)
        step = 2 * m / levels
        for i in top:
            j = 0 if step == 0 else min(levels, max(0, round((flat[i] + m) / step)))
            out[i] = j * step - m
    return torch.tensor(out, dtype=torch.float64).view(x.shape)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class FakeStore:
    """A Manager whose 'exchange' keeps the first upload of each step (as the store does) and
    commits or fails rounds as scripted; it records what it committed."""

    _use_async_quorum = False

    def __init__(self, plan: list[bool]) -> None:
        self.plan = list(plan)
        self.step = 0
        self.uploads: dict[tuple[int, int], torch.Tensor] = {}
        self.calls = 0
        self.committed: list[torch.Tensor] = []
        self._round: list[torch.Tensor] = []

    def start_quorum(self, allow_heal=True, shrink_only=False, timeout=None) -> None:
        self.calls = 0
        self._round = []

    def current_step(self) -> int:
        return self.step

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _Done:
        key = (self.step + 1, self.calls)
        self.calls += 1
        if key not in self.uploads:  # what the exchange encodes: codec sparseloco
            parts = codecs.encode(tensor, "sparseloco", SPEC)
            self.uploads[key] = codecs.decode(parts, "sparseloco", tensor.numel()).view(
                tensor.shape
            )
        tensor.copy_(self.uploads[key])  # one replica: the mean is its own message
        self._round.append(self.uploads[key])
        return _Done()

    def should_commit(self, timeout=None) -> bool:
        ok = self.plan.pop(0)
        if ok:
            self.step += 1
            self.committed.append(self._round[0])
        return ok


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_sent_plus_residual_is_the_decayed_sum_of_committed_deltas(decay):
    plan = [True, False, True, True, False, False, True, True]
    inner = FakeStore(plan)
    ef = ErrorFeedbackManager(inner, SPEC, decay=decay)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    expected = torch.zeros(1000, dtype=torch.float64)  # sum over committed rounds, decayed
    sent = torch.zeros(1000, dtype=torch.float64)
    for ok in plan:
        ef.start_quorum()
        delta = torch.randn(1000, generator=g)
        t = delta.clone()
        ef.allreduce(t)
        assert ef.should_commit() is ok
        if ok:
            expected = decay * expected + delta.double()
            sent = decay * sent + inner.committed[-1].double()
            # what came back is the message, i.e. what the outer step applies
            assert torch.equal(t, inner.committed[-1])
    e = ef.buffers[(0, 0)].double()
    # the fp32 accumulator: decay * e + delta - message, three roundings per committed round,
    # of values the size of the accumulated sum
    assert_close(sent + e, expected, n=3 * len(plan), what="sent + e")
    assert 0 < e.norm() < expected.norm()  # most of the mass went, some waits
    assert inner.step == sum(plan)


def test_a_retried_step_accounts_the_first_upload():
    inner = FakeStore([False, True])
    ef = ErrorFeedbackManager(inner, SPEC, decay=1.0)  # type: ignore[arg-type]
    first, second = torch.randn(500), torch.randn(500)
    ef.start_quorum()
    ef.allreduce(first.clone())
    assert not ef.should_commit() and ef.buffers == {}  # a failed round leaves e alone
    ef.start_quorum()
    ef.allreduce(second.clone())
    assert ef.should_commit()
    m1 = inner.uploads[(1, 0)]
    # e = (1.0 * nothing + second) - message: one fp32 subtraction here and there (n = 2)
    assert_close(ef.buffers[(0, 0)], second - m1, n=2)


def test_a_round_sat_out_after_a_heal_is_not_taken_for_an_upload():
    inner = FakeStore([False, True])
    ef = ErrorFeedbackManager(inner, SPEC, decay=1.0)  # type: ignore[arg-type]
    inner.step = 0
    real_start = inner.start_quorum

    def healing_start(**kw):  # the store says round 3 is committed: load it, sit this one out
        real_start(**kw)
        inner.step = 3

    inner.start_quorum = healing_start  # type: ignore[method-assign]
    ef.start_quorum()
    t = torch.randn(500)
    ef.allreduce(t.clone())  # the real manager returns at once, uploading nothing
    inner.uploads.clear()
    assert not ef.should_commit()
    inner.start_quorum = real_start  # type: ignore[method-assign]
    ef.start_quorum()
    second = torch.randn(500)
    ef.allreduce(second.clone())
    assert ef.should_commit()
    sent = inner.uploads[(4, 0)]  # what the exchange really encoded this time
    assert_close(ef.buffers[(0, 0)], second - sent, n=2)  # one fp32 subtraction each


def test_a_round_adopted_from_the_published_state_counts_as_committed():
    """The round's step committed with this replica's message, but a contribution it lists was
    unreadable here, so the manager loaded the round's published state instead: should_commit
    is False, the step advanced. The message went to that step: e keeps what was not sent,
    and the next round sends a new message (not the remembered one of a failed step)."""
    inner = FakeStore([False, True])
    ef = ErrorFeedbackManager(inner, SPEC, decay=1.0)  # type: ignore[arg-type]
    real_commit = inner.should_commit

    def adopting_commit(timeout=None):  # the exchange failed; the committed state is loaded
        ok = real_commit(timeout)
        inner.step += 1
        return ok

    inner.should_commit = adopting_commit  # type: ignore[method-assign]
    first = torch.randn(500)
    ef.start_quorum()
    ef.allreduce(first.clone())
    assert not ef.should_commit() and inner.step == 1
    m1 = inner.uploads[(1, 0)]
    assert_close(ef.buffers[(0, 0)], first - m1, n=2)  # as after a committed round
    inner.should_commit = real_commit  # type: ignore[method-assign]
    second = torch.randn(500)
    ef.start_quorum()
    ef.allreduce(second.clone())
    assert ef.should_commit()
    m2 = inner.uploads[(2, 0)]  # step 2's own message, encoded from the new accumulator
    assert_close(ef.buffers[(0, 0)], first - m1 + second - m2, n=4)


def test_fragments_have_their_own_accumulators_and_shapes_are_checked():
    inner = FakeStore([True, True, True])
    ef = ErrorFeedbackManager(inner, SPEC, decay=1.0, num_fragments=2)  # type: ignore[arg-type]
    for shape in [(10,), (4, 4), (10,)]:
        ef.start_quorum()
        ef.allreduce(torch.randn(shape))
        ef.should_commit()
    assert set(ef.buffers) == {(0, 0), (1, 0)}
    inner.plan = [True]
    ef.start_quorum()  # round 3: fragment 1, which had a (4, 4) tensor
    with pytest.raises(RuntimeError, match="same tensors in the same order"):
        ef.allreduce(torch.randn(10))


def test_error_feedback_refuses_a_dense_exchange_and_bad_settings(tmp_path):
    from composer_replication.exchange import (
        AllReduceConfig,
        ObjectStoreAllReduce,
        ObjectStoreManager,
    )

    dense = ObjectStoreManager(
        ObjectStoreAllReduce(str(tmp_path), 2, 0, config=AllReduceConfig(codec="int8"))
    )
    with pytest.raises(ValueError, match="codec 'sparseloco'"):
        ErrorFeedbackManager(dense, SPEC, decay=0.9)
    other = ObjectStoreManager(
        ObjectStoreAllReduce(
            str(tmp_path), 2, 0, config=AllReduceConfig(codec="sparseloco", sparse=SparseSpec())
        )
    )
    with pytest.raises(ValueError, match="same SparseSpec"):
        ErrorFeedbackManager(other, SPEC, decay=0.9)
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedbackManager(FakeStore([]), SPEC, decay=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr"):
        sparseloco_outer_optimizer(0.0)


def test_one_replica_applies_its_own_message(tmp_path):
    from composer_replication.exchange import AllReduceConfig, ObjectStoreAllReduce

    ar = ObjectStoreAllReduce(
        str(tmp_path), 1, 0, config=AllReduceConfig(codec="sparseloco", sparse=SPEC)
    )
    x = torch.randn(3, 100)
    got = ar.allreduce({"w": x}, step=1)["w"]
    assert got.shape == x.shape and torch.equal(
        got, codecs.decode(codecs.encode(x, "sparseloco", SPEC), "sparseloco", 300).view(3, 100)
    )


# ----------------------------------------------------------------------------- run config


def test_config_keys_default_and_validate():
    d = load_config(overrides=["diloco.codec=sparseloco"]).diloco.sparseloco
    assert d.sparse_spec() == SparseSpec() and d.sparseloco_ef_decay == 0.95
    assert d.sparseloco_outer_lr == 1.0
    for key, value, match in [
        ("sparseloco_density", "0", "diloco.sparseloco_density"),
        ("sparseloco_chunk", "0", "diloco.sparseloco_chunk"),
        ("sparseloco_bits", "3", "diloco.sparseloco_bits"),
        ("sparseloco_ef_decay", "1.5", "diloco.sparseloco_ef_decay"),
        ("sparseloco_outer_lr", "0", "diloco.sparseloco_outer_lr"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config(overrides=["diloco.codec=sparseloco", f"diloco.{key}={value}"])
    with pytest.raises(ValueError, match="sync mode only"):
        load_config(
            overrides=["diloco.codec=sparseloco", "diloco.mode=decoupled", "diloco.fragments=2"]
        )
    with pytest.raises(ValueError, match="'adam' contradicts"):
        load_config(overrides=["diloco.codec=sparseloco", "diloco.outer_optimizer=adam"])


def test_decoupled_pushes_refuse_the_sparse_codec(tmp_path):
    from composer_replication.exchange.push_store import DecoupledStore
    from composer_replication.exchange.store import ObjectStore

    with pytest.raises(ValueError, match="not for decoupled pushes"):
        DecoupledStore(ObjectStore(str(tmp_path)), codec="sparseloco")


# ----------------------------------------------------------------------------- real processes


@pytest.mark.slow
def test_two_replica_processes_over_file_agree_and_match_the_reference(tmp_path: Path) -> None:
    from _diloco_reference import local_after, named_params, reference_tol
    from test_diloco_multiprocess import dumped, logs, spawn, wait_all

    out = tmp_path / "out"
    out.mkdir()
    uri = "file://" + str(tmp_path / "run")
    rounds, h, decay, lr = 3, 4, 0.9, 1.0
    kw = dict(
        uri=uri,
        rounds=rounds,
        h=h,
        codec="sparseloco",
        density=0.25,
        chunk=16,
        bits=2,
        ef_decay=decay,
        outer_lr=lr,
    )
    procs = [spawn(out, r, 2, **kw) for r in range(2)]
    assert wait_all(procs, out) == [0, 0], logs(out)
    for k in range(rounds + 1):
        a, b = dumped(out, 0, k), dumped(out, 1, k)
        assert all(torch.equal(a[n], b[n]) for n in a), f"round {k}: the replicas disagree"
    # independent reference: each replica's inner loop, its accumulator, the messages, SGD
    g = {n: t.double() for n, t in named_params(dumped(out, 0, 0)).items()}
    e = {r: {n: torch.zeros_like(t) for n, t in g.items()} for r in range(2)}
    for k in range(rounds):
        msgs = []
        for r in range(2):
            local = local_after({n: t.float() for n, t in g.items()}, r, k, h)
            m = {}
            for n in g:
                acc = decay * e[r][n] + (g[n].float() - local[n]).double()
                m[n] = ref_compress(acc, 16, 4, 2)
                e[r][n] = acc - m[n]
            msgs.append(m)
        g = {n: g[n] - lr * (msgs[0][n] + msgs[1][n]) / 2 for n in g}
        got = named_params(dumped(out, 0, k + 1))
        # the outer loop's rounding (reference_tol), plus the accumulator's three roundings per
        # round; a quantisation level or top-k choice flipped by rounding would move an entry by
        # a whole step, far past this bound: the test would fail loudly, not drift
        bounds = reference_tol(named_params(dumped(out, 0, 0)), (k + 1) * 2, 2)
        for n, t in got.items():
            torch.testing.assert_close(t.double(), g[n], **bounds)
            if k == 0:  # sparse: at most k=4 of every 16 entries moved per replica
                changed = int((t.double() != named_params(dumped(out, 0, 0))[n].double()).sum())
                assert changed <= 2 * 4 * math.ceil(t.numel() / 16)


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(8, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


@pytest.mark.slow
def test_streaming_fragments_through_the_outer_loop(tmp_path):
    """The real outer loop with P = 2 strided fragments over a one-replica sparseloco exchange:
    each fragment's tensors get their own accumulators, and every committed round moves at most
    k entries per chunk of the fragment it synced."""
    from composer_replication.diloco import make_diloco_outer_loop
    from composer_replication.exchange import (
        AllReduceConfig,
        ObjectStoreAllReduce,
        ObjectStoreManager,
    )

    spec = SparseSpec(density=0.1, chunk=64, bits=2)
    model = _Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    store = ObjectStoreAllReduce(
        str(tmp_path), 1, 0, config=AllReduceConfig(codec="sparseloco", sparse=spec)
    )
    ef = ErrorFeedbackManager(ObjectStoreManager(store), spec, decay=0.9, num_fragments=2)
    outer = make_diloco_outer_loop(
        opt,
        ef,
        4,
        model=model,
        num_fragments=2,
        outer=sparseloco_outer_optimizer(1.0),
    )
    x, y = torch.randn(16, 8), torch.randn(16, 32)
    before = outer.global_parameters()
    moved = []
    with outer:
        for _ in range(16):  # a fragment syncs every 2 steps: 8 rounds
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            after = outer.global_parameters()
            changed = {n for n in after if not torch.equal(after[n], before[n])}
            if changed:
                moved.append({n.split(".", 1)[0] for n in changed})
                for n in changed:
                    nz = int((after[n] != before[n]).sum())
                    assert nz <= spec.k * math.ceil(after[n].numel() / spec.chunk), n
            before = after
    assert outer.round == 8
    assert moved and all(len(frags) == 1 for frags in moved)  # one fragment per round
    assert {f for frags in moved for f in frags} == {"f0", "f1"}
    assert {frag for frag, _ in ef.buffers} == {0, 1}
    sizes = sorted(e.numel() for e in ef.buffers.values())
    assert sizes == sorted(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_benchmark_smoke_prints_the_keys(tmp_path):
    """benchmarks/sparseloco.py --quick: both variants train, the bytes are measured, and the
    last line is the JSON the docs quote (tiny settings; the figures are not judged here)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(root / "benchmarks" / "sparseloco.py"), "--quick"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < result["sparseloco_bytes_ratio"] < 0.1  # headers weigh more on a tiny model
    assert math.isfinite(result["sparseloco_loss_gap_vs_diloco"])
    assert result["rounds"] == 3 and result["diloco_bytes_per_round"] > 0
    assert 0 < result["sparseloco_upload_ratio"] < 0.1


@pytest.mark.slow
def test_train_with_sparseloco_end_to_end(tmp_path, monkeypatch, capsys):
    """`composer-replication train diloco.codec=sparseloco`: 2 local replicas finish, every
    round commits, and what each replica uploads is a fraction of its fp32 pseudo-gradient."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    from composer_replication.cli import main
    from composer_replication.run.metrics import read_metrics

    small = [
        "model.hidden_size=32",
        "model.num_layers=1",
        "task.n_train=32",
        "task.n_eval=8",
        "train.eval_max_examples=8",
        "train.batch_size=8",
        "train.num_generations=4",
        "train.max_completion_length=4",
        "logging.flush_every_s=0.2",
    ]
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            *small,
            "train.max_steps=4",
            "diloco.sync_every_h=2",
            "diloco.codec=sparseloco",
            "diloco.sparseloco_chunk=256",
            "--name",
            "sl",
        ]
    )
    run = tmp_path / "runs" / "sl"
    out = capsys.readouterr().out
    assert code == 0, out + "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    rounds = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "round"]
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    for rank in (0, 1):
        mine = [r for r in rounds if r["replica"] == rank]
        assert [r["round"] for r in mine] == [1, 2] and all(r["round/committed"] for r in mine)
        assert all(0 < r["round/bytes_up"] < 0.5 * fp32_bytes for r in mine)
