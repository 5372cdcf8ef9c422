"""Channel 3 fused with the output layer: ``fused_linear_logps`` and ``fused_replay_term``.

References, independent of the fused code: ``F.log_softmax`` of the materialised logits
``h @ W.T + b`` in float64 (the exact value of the same inputs, up to float64 rounding), and the
current path, ``selective_log_softmax`` / ``replay_term`` on those logits in the inputs' dtype,
with autograd through the matmul for the hidden-state, weight and bias gradients.

Tolerances (tests/tolerances.py: two computations of an n-term chain differ by at most
``2 gamma(n) * scale``): a log-prob ``z_y / tau - logsumexp(z / tau)`` is an H-term dot product
plus the bias (its magnitude at most ``Z = max sum_k |h_k w_k| + |b|``), a V-term sum of
exponentials (a relative error, i.e. an absolute error of its log) and a subtraction: n = H + V +
4 over the scale ``2 Z / tau + 1``. A gradient entry sums V (hidden: ``dz @ W``) or N (weight:
``dz^T @ h``) terms of the logits' gradient ``g (onehot - p) / tau``, whose p carries the
log-prob's error: n = H + 2V + N + 8 over ``sum |g| (onehot + p) |W|`` (resp. ``|h|``) times
``2 Z / tau + 3``. In bfloat16 the current path rounds every logit to 8 significant bits
(``UBF16 |z|`` each) where the fused path keeps float32 logits from the bf16 operands (products
exact): a log-prob moves by at most ``UBF16 (|z_y| + max |z|)`` (n = 2 over ``Z``); a gradient
entry by the probabilities' relative error ``2 UBF16 Z`` plus the logits-gradient tile's and the
result's bf16 rounding (``UBF16`` each): n = 2 Z + 4 over ``sum |g| (onehot + p) |W|`` (resp.
``|h|``); against float64 on the same bf16 values only those two roundings remain (n = 3).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_loss_batch_format import _explicit_form, _rollout_form
from tolerances import U32, U64, UBF16, assert_close

from composer_replication.loss import (
    fused_linear_logps,
    fused_replay_term,
    replay_term,
    selective_log_softmax,
)

B, T, H, V = 2, 5, 16, 257  # V odd: vocabulary chunks of 64 leave a ragged last chunk
UNIT = {torch.float64: U64, torch.float32: U32, torch.bfloat16: UBF16}


def _inputs(seed, dtype, *, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4).to(dtype).requires_grad_(True)
    b = None
    if bias:
        b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    upstream = torch.randn(B, T, generator=g, dtype=torch.float64)  # d loss / d logp
    return h, w, b, ids, mask, upstream


def _params(h, w, b):
    return [x for x in (h, w, b) if x is not None]


def _fused(h, w, b, ids, mask, upstream, **kw):
    out = fused_linear_logps(h, w, b, ids, mask=mask, **kw)
    grads = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), _params(h, w, b))
    return out.detach(), grads


def _current(h, w, b, ids, mask, upstream, temperature=1.0):
    """The current path: logits materialised in the inputs' dtype, ``selective_log_softmax``."""
    logits = h @ w.t() + (b if b is not None else 0.0)
    out = selective_log_softmax(logits, ids, temperature) * mask
    grads = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), _params(h, w, b))
    return out.detach(), grads


