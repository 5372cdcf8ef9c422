"""The real loss probe of `diloco.screen = "loss"` (assembly/screening.py) refuses a harmful
contribution sent through the real exchange and accepts honest ones (issue 23).

Four replicas (threads, each with its own ObjectStoreAllReduce and its own copy of the tiny model
for its probe, as separate processes would have) exchange DiLoCo pseudo-gradients of the
embedded default's tiny model (partly trained: the global model of a run under way) over a
file:// store, with the run's own screening policy (`screening.aggregate_policy`) and probe
(`screening.loss_probe`). Replicas 0-2 send honest pseudo-gradients (global - local after a few
supervised steps on different training prompts' oracle answers); replica 3 sends one of them
sign-flipped and scaled x3, a direction that undoes learning and raises the loss. The probe's numbers are checked against a reference computed here independently (the
mean token NLL of the reference answers under `global - outer_lr * candidate`), and the merged
result against the float64 mean of the honest contributions.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_replication.assembly import screening
from composer_replication.assembly.build import build_model, build_task
from composer_replication.config import load_config
from composer_replication.exchange.allreduce import ObjectStoreAllReduce
from composer_replication.exchange.protocol import commit_key
from composer_replication.exchange.settings import AllReduceConfig
from composer_replication.exchange.store import ObjectStore

N = 4


@pytest.fixture(autouse=True)
def one_torch_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread, as a replica runs (`train.torch_threads`): on a shared machine two
    spinning threads per process make this test 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _chat_ids(tok: Any, prompt: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _sft(model: Any, tok: Any, task: Any, examples: list[Any], steps: int, lr: float) -> None:
    """A few AdamW steps on the oracle answers of `examples` (one padded batch, loss on the
    answer tokens)."""
    rows = [
        (
            _chat_ids(tok, ex.prompt),
            list(tok(task.oracle(ex), add_special_tokens=False)["input_ids"]),
        )
        for ex in examples
    ]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (prompt, answer) in enumerate(rows):
        seq = torch.tensor(prompt + answer)
        ids[i, : len(seq)], mask[i, : len(seq)] = seq, 1
        labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def reference_loss(
    model: Any, tok: Any, task: Any, weights: dict[str, torch.Tensor], examples: list[Any]
) -> float:
    """Mean NLL per answer token of the reference answers, the model holding `weights`."""
    m = copy.deepcopy(model)
    m.load_state_dict({**m.state_dict(), **weights})
    m.eval()
    nll, count = 0.0, 0
    for ex in examples:
        prompt = _chat_ids(tok, ex.prompt)
        answer = list(tok(task.oracle(ex), add_special_tokens=False)["input_ids"])
        logp = torch.log_softmax(m(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
        for j, token in enumerate(answer):
            nll -= float(logp[len(prompt) - 1 + j, token])
        count += len(answer)
    return nll / count


@pytest.mark.slow
def test_the_real_loss_probe_refuses_a_harmful_contribution_through_the_exchange(
    tmp_path: Path,
) -> None:
    config = load_config(
        overrides=[
            "diloco.screen=loss",
            f"backend.n_replicas={N}",
            f"diloco.min_replicas={N - 1}",
            "diloco.screen_examples=32",
        ]
    )
    task = build_task(config)
    model, tok = build_model(config)
    train = task.train_examples()
    _sft(model, tok, task, train[-128:], steps=30, lr=3e-3)  # the global model: partly trained
    names = [n for n, _ in model.named_parameters()]
    global_w = {n: p.detach().clone() for n, p in model.named_parameters()}
    honest = []
    for r in range(N - 1):  # each honest replica learns from its own 64 training prompts
        local = copy.deepcopy(model)
        _sft(local, tok, task, train[64 * r : 64 * (r + 1)], steps=5, lr=1e-3)
        local_w = dict(local.named_parameters())
        honest.append(
            {f"p{i:06d}": (global_w[n] - local_w[n].detach()).clone() for i, n in enumerate(names)}
        )
    harmful = {k: -3.0 * v for k, v in honest[0].items()}
    payloads = [*honest, harmful]

    # The probe against the independent reference: global - outer_lr * candidate.
    lr = config.diloco.outer.outer_lr
    probe_examples = task.eval_examples()[: config.diloco.exchange.screen_examples]
    flat = {f"f0.{n}": t for n, t in global_w.items()}
    probe = screening.loss_probe(config, lambda: flat, copy.deepcopy(model), tok, task)
    assert probe is not None

    def moved(candidate: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: global_w[n] - lr * candidate[f"p{i:06d}"] for i, n in enumerate(names)}

    base = reference_loss(model, tok, task, global_w, probe_examples)
    zeros = {k: torch.zeros_like(v) for k, v in harmful.items()}
    assert probe(zeros) == pytest.approx(base, rel=1e-5)
    losses = [reference_loss(model, tok, task, moved(p), probe_examples) for p in payloads]
    for p, want in zip(payloads, losses, strict=True):
        assert probe(p) == pytest.approx(want, rel=1e-5)
    tolerance = config.diloco.exchange.screen_loss_tolerance
    # honest: within the screen's tolerance (one may nudge these prompts' loss up a little,
    # the three together lower it); harmful: well above it
    assert all(loss <= (1 + tolerance) * base for loss in losses[:-1]), (base, losses)
    assert sum(losses[:-1]) / 3 < base, (base, losses)
    assert losses[-1] > (1 + 2 * tolerance) * base, (base, losses)

    # Through the real exchange, with the run's policy and each replica's own probe.
    policy = screening.aggregate_policy(config, task, tok)
    uri = str(tmp_path / "store")
    out: dict[int, Any] = {}

    def replica(r: int) -> None:
        own = screening.loss_probe(config, lambda: flat, copy.deepcopy(model), tok, task)
        ar = ObjectStoreAllReduce(
            uri,
            N,
            r,
            config=AllReduceConfig(
                timeout_s=120, poll_interval_s=0.01, min_replicas=N - 1, aggregate=policy
            ),
            loss_probe=own,
        )
        try:
            out[r] = (ar.allreduce(payloads[r], step=1), ar.last_result)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out[r] = (e, ar.last_result)
        finally:
            ar.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    mean = {k: sum(h[k].double() for h in honest).div(len(honest)).float() for k in harmful}
    for r in range(N):
        result, summary = out[r]
        assert not isinstance(result, Exception), result
        for k in mean:  # the honest mean, bit-identical on every replica
            torch.testing.assert_close(result[k], mean[k], atol=1e-6, rtol=1e-5)
            assert torch.equal(result[k], out[0][0][k])
        assert list(summary.rejected) == [3] and "harmful" in summary.rejected[3]
    commit = ObjectStore(uri).get_json(commit_key(1))
    assert commit["included_ranks"] == [0, 1, 2]
    decisions = commit["decisions"]
    assert [decisions[str(r)]["included"] for r in range(N)] == [True, True, True, False]
    for r in range(N):  # the recorded loss change is the probe's, i.e. the reference's
        assert decisions[str(r)]["loss_delta"] == pytest.approx(losses[r] - base, rel=1e-4)
