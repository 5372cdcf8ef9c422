"""Channel 3: DPO vs TRL's DPOTrainer sigmoid loss, SimPO vs TRL's CPO simpo, reference vectors."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch
from _loss_tolerance import bound

from composer_replication.loss import dpo_loss, simpo_loss

# A pair's loss: its log-prob sums (<= seq terms), four differences, times beta, a log-sigmoid
# (a few operations; derivative <= 1): ~10 rounded operations on values of magnitude ``z`` =
# beta * (|chosen| + |ref chosen| + |rejected| + |ref rejected|); a gradient entry is beta *
# sigmoid / pairs, moved by its argument's error (<= z bound / 4) and its own few roundings.
PREF_OPS = 10
REF_DIGITS = 5e-11  # reference vectors printed to 10 decimals (loss.md)


def _pref_tols(z: float, beta: float, pairs: int, n: int) -> tuple[float, float]:
    value = bound(torch.float32, n=n, ops=PREF_OPS, scale=z)
    grad = bound(torch.float32, n=n, ops=PREF_OPS, scale=beta * (z / 4 + 1) / pairs)
    return value, grad


dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")
cpo_trainer = pytest.importorskip("trl.experimental.cpo.cpo_trainer")


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _trl_dpo(per_token_logps, completion_mask, ref_chosen, ref_rejected, beta):
    """TRL 1.16 DPOTrainer._compute_loss (loss_type sigmoid, precomputed reference log-probs),
    run with a stand-in self and a stand-in model whose fused-head output is ``per_token_logps``
    (rows [chosen..., rejected...], zero outside the completion)."""
    n2, seq = per_token_logps.shape

    def model(**kwargs):
        return types.SimpleNamespace(
            log_probs=per_token_logps,
            entropy=torch.zeros(n2, seq),
            mean_logits=torch.zeros(n2, seq),
            is_top1=torch.zeros(n2, seq, dtype=torch.bool),
        )

    stand_in = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        _total_train_tokens=0,
        _tp_size=1,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "input_ids": torch.zeros(n2, seq + 1, dtype=torch.long),
        "attention_mask": torch.ones(n2, seq + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(n2, 1, dtype=torch.long), completion_mask], 1),
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = dpo_trainer.DPOTrainer._compute_loss(stand_in, model, inputs, return_outputs=False)
    return loss, stand_in._metrics["train"]


@pytest.mark.parametrize("pairs, seq, beta", [(1, 4, 0.1), (3, 6, 0.1), (5, 3, 0.5), (4, 8, 0.05)])
def test_dpo_matches_trl_sigmoid(pairs, seq, beta):
    g = torch.Generator().manual_seed(pairs * 10 + seq)
    mask = (torch.rand(2 * pairs, seq, generator=g) > 0.3).long()
    mask[:, 0] = 1
    per_token = (-torch.rand(2 * pairs, seq, generator=g) * 4 * mask).requires_grad_(True)
    ref_c = -torch.rand(pairs, generator=g) * 4 * seq
    ref_r = -torch.rand(pairs, generator=g) * 4 * seq
    theirs, trl_metrics = _trl_dpo(per_token, mask, ref_c, ref_r, beta)
    (g_theirs,) = torch.autograd.grad(theirs, per_token)
    logps = per_token.sum(1)
    ours, metrics = dpo_loss(logps[:pairs], logps[pairs:], ref_c, ref_r, beta=beta)
    (g_ours,) = torch.autograd.grad(ours, per_token)
    sums = logps.detach().abs()
    z = beta * float((sums[:pairs] + ref_c.abs() + sums[pairs:] + ref_r.abs()).max())
    value_tol, grad_tol = _pref_tols(z, beta, pairs, n=seq)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=value_tol)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=grad_tol)
    # rewards beta * (sum - ref sum), averaged over pairs: the same budget on z
    assert metrics["dpo/chosen_reward"] == pytest.approx(
        trl_metrics["rewards/chosen"][0], abs=value_tol
    )
    assert metrics["dpo/rejected_reward"] == pytest.approx(
        trl_metrics["rewards/rejected"][0], abs=value_tol
    )
    assert metrics["dpo/margin"] == pytest.approx(trl_metrics["rewards/margins"][0], abs=value_tol)
    assert metrics["dpo/accuracy"] == trl_metrics["rewards/accuracies"][0]  # a count / pairs


def test_dpo_reference_vector():
    loss, m = dpo_loss(
        torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0])
    )
    # float32 on values <= 12 * 0.1 = 1.2, plus the vector's own 10 printed decimals
    tol = bound(torch.float32, n=1, ops=PREF_OPS, scale=1.2)
    assert float(loss.detach()) == pytest.approx(0.5981388694, abs=REF_DIGITS + tol)
    assert m["dpo/margin"] == pytest.approx(0.2, abs=tol) and m["dpo/accuracy"] == 1.0


def test_dpo_label_smoothing_is_conservative_dpo():
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-4.0, -3.0])
    z = 0.1 * ((c - rc) - (r - rr))
    expected = (
        -(0.8) * torch.nn.functional.logsigmoid(z) - 0.2 * torch.nn.functional.logsigmoid(-z)
    ).mean()
    loss, _ = dpo_loss(c, r, rc, rr, label_smoothing=0.2)
    z = 0.1 * float((c.abs() + rc.abs() + r.abs() + rr.abs()).max())  # two log-sigmoids: twice
    assert float(loss.detach()) == pytest.approx(
        float(expected), abs=2 * _pref_tols(z, 0.1, 2, 1)[0]
    )


def _trl_cpo_simpo(chosen, rejected, beta, gamma, label_smoothing):
    stand_in = types.SimpleNamespace(
        alpha=0.0,
        accelerator=_Accelerator(),
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    return cpo_trainer.CPOTrainer.cpo_loss(stand_in, chosen, rejected)


@pytest.mark.parametrize(
    "pairs, beta, gamma, ls",
    [(1, 2.0, 1.0, 0.0), (4, 2.0, 0.5, 0.0), (6, 2.5, 1.4, 0.1), (3, 1.0, 0.0, 0.3)],
)
def test_simpo_matches_trl_cpo_simpo(pairs, beta, gamma, ls):
    g = torch.Generator().manual_seed(pairs)
    chosen = (-torch.rand(pairs, generator=g) * 3).requires_grad_(True)
    rejected = (-torch.rand(pairs, generator=g) * 3).requires_grad_(True)
    losses, c_rew, r_rew = _trl_cpo_simpo(chosen, rejected, beta, gamma, ls)
    theirs = losses.mean()  # CPO with cpo_alpha=0: no NLL term, mean over pairs
    g_theirs = torch.autograd.grad(theirs, (chosen, rejected))
    ours, m = simpo_loss(chosen, rejected, beta=beta, gamma=gamma, label_smoothing=ls)
    g_ours = torch.autograd.grad(ours, (chosen, rejected))
    # z = beta * (|chosen| + |rejected|) + gamma; label smoothing mixes two log-sigmoids
    z = beta * float((chosen.detach().abs() + rejected.detach().abs()).max()) + gamma
    value_tol, grad_tol = _pref_tols(z, beta, pairs, n=pairs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2 * value_tol)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * grad_tol)
    assert m["simpo/chosen_reward"] == pytest.approx(float(c_rew.mean()), abs=value_tol)
    assert m["simpo/rejected_reward"] == pytest.approx(float(r_rew.mean()), abs=value_tol)


def test_simpo_reference_vector_gamma_is_absolute_margin():
    loss, _ = simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, gamma=1.0)
    tol = bound(torch.float32, n=1, ops=PREF_OPS, scale=3.0)  # z = 2 * 1.5, gamma 1
    assert float(loss.detach()) == pytest.approx(0.6931471806, abs=REF_DIGITS + tol)  # z = 0


def test_simpo_needs_no_reference_and_is_differentiable():
    import inspect

    params = inspect.signature(simpo_loss).parameters
    assert not any("ref" in name for name in params)
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-1.2, -1.9], requires_grad=True)
    loss, _ = simpo_loss(chosen, rejected)
    loss.backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert bool((chosen.grad < 0).all()) and bool((rejected.grad > 0).all())
    torch.autograd.gradcheck(
        lambda c, r: simpo_loss(c, r, beta=2.0, gamma=0.7, label_smoothing=0.1)[0],
        (chosen.detach().double().requires_grad_(), rejected.detach().double().requires_grad_()),
    )


def test_dpo_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    c, r, rc, rr = (torch.randn(3, generator=g, dtype=torch.float64) for _ in range(4))
    torch.autograd.gradcheck(
        lambda a, b: dpo_loss(a, b, rc, rr, beta=0.3, label_smoothing=0.1)[0],
        (c.requires_grad_(), r.requires_grad_()),
    )


def test_empty_pairs_zero_loss_with_metric():
    empty = torch.zeros(0, requires_grad=True)
    loss, m = dpo_loss(empty, empty, torch.zeros(0), torch.zeros(0))
    loss.backward()
    assert float(loss.detach()) == 0.0 and m["dpo/empty"] == 1.0 and m["dpo/pairs"] == 0.0
    loss, m = simpo_loss(empty, empty)
    assert float(loss.detach()) == 0.0 and m["simpo/empty"] == 1.0


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x: dpo_loss(x, x, x, x, beta=0.0), "beta"),
        (lambda x: dpo_loss(x, x, x, x, label_smoothing=0.5), "label_smoothing"),
        (lambda x: dpo_loss(x, x[:1], x, x), "rejected_logps"),
        (lambda x: dpo_loss(x, x, x.view(2, 1), x), "ref_chosen_logps"),
        (lambda x: simpo_loss(x, x, beta=-1.0), "beta"),
        (lambda x: simpo_loss(x, x, gamma=-0.5), "gamma"),
        (lambda x: simpo_loss(x, torch.tensor([0.0, float("nan")])), "rejected_avg_logps"),
        (lambda x: dpo_loss(x, x, torch.tensor([float("inf"), 0.0]), x), "ref_chosen_logps"),
    ],
)
def test_preference_bad_input_raises(call, name):
    with pytest.raises(ValueError, match=name):
        call(torch.tensor([-1.0, -2.0]))
