"""DiLoCo outer loop in one process: sign convention, outer state, fragments, resume, codecs.

Replicas run as threads over a real ``file://`` exchange (tests/diloco/_diloco_threads.py); the
multi-process versions are in test_diloco_multiprocess.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tolerances import tol
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from _diloco_reference import (  # noqa: E402
    adam_reference_tol,
    local_after,
    named_params,
    reference_rounds,
    reference_rounds_adam,
    reference_tol,
)
from _diloco_threads import run_replicas  # noqa: E402
from _diloco_worker import batch, build_model  # noqa: E402

from composer_replication.diloco import make_diloco_outer_loop  # noqa: E402
from composer_replication.diloco.fragments import strided_fragments  # noqa: E402
from composer_replication.diloco.outer_loop import OuterOptimizerConfig, StreamingOptions  # noqa: E402
from composer_replication.exchange import (  # noqa: E402
    AllReduceConfig,
    ObjectStoreAllReduce,
    ObjectStoreManager,
)
from composer_replication.exchange.outer_state import decode_state, encode_state  # noqa: E402


def _uri(tmp_path: Path) -> str:
    return "file://" + str(tmp_path / "run")


def test_sign_convention_lr1_no_momentum_gives_average_of_local_weights(tmp_path: Path) -> None:
    """global - mean(global - local) == mean(local): outer SGD lr=1, no momentum is local SGD.

    With the pseudo-gradient flipped (local - global) the result would be 2*global - mean(local),
    far from the average; the check is to fp32 rounding (a 2-term mean of weights: n = 3).
    """
    res = run_replicas(
        _uri(tmp_path),
        2,
        rounds=1,
        h=3,
        outer_kw=dict(
            outer=OuterOptimizerConfig(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
        ),
    )
    init = named_params(res[0]["globals"][0])
    locals_ = [local_after(init, r, 0, 3) for r in range(2)]
    for r in range(2):
        got = named_params(res[r]["globals"][1])
        for name, t in got.items():
            avg = (locals_[0][name] + locals_[1][name]) / 2
            # global - mean(global - local): the subtraction, the 2-term mean, the update
            bounds = tol(4, float(init[name].abs().max()))
            torch.testing.assert_close(t, avg, **bounds)
            # and "did nothing" (t = init) would fail that bound: the check can tell them apart
            assert not torch.allclose(avg, init[name], rtol=bounds["rtol"], atol=bounds["atol"])


def test_threads_match_nesterov_reference_every_round(tmp_path: Path) -> None:
    """3 replicas, 3 rounds, Nesterov lr 0.7 / mu 0.9: bit-identical and equal to the reference."""
    res = run_replicas(_uri(tmp_path), 3, rounds=3, h=4)
    init = named_params(res[0]["globals"][0])
    ref = reference_rounds(
        init, ranks_per_round=[[0, 1, 2]] * 3, h=4, lr=0.7, momentum=0.9, nesterov=True
    )
    for k in range(4):
        for r in (1, 2):
            a, b = res[0]["globals"][k], res[r]["globals"][k]
            assert all(torch.equal(a[n], b[n]) for n in a), f"round {k}: rank {r} differs"
    for k in range(1, 4):
        got = named_params(res[0]["globals"][k])
        for name in got:
            torch.testing.assert_close(got[name], ref[k - 1][name], **reference_tol(init, k, 3))
    assert [h["included_ranks"] for h in res[0]["outer"].history] == [[0, 1, 2]] * 3


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_outer_optimizer_choices_match_hand_written_references(tmp_path: Path, name: str) -> None:
    """`[diloco] outer_optimizer` 'sgd' (heavy-ball) and 'adam' through the real exchange, 3
    rounds of 2 replicas, against the update rules written out by hand."""
    kw: dict[str, object] = (
        {"outer_lr": 0.5, "outer_momentum": 0.8}
        if name == "sgd"
        else {"outer_lr": 0.05, "outer_betas": [0.9, 0.99]}
    )
    res = run_replicas(
        _uri(tmp_path),
        2,
        rounds=3,
        h=3,
        outer_kw={"outer": OuterOptimizerConfig(outer_optimizer=name, **kw)},
    )
    init = named_params(res[0]["globals"][0])
    rounds = [[0, 1]] * 3
    if name == "sgd":
        ref = reference_rounds(
            init, ranks_per_round=rounds, h=3, lr=0.5, momentum=0.8, nesterov=False
        )
    else:
        ref = reference_rounds_adam(
            init, ranks_per_round=rounds, h=3, lr=0.05, betas=(0.9, 0.99), eps=1e-8
        )
    for k in range(1, 4):
        got = named_params(res[0]["globals"][k])
        bounds = (
            reference_tol(init, k, 2)
            if name == "sgd"
            else adam_reference_tol(init, k, 2, h=3, lr=0.05)
        )
        for n in got:
            torch.testing.assert_close(got[n], ref[k - 1][n], **bounds)
            assert torch.equal(got[n], named_params(res[1]["globals"][k])[n])


def test_outer_optimizer_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="'lamb' is not one of"):
        OuterOptimizerConfig(outer_optimizer="lamb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outer_momentum: 0 with outer_optimizer = 'nesterov'"):
        OuterOptimizerConfig(outer_momentum=0.0)
    p = [nn.Parameter(torch.zeros(2))]
    opt = OuterOptimizerConfig().build_outer_optimizer()(p)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"] is True
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.7, 0.9)


def test_initial_weights_come_from_the_store(tmp_path: Path) -> None:
    """Replicas built with different seeds start from one published round-0 state."""
    res = run_replicas(_uri(tmp_path), 2, rounds=0, h=2)
    a, b = res[0]["globals"][0], res[1]["globals"][0]
    assert all(torch.equal(a[n], b[n]) for n in a)
    m0, m1 = res[0]["model"], res[1]["model"]
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)


def test_whole_run_restart_resumes_exactly(tmp_path: Path) -> None:
    """2 rounds, stop everything, start fresh processes' worth of objects, 2 more == 4 straight."""

    # Same initial weights on every rank: which rank publishes round 0 is a race.
    def same(r: int) -> nn.Module:
        return build_model(7)

    straight = run_replicas(_uri(tmp_path / "a"), 2, rounds=4, h=3, model_fn=same)
    run_replicas(_uri(tmp_path / "b"), 2, rounds=2, h=3, model_fn=same)
    resumed = run_replicas(_uri(tmp_path / "b"), 2, rounds=4, h=3, model_fn=same)
    assert min(resumed[0]["globals"]) == 2  # it started at round 2, not 0
    for r in range(2):
        a, b = straight[r]["globals"][4], resumed[r]["globals"][4]
        assert all(torch.equal(a[n], b[n]) for n in a), "resume is not exact"


