"""Generalized JSD through the output layer without ``(N, V)`` logits: the tiled algorithm.

Inputs are the selected tokens' last hidden states, student ``hs`` ``(N, H)`` and teacher ``ht``
``(N, Ht)``, and the output layers ``W`` ``(V, H)`` (+ bias ``b``) and ``Wt`` ``(V, Ht)``
(+ ``bt``). With ``tau`` the temperature, ``s = (hs W^T + b) / tau``, ``t = (ht Wt^T + bt) / tau``,
``log q = s - Ls``, ``log p = t - Lt`` (``L`` = row log-sum-exp), the per-token loss and the
gradient of the token mean with respect to the student logits ``z = s * tau`` are, as
``_kernels.jsd_kernel`` (same conventions as ``distill.generalized_jsd``):

- beta = 0, KL(p || q):  ``loss = <p, log p - log q>``,  ``dz = (q - p) / tau``
- beta = 1, KL(q || p):  ``loss = c = <q, log q - log p>``,  ``dz = q (log q - log p - c) / tau``
- else, ``log m = logaddexp(log q + log(1-beta), log p + log beta)``:
  ``loss = beta <p, log p - log m> + (1-beta) c`` with ``c = <q, log q - log m>``,
  ``dz = (1-beta) q (log q - log m - c) / tau``

then ``dhs = dz W``, ``dW = dz^T hs``, ``db = sum_tokens dz`` (each scaled by ``1/N``, and by 0 for
a token whose loss is clipped). The tokens are processed in chunks of ``n`` rows and, inside a
token chunk, the vocabulary in chunks of ``vc`` columns; only ``(n, vc)`` tiles ever exist:

- pass A: an online log-sum-exp over the vocabulary chunks gives ``Ls``, ``Lt``;
- pass B: the per-token loss and the row constant ``c`` (sums over the vocabulary chunks);
- pass C (only when a gradient is wanted): the gradient tile ``dz`` of each vocabulary chunk,
  then ``dhs += dz W_c``, ``dW_c (+)= dz^T hs``, ``db_c (+)= sum dz``.

Each pass recomputes the tile's logits (two matmuls); that costs compute, never memory. The tile
math (the three passes' element-wise work) is a ``TileOps``: `TorchTileOps` here, the Triton
kernels in ``_fused_triton`` (same formulas), so every backend built on `run_tiled` computes the
same thing in the same order.

Precision: logits are float32 for bfloat16/float16 inputs (the product of two such numbers is
exact in float32; the matmul accumulates in float32), the log-sum-exps and sums too; the gradient
tile is rounded to the weight's dtype before the two backward matmuls (as autograd of the
materialised logits would round the logits' gradient), whose results are accumulated in float32.
float32 and float64 inputs are computed in their own dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from composer_replication.loss._kernels import _rowdot

# Logits per tile when the caller does not fix the chunk sizes: 4 MB of float32 per (n, vc) tile
# on the CPU (cache-sized, as the other chunked losses), 8 MB on a GPU (large enough that the
# matmuls keep the tensor cores busy; a pass holds 2-3 tiles, so tens of MB in all).
CPU_TILE_ELEMENTS = 1 << 20
GPU_TILE_ELEMENTS = 1 << 21
# A vocabulary chunk narrower than this makes each matmul too thin to be efficient; the token
# chunk shrinks instead.
MIN_VOCAB_CHUNK = 512


@dataclass(frozen=True)
class FusedProblem:
    """One fused generalized-JSD evaluation on the selected tokens (all tensors detached)."""

    hs: Tensor  # (N, H) student last hidden states
    ht: Tensor  # (N, Ht) teacher last hidden states
    weight: Tensor  # (V, H) student output layer
    bias: Tensor | None  # (V,)
    teacher_weight: Tensor  # (V, Ht)
    teacher_bias: Tensor | None  # (V,)
    beta: float
    temperature: float
    token_clip: float | None
    need_hidden: bool  # compute d loss / d hs
    need_weight: bool  # d loss / d weight
    need_bias: bool  # d loss / d bias
    token_chunk: int | None  # rows per token chunk (None: from the tile budget)
    vocab_chunk: int | None  # columns per vocabulary chunk (None: from the tile budget)

    @property
    def tokens(self) -> int:
        return int(self.hs.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    @property
    def needs_grad(self) -> bool:
        return self.need_hidden or self.need_weight or self.need_bias

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for bfloat16/float16 inputs, else the inputs' (promoted) dtype."""
        dtype = torch.promote_types(self.hs.dtype, self.weight.dtype)
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def chunks(self) -> tuple[int, int]:
        """``(token rows, vocabulary columns)`` per tile."""
        budget = GPU_TILE_ELEMENTS if self.hs.device.type == "cuda" else CPU_TILE_ELEMENTS
        n = self.token_chunk or min(self.tokens, max(1, budget // MIN_VOCAB_CHUNK))
        n = max(1, min(n, self.tokens))
        vc = self.vocab_chunk or max(1, budget // n)
        return n, max(1, min(vc, self.vocab))


@dataclass
class FusedResult:
    """Sum over the tokens of the (clipped) per-token loss, the clipped count, and the gradients
    of the token mean (``sum / N``) with respect to the requested inputs."""

    loss_sum: float
    clipped: int
    grad_hidden: Tensor | None  # (N, H), float32 (or the compute dtype)
    grad_weight: Tensor | None  # (V, H), the weight's dtype
    grad_bias: Tensor | None  # (V,), the bias' dtype


def beta_mode(beta: float) -> int:
    """0: forward KL, 1: reverse KL, 2: the mixture (as ``distill.divergence``)."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


class TileOps(Protocol):
    """The element-wise work of the three passes on one ``(n, vc)`` tile.

    ``s``/``t`` are the tile's raw student/teacher logits ``h W_c^T`` (float32 or the compute
    dtype; the ops may overwrite them), ``bs``/``bt`` the chunk's biases or None; the ops add the
    bias and divide by the temperature themselves. Row vectors are ``(n,)`` in the compute dtype.
    """

    def lse_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        max_s: Tensor,
        sum_s: Tensor,
        max_t: Tensor,
        sum_t: Tensor,
    ) -> None:
        """Online log-sum-exp: fold the tile into the running ``(max, sum exp(x - max))``."""

    def loss_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        loss: Tensor,
        const: Tensor,
    ) -> None:
        """Add the tile's share of the per-token loss and of the row constant ``c``."""

    def grad_tile(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        const: Tensor,
        coef: Tensor,
        out: Tensor,
    ) -> None:
        """Write ``coef_i * dz_i`` of the tile into ``out`` (``(n, vc)``, the gradient dtype);
        ``coef`` holds each token's weight (``1/N`` or 0 if clipped), ``1/tau`` and, for the
        mixture, ``1 - beta``."""


class TorchTileOps:
    """`TileOps` in plain PyTorch (any device, any floating dtype)."""

    def __init__(self, beta: float, temperature: float) -> None:
        self.mode = beta_mode(beta)
        self.beta = beta
        self.temperature = temperature

    def _scaled(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if bias is not None:
            x.add_(bias.to(x.dtype))
        return x.div_(self.temperature) if self.temperature != 1.0 else x

    def lse_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        max_s: Tensor,
        sum_s: Tensor,
        max_t: Tensor,
        sum_t: Tensor,
    ) -> None:
        for x, bias, running_max, running_sum in ((s, bs, max_s, sum_s), (t, bt, max_t, sum_t)):
            x = self._scaled(x, bias)
            new_max = torch.maximum(running_max, x.amax(-1))
            running_sum.mul_(torch.exp(running_max - new_max))
            running_sum.add_(x.sub_(new_max.unsqueeze(-1)).exp_().sum(-1))
            running_max.copy_(new_max)

    def _log_probs(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
    ) -> tuple[Tensor, Tensor]:
        log_q = self._scaled(s, bs).sub_(lse_s.unsqueeze(-1))
        log_p = self._scaled(t, bt).sub_(lse_t.unsqueeze(-1))
        return log_q, log_p

    def _log_m(self, log_q: Tensor, log_p: Tensor) -> Tensor:
        return torch.logaddexp(log_q + math.log1p(-self.beta), log_p + math.log(self.beta))

    def loss_update(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        loss: Tensor,
        const: Tensor,
    ) -> None:
        log_q, log_p = self._log_probs(s, t, bs, bt, lse_s, lse_t)
        if self.mode == 0:
            loss.add_(_rowdot(log_p.exp(), log_p - log_q))
            return
        q = log_q.exp()
        if self.mode == 1:
            kl_q = _rowdot(q, log_q - log_p)
            loss.add_(kl_q)
            const.add_(kl_q)
            return
        log_m = self._log_m(log_q, log_p)
        kl_p = _rowdot(log_p.exp(), log_p.sub_(log_m))
        kl_q = _rowdot(q, log_q.sub_(log_m))
        loss.add_(self.beta * kl_p + (1 - self.beta) * kl_q)
        const.add_(kl_q)

    def grad_tile(
        self,
        s: Tensor,
        t: Tensor,
        bs: Tensor | None,
        bt: Tensor | None,
        lse_s: Tensor,
        lse_t: Tensor,
        const: Tensor,
        coef: Tensor,
        out: Tensor,
    ) -> None:
        log_q, log_p = self._log_probs(s, t, bs, bt, lse_s, lse_t)
        if self.mode == 0:
            g = log_q.exp_().sub_(log_p.exp_())
        else:
            ref = log_p if self.mode == 1 else self._log_m(log_q, log_p)
            q = log_q.exp()
            g = log_q.sub_(ref).sub_(const.unsqueeze(-1)).mul_(q)
        out.copy_(g.mul_(coef.unsqueeze(-1)))


def _project(h: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """``h @ w^T`` in ``dtype`` (float32 for low-precision operands: exact products)."""
    if h.dtype == w.dtype == dtype:
        return h @ w.t()
    if (
        h.device.type == "cuda"
        and dtype == torch.float32
        and h.dtype == w.dtype
        and h.dtype in (torch.float16, torch.bfloat16)
    ):
        try:  # float32 output straight from the low-precision matmul (torch >= 2.8)
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return h.to(dtype) @ w.to(dtype).t()


def _mm_acc(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` accumulated and returned in ``dtype`` (a backward matmul of the gradient)."""
    return _project(a, b.t(), dtype)


def run_tiled(problem: FusedProblem, ops: TileOps) -> FusedResult:
    """The three passes over ``(token chunk, vocabulary chunk)`` tiles (see module docstring)."""
    p = problem
    N, V = p.tokens, p.vocab
    dtype = p.compute_dtype
    device = p.hs.device
    n, vc = p.chunks()
    weight_scale = 1.0 / max(N, 1)
    mode = beta_mode(p.beta)
    coef_scale = (1.0 - p.beta if mode == 2 else 1.0) / p.temperature
    grad_dtype = p.weight.dtype if p.weight.dtype in (torch.float16, torch.bfloat16) else dtype
    n_token_chunks = -(-N // n)
    grad_hidden = torch.zeros_like(p.hs, dtype=dtype) if p.need_hidden else None
    # One token chunk: each vocabulary chunk's weight gradient is one matmul, written once in the
    # weight's dtype. Several: accumulated (in float32 for a low-precision weight), cast at the end.
    acc_w = p.weight.dtype if n_token_chunks == 1 else dtype
    grad_weight = torch.zeros(p.weight.shape, dtype=acc_w, device=device) if p.need_weight else None
    grad_bias = None
    if p.need_bias and p.bias is not None:
        grad_bias = torch.zeros(V, dtype=dtype, device=device)
    vocab_chunks = [(v0, min(v0 + vc, V)) for v0 in range(0, V, vc)]

    def biases(v0: int, v1: int) -> tuple[Tensor | None, Tensor | None]:
        bs = p.bias[v0:v1] if p.bias is not None else None
        bt = p.teacher_bias[v0:v1] if p.teacher_bias is not None else None
        return bs, bt

    def tiles(h: Tensor, ht: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
        return _project(h, p.weight[v0:v1], dtype), _project(ht, p.teacher_weight[v0:v1], dtype)

    total = 0.0
    clipped = 0
    for t0 in range(0, N, n):
        t1 = min(t0 + n, N)
        h, ht = p.hs[t0:t1], p.ht[t0:t1]
        rows = t1 - t0
        max_s = torch.full((rows,), -math.inf, dtype=dtype, device=device)
        max_t = torch.full((rows,), -math.inf, dtype=dtype, device=device)
        sum_s = torch.zeros(rows, dtype=dtype, device=device)
        sum_t = torch.zeros(rows, dtype=dtype, device=device)
        for v0, v1 in vocab_chunks:  # pass A
            ops.lse_update(*tiles(h, ht, v0, v1), *biases(v0, v1), max_s, sum_s, max_t, sum_t)
        lse_s = max_s.add_(sum_s.log_())
        lse_t = max_t.add_(sum_t.log_())
        loss = torch.zeros(rows, dtype=dtype, device=device)
        const = torch.zeros(rows, dtype=dtype, device=device)
        for v0, v1 in vocab_chunks:  # pass B
            ops.loss_update(*tiles(h, ht, v0, v1), *biases(v0, v1), lse_s, lse_t, loss, const)
        coef = torch.full((rows,), weight_scale * coef_scale, dtype=dtype, device=device)
        if p.token_clip is not None:
            over = loss > p.token_clip
            clipped += int(over.sum())
            loss = loss.clamp(max=p.token_clip)
            coef = coef.masked_fill(over, 0.0)  # a clipped token is constant: no gradient
        total += float(loss.double().sum())
        if not p.needs_grad or not bool((coef != 0).any()):
            continue
        for v0, v1 in vocab_chunks:  # pass C
            g = torch.empty((rows, v1 - v0), dtype=grad_dtype, device=device)
            ops.grad_tile(*tiles(h, ht, v0, v1), *biases(v0, v1), lse_s, lse_t, const, coef, g)
            if grad_hidden is not None:
                grad_hidden[t0:t1] += _mm_acc(g, p.weight[v0:v1], dtype)
            if grad_weight is not None:
                part = _mm_acc(g.t(), h, dtype)
                if n_token_chunks == 1:
                    grad_weight[v0:v1] = part
                else:
                    grad_weight[v0:v1] += part
            if grad_bias is not None:
                grad_bias[v0:v1] += g.sum(0, dtype=dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(p.weight.dtype)
    if grad_bias is not None and p.bias is not None:
        grad_bias = grad_bias.to(p.bias.dtype)
    return FusedResult(total, clipped, grad_hidden, grad_weight, grad_bias)