def _exact(h, w, b, ids, mask, upstream, temperature=1.0):
    """``F.log_softmax`` of float64 logits of the same values: the reference."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    logits = (h64 @ w64.t() + (b64 if b64 is not None else 0.0)) / temperature
    out = F.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] * mask
    grads = torch.autograd.grad((out * upstream).sum(), _params(h64, w64, b64))
    return out.detach(), grads, logits.detach() * temperature


def _float_bounds(h, w, b, ids, mask, logits, upstream, temperature):
    """``(n, scale)`` of the value, hidden-, weight- and bias-gradient comparisons (module doc)."""
    mag = h.detach().double().abs() @ w.detach().double().abs().t()
    if b is not None:
        mag = mag + b.detach().double().abs()
    Z = float(mag[mask].max()) / temperature
    p = torch.softmax(logits / temperature, -1)
    onehot = F.one_hot(ids, V).to(p.dtype)
    # |g| (onehot + p) / tau: the magnitude of each logits-gradient entry's terms
    onehot_p = (onehot + p) * (upstream.abs() * mask)[..., None] / temperature
    wa = w.detach().double().abs()
    ha = h.detach().double().abs().reshape(-1, H)
    rows = onehot_p.reshape(-1, V)
    N = int(mask.sum())
    grad_factor = 2 * Z + 3
    return {
        "value": (H + V + 4, 2 * Z + 1),
        "hidden": (H + 2 * V + N + 8, float((rows @ wa).max()) * grad_factor),
        "weight": (H + 2 * V + N + 8, float((rows.t() @ ha).max()) * grad_factor),
        "bias": (H + 2 * V + N + 8, float(rows.sum(0).max()) * grad_factor),
    }


def _check(got, want, bounds, u, names=("hidden", "weight", "bias")):
    (out, grads), (ref, ref_grads) = got, want
    n, scale = bounds["value"]
    assert_close(out.double(), ref.double(), n=n, u=u, scale=scale, what="log-probs")
    for name, a, e in zip(names, grads, ref_grads, strict=False):
        n, scale = bounds[name]
        assert_close(a.double(), e.double(), n=n, u=u, scale=scale, what=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [(None, None), (3, 64)])
def test_fused_logps_match_log_softmax_of_the_logits(dtype, temperature, bias, chunks):
    h, w, b, ids, mask, up = _inputs(1, dtype, bias=bias)
    kw = dict(temperature=temperature, chunk_size=chunks[0], vocab_chunk_size=chunks[1])
    fused = _fused(h, w, b, ids, mask, up, **kw)
    assert fused[0].dtype == dtype and all(g.dtype == dtype for g in fused[1])
    exact, exact_grads, logits = _exact(h, w, b, ids, mask, up, temperature)
    bounds = _float_bounds(h, w, b, ids, mask, logits, up, temperature)
    u = UNIT[dtype]
    _check(fused, (exact, exact_grads), bounds, u)
    # the current path is held to the same bound: the two agree to rounding
    _check(fused, _current(h, w, b, ids, mask, up, temperature), bounds, u)
    assert bool((fused[0][~mask] == 0).all())  # masked positions: 0, no gradient
    assert bool((fused[1][0][~mask] == 0).all())


def test_fused_logps_bfloat16_against_the_bf16_logits_path():
    """bf16 hidden states and weight: against the current path (bf16 logits) within the bf16
    rounding of its logits (module doc); against float64 on the same bf16 values, float32-exact
    log-probs."""
    h, w, b, ids, mask, up = _inputs(4, torch.bfloat16, bias=False)
    fused = _fused(h, w, b, ids, mask, up, chunk_size=3, vocab_chunk_size=64)
    assert fused[0].dtype == torch.float32
    assert fused[1][0].dtype == fused[1][1].dtype == torch.bfloat16
    current = _current(h, w, b, ids, mask, up)
    exact, exact_grads, logits = _exact(h, w, b, ids, mask, up)
    bounds = _float_bounds(h, w, b, ids, mask, logits, up, 1.0)
    Z = float(logits[mask].abs().max())
    assert_close(fused[0].double(), current[0].double(), n=2, u=UBF16, scale=Z, what="log-probs")
    n = math.ceil(2 * Z) + 4
    for name, a, e, ex in (
        ("hidden", fused[1][0], current[1][0], exact_grads[0]),
        ("weight", fused[1][1], current[1][1], exact_grads[1]),
    ):
        scale = bounds[name][1] / (2 * Z + 3)  # sum |g| (onehot + p) |W| (resp. |h|)
        assert_close(a.double(), e.double(), n=n, u=UBF16, scale=scale, what=name)
        # against float64 on the same bf16 values: the tile's and the result's bf16 rounding
        assert_close(a.double(), ex, n=3, u=UBF16, scale=scale, what=name + " vs float64")
    # float32 logits from exact bf16 products: the value is float32-accurate
    assert_close(fused[0].double(), exact, n=bounds["value"][0], scale=bounds["value"][1])
    # while the bf16-logits path is off by its logits' rounding, far beyond float32's bound
    assert float((current[0].double() - exact).abs().max()) > 100 * float(
        (fused[0].double() - exact).abs().max()
    )


def test_fused_logps_gradcheck_float64():
    h, w, b, ids, mask, _ = _inputs(2, torch.float64)
    torch.autograd.gradcheck(
        lambda h_, w_, b_: fused_linear_logps(h_, w_, b_, ids, mask=mask, chunk_size=3),
        (h, w, b),
    )


def test_fused_logps_empty_mask_retain_graph_and_no_create_graph():
    h, w, b, ids, _, up = _inputs(3, torch.float32)
    empty = torch.zeros(B, T, dtype=torch.bool)
    out = fused_linear_logps(h, w, b, ids, mask=empty)
    assert bool((out == 0).all())
    grads = torch.autograd.grad(out.sum(), [h, w, b])
    assert all(bool((g == 0).all()) for g in grads)
    # backward recomputes from saved inputs: a retained graph gives the same gradient twice
    out = fused_linear_logps(h, w, b, ids)
    loss = (out * up.float()).sum()
    g1 = torch.autograd.grad(loss, [h, w], retain_graph=True)
    g2 = torch.autograd.grad(loss, [h, w])
    assert all(torch.equal(a, c) for a, c in zip(g1, g2, strict=True))
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(fused_linear_logps(h, w, b, ids).sum(), [h], create_graph=True)
    with torch.no_grad():
        assert torch.equal(fused_linear_logps(h, w, b, ids), out.detach())


def test_fused_logps_bad_inputs_name_the_argument():
    h, w, b, ids, mask, _ = _inputs(5, torch.float32)
    with pytest.raises(ValueError, match="ids has shape"):
        fused_linear_logps(h, w, b, ids[:, :3])
    with pytest.raises(ValueError, match="weight is"):
        fused_linear_logps(h, w[:, :3], b, ids)
    with pytest.raises(ValueError, match="bias must be"):
        fused_linear_logps(h, w, b[:5], ids)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V=257\)"):
        fused_linear_logps(h, w, b, ids + V)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logps(h, w, b, ids, temperature=0.0)


# --------------------------------------------------------------------- channel 3 on the batch
class _SplitLM(torch.nn.Module):
    """A tiny body with an untied, biased linear head: ``body`` is a `HiddenStateLM`, the
    module itself the `CausalLM` whose logits are ``body(...) @ W.T + b``."""

    def __init__(self, vocab: int = 11, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.head = torch.nn.Linear(hidden, vocab)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=g))
            self.head.bias.copy_(torch.randn(vocab, generator=g) * 0.5)

    def body(self, input_ids, attention_mask, **_):
        h = self.emb[input_ids] * attention_mask.unsqueeze(-1).to(self.emb.dtype)
        csum = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        return torch.tanh(h + csum @ self.mix)

    def forward(self, input_ids, attention_mask, **_):
        class Out:
            logits = self.head(self.body(input_ids, attention_mask))

        return Out()


def _terms(model, inputs, fused_body, weight, bias, **kw):
    """Both channel-3 terms and their gradients for every parameter of ``model``."""
    P = inputs["prompt_ids"].shape[1]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    params = list(model.parameters())
    hidden = fused_body(ids, attn)[:, P - 1 : -1]
    fused = fused_replay_term(fused_body, inputs, hidden, weight, bias, **kw)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1 : -1]
    plain = replay_term(model, inputs, logits, **kw)
    assert fused is not None and plain is not None
    return (
        (fused, torch.autograd.grad(fused[0], params, allow_unused=True)),
        (plain, torch.autograd.grad(plain[0], params, allow_unused=True)),
    )


@pytest.mark.parametrize("form", ["rollout", "explicit"])
@pytest.mark.parametrize(
    "knobs",
    [
        dict(dpo_variant="dpo"),
        dict(dpo_variant="simpo"),
        dict(dpo_variant="dpo", rpo_alpha=1.0, label_smoothing=0.1),
        dict(dpo_variant="simpo", rpo_alpha=0.5),
    ],
    ids=["dpo", "simpo", "dpo_rpo", "simpo_rpo"],
)
def test_fused_replay_term_equals_replay_term(batch, form, knobs):
    model = _SplitLM()
    rollout = _rollout_form(batch)
    inputs = rollout if form == "rollout" else _explicit_form(rollout)
    kw = dict(beta_replay=0.7, **knobs)
    (fused, g_fused), (plain, g_plain) = _terms(
        model, inputs, model.body, model.head.weight, model.head.bias, **kw
    )
    # float32; the terms sum T log-probs (module doc) through the preference loss (derivative
    # <= beta) and the NLL token mean: n = H + V + T + 30 elementary steps over O(Z) values
    head = model.head
    Z = float(head.weight.detach().abs().sum(-1).max() + head.bias.detach().abs().max())
    n = 8 + 11 + 5 + 30
    assert_close(fused[0], plain[0], n=n, scale=4 * (2 * Z + 1), what="loss")
    assert fused[1].keys() == plain[1].keys()
    for key, value in plain[1].items():
        assert_close(fused[1][key], value, n=n, scale=4 * (2 * Z + 1), what=key)
    for a, e in zip(g_fused, g_plain, strict=True):
        assert a is not None and e is not None
        assert_close(a, e, n=n, scale=4 * (2 * Z + 3) * float(e.abs().max()), what="gradient")
    if knobs.get("rpo_alpha"):
        assert "replay/nll" in fused[1]


def test_fused_replay_term_off_and_bad_inputs(batch):
    model = _SplitLM()
    rollout = _rollout_form(batch)
    w = model.head.weight
    assert fused_replay_term(model.body, rollout, torch.zeros(3, 5, 8), w, beta_replay=0.0) is None
    plain = {k: v for k, v in rollout.items() if not k.startswith("replay_")}
    assert fused_replay_term(model.body, plain, torch.zeros(3, 5, 8), w) is None
    with pytest.raises(ValueError, match="needs weight"):
        fused_replay_term(model.body, rollout, torch.zeros(3, 5, 8))
    with pytest.raises(ValueError, match=r"student_hidden must be the \(B, T, H\)"):
        fused_replay_term(model.body, rollout, torch.zeros(3, 5), w)


def test_fused_replay_term_on_a_qwen2(make_batch_fn):
    """A Hugging Face model: the body is ``model.base_model``, the head its tied ``lm_head``
    (the tied embedding gets both gradients)."""
    pytest.importorskip("transformers")
    from composer_replication.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, seed=0)
    vocab = model.config.vocab_size
    batch = make_batch_fn(vocab=vocab, B=3, P=4, T=5, L=9)
    rollout = _rollout_form(batch)
    rollout["replay_chosen_ids"] = rollout["replay_chosen_ids"] % vocab

    def body(input_ids, attention_mask, **kw):
        return model.base_model(input_ids=input_ids, attention_mask=attention_mask, **kw)

    def hidden_of(input_ids, attention_mask):
        return body(input_ids, attention_mask).last_hidden_state

    P = rollout["prompt_ids"].shape[1]
    ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1)
    attn = torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], 1)
    w = model.lm_head.weight
    for knobs in (dict(dpo_variant="dpo", rpo_alpha=1.0), dict(dpo_variant="simpo")):
        hidden = hidden_of(ids, attn)[:, P - 1 : -1]
        fused = fused_replay_term(body, rollout, hidden, w, None, beta_replay=1.0, **knobs)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1 : -1]
        plain = replay_term(model, rollout, logits, beta_replay=1.0, **knobs)
        assert fused is not None and plain is not None
        # float32, V ~ 100, H = 16 through one transformer layer: n = H + V + T + 100 steps
        n = 16 + vocab + 5 + 100
        assert_close(fused[0], plain[0], n=n, scale=8, what="loss")
        g_f = torch.autograd.grad(fused[0], w)[0]
        g_p = torch.autograd.grad(plain[0], w)[0]
        assert_close(g_f, g_p, n=n, scale=8 * float(g_p.abs().max()), what="weight gradient")
        assert float(g_p.abs().max()) > 0


@pytest.mark.gpu
def test_fused_logps_on_cuda_bfloat16_against_the_bf16_logits_path():
    """On a GPU (bf16, Qwen2.5-0.5B's head width, a vocabulary of several tiles): the fused
    log-probs and gradients against the current path within the bounds of the CPU bf16 test,
    and against float64 on the same bf16 values (GPU memory: benchmarks/loss_memory.py's
    gpu_replay_peak_ratio)."""
    g = torch.Generator().manual_seed(6)
    T_, H_, V_ = 64, 896, 151936
    dev = torch.device("cuda")
    h = torch.randn(1, T_, H_, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V_, H_, generator=g) * (2.0 / H_**0.5)).to(dev, torch.bfloat16)
    w.requires_grad_(True)
    ids = torch.randint(0, V_, (1, T_), generator=g).to(dev)
    mask = torch.ones(1, T_, dtype=torch.bool, device=dev)
    up = torch.randn(1, T_, generator=g, dtype=torch.float64).to(dev)
    fused = _fused(h, w, None, ids, mask, up)
    current = _current(h, w, None, ids, mask, up)
    exact, exact_grads, logits = _exact(h, w, None, ids, mask, up)
    Z = float(logits.abs().max())
    assert_close(fused[0].double(), current[0].double(), n=2, u=UBF16, scale=Z, what="log-probs")
    p = torch.softmax(logits, -1)
    rows = ((F.one_hot(ids, V_).double() + p) * up.abs()[..., None]).reshape(-1, V_)
    scales = {
        "hidden": float((rows @ w.detach().double().abs()).max()),
        "weight": float((rows.t() @ h.detach().double().abs().reshape(-1, H_)).max()),
    }
    for k, name in enumerate(("hidden", "weight")):
        a, e, ex = fused[1][k].double(), current[1][k].double(), exact_grads[k]
        assert_close(a, e, n=math.ceil(2 * Z) + 4, u=UBF16, scale=scales[name], what=name)
        assert_close(a, ex, n=3, u=UBF16, scale=scales[name], what=name + " vs float64")