def test_outer_state_encoding_roundtrip_with_momentum() -> None:
    p = nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    p.grad = torch.randn(3, 2)
    opt.step()
    state = {"frag": {"outer_optimizer": opt.state_dict(), "original_parameters": {"w": p.data}}}
    tensors, skeleton = encode_state(state)
    back = decode_state(tensors, skeleton)
    q = nn.Parameter(p.detach().clone())
    opt2 = torch.optim.SGD([q], lr=0.1, momentum=0.5)
    opt2.load_state_dict(back["frag"]["outer_optimizer"])
    assert opt2.param_groups[0]["lr"] == 0.7 and opt2.param_groups[0]["nesterov"] is True
    assert torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    with pytest.raises(ValueError, match="cannot store"):
        encode_state({"x": object()})
    with pytest.raises(ValueError, match="malformed"):
        decode_state({}, {"z": 1})


def test_strided_fragments_assign_every_parameter_once() -> None:
    from composer_replication.models import build_tiny_model, build_tokenizer

    model = build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=4, seed=0)
    frags = strided_fragments(model, 2)
    names = [frag.names for frag in frags]
    all_ids = [id(p) for f in frags for p in f.parameters()]
    assert len(all_ids) == len(set(all_ids)) == len({id(p) for p in model.parameters()})
    assert any(".layers.0." in n for n in names[0]) and any(".layers.2." in n for n in names[0])
    assert any(".layers.1." in n for n in names[1]) and any(".layers.3." in n for n in names[1])
    assert not any(".layers.1." in n for n in names[0])
    assert any("embed_tokens" in n for n in names[0])
    assert any(n.endswith("model.norm.weight") for n in names[1])
    with pytest.raises(ValueError, match="exceeds"):
        strided_fragments(model, 5)


def test_overlapped_exchange_stays_identical(tmp_path: Path) -> None:
    """tau=1: the exchange runs in the background during an inner step; still bit-identical."""

    def frags_model(rank: int) -> nn.Module:
        return build_model(100 + rank)

    res = run_replicas(
        _uri(tmp_path),
        2,
        rounds=4,
        h=4,
        model_fn=frags_model,
        outer_kw=dict(num_fragments=1, streaming=StreamingOptions(fragment_sync_delay=1)),
    )
    for k in range(5):
        a, b = res[0]["globals"][k], res[1]["globals"][k]
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_streaming_two_fragments_sync_alternately(tmp_path: Path) -> None:
    store_uri = _uri(tmp_path)
    results = {}

    def one(rank: int) -> None:
        model = build_model(100 + rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        store = ObjectStoreAllReduce(
            store_uri, world_size=2, rank=rank, config=AllReduceConfig(poll_interval_s=0.01)
        )
        outer = make_diloco_outer_loop(
            opt,
            ObjectStoreManager(store),
            4,
            model_fragments=[model[0], model[2]],
            streaming=StreamingOptions(fragment_sync_delay=1),
        )
        with outer:
            for t in range(16):
                x, y = batch(rank, t)
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        outer.load_global_weights()
        results[rank] = (outer, [p.detach().clone() for p in model.parameters()])

    import threading

    ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert set(results) == {0, 1}
    assert results[0][0].round == 8  # 16 steps / (H/P = 2) = 8 fragment syncs
    for p, q in zip(results[0][1], results[1][1]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("codec,tol", [("int8", 0.01), ("4bit", 0.05)])
def test_compressed_codecs_still_converge(tmp_path: Path, codec: str, tol: float) -> None:
    """int8 / 4-bit pseudo-gradients: final loss at most `tol` (relative) above fp32's.

    Measured (8 rounds, H=5): fp32 0.14823, int8 0.14825, 4-bit 0.14826 (start 0.670).
    """

    def eval_loss(model: nn.Module) -> float:
        with torch.no_grad():
            xs, ys = zip(*(batch(r, 10_000 + i) for r in range(2) for i in range(8)))
            return float(((model(torch.cat(xs)) - torch.cat(ys)) ** 2).mean())

    def final_loss(c: str) -> float:
        res = run_replicas(
            _uri(tmp_path / c),
            2,
            rounds=8,
            h=5,
            store_kw={"codec": c},
            model_fn=lambda r: build_model(100),  # same init: round 0's publisher is a race
        )
        model = build_model(0)
        model.load_state_dict(named_params(res[0]["globals"][8]))
        return eval_loss(model)

    start = build_model(100)
    base, got = final_loss("fp32"), final_loss(codec)
    assert base < 0.7 * eval_loss(start), "fp32 DiLoCo did not learn"
    assert (got - base) / base < tol, f"{codec}: {got:.4f} vs fp32 {base:.4f}"


def test_argument_validation() -> None:
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class M:
        _use_async_quorum = False

    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        make_diloco_outer_loop(opt, M(), 5, model_fragments=[model[0], model[2]])
    with pytest.raises(ValueError, match="outer_momentum: 0 with outer_optimizer = 'nesterov'"):
        make_diloco_outer_loop(opt, M(), 4, outer=OuterOptimizerConfig(outer_momentum=0.0))
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        make_diloco_outer_loop(opt, M(), 4, streaming=StreamingOptions(fragment_sync_delay=4))
    with pytest.raises(ValueError, match="sync_every_h"):
        make_diloco_outer_loop(opt, M(), 0)

    class Async:  # the one attribute TorchFTManager reads of an asynchronous torchft Manager
        _use_async_quorum = True

    from composer_replication.diloco.torchft.torchft_path import TorchFTManager

    with pytest.raises(ValueError, match="use_async_quorum=False"):
        TorchFTManager(Async())  # type: ignore[arg-type]
    outer = make_diloco_outer_loop(None, M(), 4)
    with pytest.raises(ValueError, match="no inner optimizer yet"):
        outer.__enter__()


def test_torchft_timeouts_must_be_ordered() -> None:
    from composer_replication.diloco.torchft.torchft_path import TorchFTTimeouts

    TorchFTTimeouts()  # the defaults are ordered
    with pytest.raises(ValueError, match="join_s < quorum_s"):
        TorchFTTimeouts(process_group_s=10, operation_s=20, join_s=60, quorum_s=30)
    with pytest.raises(ValueError, match="process_group_s <= operation_s"):
        TorchFTTimeouts(process_group_s=90, operation_s=20, join_s=60, quorum_s=300)
    with pytest.raises(ValueError, match="locks healing replicas out"):
        TorchFTTimeouts(process_group_s=10, operation_s=120, join_s=60, quorum_s=300)
    with pytest.raises(ValueError, match="heartbeat_s"):
        TorchFTTimeouts(heartbeat_s=400)
