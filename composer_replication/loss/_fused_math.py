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


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float32 for bfloat16/float16 inputs, else the inputs' (promoted) dtype."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def tile_chunks(
    tokens: int,
    vocab: int,
    device: torch.device,
    token_chunk: int | None,
    vocab_chunk: int | None,
    scale: int = 1,
) -> tuple[int, int]:
    """``(token rows, vocabulary columns)`` per tile: the caller's sizes, else from the tile
    budget (`CPU_TILE_ELEMENTS` / `GPU_TILE_ELEMENTS`, times ``scale``)."""
    budget = (GPU_TILE_ELEMENTS if device.type == "cuda" else CPU_TILE_ELEMENTS) * scale
    n = token_chunk or min(tokens, max(1, budget // MIN_VOCAB_CHUNK))
    n = max(1, min(n, tokens))
    vc = vocab_chunk or max(1, budget // n)
    return n, max(1, min(vc, vocab))


def online_lse(x: Tensor, running_max: Tensor, running_sum: Tensor) -> None:
    """Fold the tile ``x`` ``(n, vc)`` (already biased and scaled; overwritten) into the running
    ``(max, sum exp(x - max))`` of each row: the online log-sum-exp over vocabulary chunks."""
    new_max = torch.maximum(running_max, x.amax(-1))
    running_sum.mul_(torch.exp(running_max - new_max))
    running_sum.add_(x.sub_(new_max.unsqueeze(-1)).exp_().sum(-1))
    running_max.copy_(new_max)


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
        return compute_dtype(self.hs, self.weight)

    def chunks(self) -> tuple[int, int]:
        """``(token rows, vocabulary columns)`` per tile."""
        return tile_chunks(
            self.tokens, self.vocab, self.hs.device, self.token_chunk, self.vocab_chunk
        )


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
            online_lse(self._scaled(x, bias), running_max, running_sum)

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


class GradAccumulator:
    """The output layer's backward from gradient tiles, shared by every tiled loss here.

    For a gradient tile ``g`` ``(n, vc)`` with respect to the logits of token rows ``t0:t1`` and
    vocabulary columns ``v0:v1``: ``dh[t0:t1] += g W_c``, ``dW_c (+)= g^T h``, ``db_c += sum g``.
    ``g`` is in `grad_dtype` (the weight's dtype for a low-precision weight: rounded as autograd
    of materialised logits would round the logits' gradient), the matmuls accumulate in the
    compute dtype. One token chunk: each vocabulary chunk's weight gradient is one matmul,
    written once in the weight's dtype; several: accumulated (in float32 for a low-precision
    weight) and cast at the end.
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        *,
        need_hidden: bool,
        need_weight: bool,
        need_bias: bool,
        dtype: torch.dtype,
        token_chunks: int,
    ) -> None:
        device = hidden.device
        self.weight = weight
        self.bias = bias
        self.dtype = dtype
        self.single = token_chunks == 1
        low = weight.dtype in (torch.float16, torch.bfloat16)
        self.grad_dtype = weight.dtype if low else dtype
        self.hidden = torch.zeros_like(hidden, dtype=dtype) if need_hidden else None
        acc_w = weight.dtype if self.single else dtype
        self.weight_grad = (
            torch.zeros(weight.shape, dtype=acc_w, device=device) if need_weight else None
        )
        self.bias_grad = None
        if need_bias and bias is not None:
            self.bias_grad = torch.zeros(weight.shape[0], dtype=dtype, device=device)

    @property
    def wanted(self) -> bool:
        return self.hidden is not None or self.weight_grad is not None or self.bias_grad is not None

    def add(self, t0: int, t1: int, v0: int, v1: int, g: Tensor, h: Tensor) -> None:
        """Back-propagate the gradient tile ``g`` of rows ``t0:t1`` (inputs ``h``), columns
        ``v0:v1``."""
        if self.hidden is not None:
            self.hidden[t0:t1] += _mm_acc(g, self.weight[v0:v1], self.dtype)
        if self.weight_grad is not None:
            part = _mm_acc(g.t(), h, self.dtype)
            if self.single:
                self.weight_grad[v0:v1] = part
            else:
                self.weight_grad[v0:v1] += part
        if self.bias_grad is not None:
            self.bias_grad[v0:v1] += g.sum(0, dtype=self.dtype)

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(d hidden, d weight, d bias)``: hidden in the compute dtype, weight and bias in
        their own dtypes (None where not wanted)."""
        weight = None if self.weight_grad is None else self.weight_grad.to(self.weight.dtype)
        bias = None
        if self.bias_grad is not None and self.bias is not None:
            bias = self.bias_grad.to(self.bias.dtype)
        return self.hidden, weight, bias


def _vocab_chunks(vocab: int, vc: int) -> list[tuple[int, int]]:
    return [(v0, min(v0 + vc, vocab)) for v0 in range(0, vocab, vc)]


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
    grads = GradAccumulator(
        p.hs,
        p.weight,
        p.bias,
        need_hidden=p.need_hidden,
        need_weight=p.need_weight,
        need_bias=p.need_bias,
        dtype=dtype,
        token_chunks=-(-N // n),
    )
    vocab_chunks = _vocab_chunks(V, vc)

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
        if not grads.wanted or not bool((coef != 0).any()):
            continue
        for v0, v1 in vocab_chunks:  # pass C
            g = torch.empty((rows, v1 - v0), dtype=grads.grad_dtype, device=device)
            ops.grad_tile(*tiles(h, ht, v0, v1), *biases(v0, v1), lse_s, lse_t, const, coef, g)
            grads.add(t0, t1, v0, v1, g, h)
    return FusedResult(total, clipped, *grads.result())


# ------------------------------------------------------------------ log-probs of given tokens
# The log-prob passes hold one tile and its exponential at a time (the JSD's hold two sides' tiles
# and their mixtures), so their tiles are 4x wider: a quarter of the matmul calls and element-wise
# kernel launches for the same memory order (16 MB / 32 MB of float32 logits per tile).
LOGPS_TILE_SCALE = 4


@dataclass(frozen=True)
class LogpsProblem:
    """Log-probs of given tokens through the output layer (channel 3 from hidden states):
    ``log softmax((h W^T + b) / tau)[y]`` per row, all tensors detached."""

    hs: Tensor  # (N, H) last hidden states
    weight: Tensor  # (V, H)
    bias: Tensor | None  # (V,)
    ids: Tensor  # (N,) int64 token ids
    temperature: float
    token_chunk: int | None
    vocab_chunk: int | None

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.hs, self.weight)

    def chunks(self) -> tuple[int, int]:
        return tile_chunks(
            int(self.hs.shape[0]),
            int(self.weight.shape[0]),
            self.hs.device,
            self.token_chunk,
            self.vocab_chunk,
            LOGPS_TILE_SCALE,
        )


def _logits_tile(p: LogpsProblem, h: Tensor, v0: int, v1: int, dtype: torch.dtype) -> Tensor:
    """``(h W_c^T + b_c) / tau`` of one tile, in the compute dtype."""
    x = _project(h, p.weight[v0:v1], dtype)
    if p.bias is not None:
        x.add_(p.bias[v0:v1].to(dtype))
    return x.div_(p.temperature) if p.temperature != 1.0 else x


def _in_chunk(ids: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """Which rows' token lies in columns ``v0:v1``, and its column in the tile (clamped)."""
    local = ids - v0
    inside = (local >= 0) & (local < v1 - v0)
    return inside, local.clamp(0, v1 - v0 - 1).unsqueeze(-1)


def linear_logps(p: LogpsProblem) -> tuple[Tensor, Tensor]:
    """``(log-probs (N,), log-sum-exps (N,))`` in the compute dtype, tile by tile: an online
    log-sum-exp over the vocabulary chunks, the token's logit read from the tile that holds it
    (the same rounded value the log-sum-exp summed)."""
    dtype = p.compute_dtype
    device = p.hs.device
    N, V = int(p.hs.shape[0]), int(p.weight.shape[0])
    n, vc = p.chunks()
    lse = torch.empty(N, dtype=dtype, device=device)
    picked = torch.zeros(N, dtype=dtype, device=device)
    for t0 in range(0, N, n):
        t1 = min(t0 + n, N)
        h, ids = p.hs[t0:t1], p.ids[t0:t1]
        rows = t1 - t0
        running_max = torch.full((rows,), -math.inf, dtype=dtype, device=device)
        running_sum = torch.zeros(rows, dtype=dtype, device=device)
        for v0, v1 in _vocab_chunks(V, vc):
            x = _logits_tile(p, h, v0, v1, dtype)
            inside, col = _in_chunk(ids, v0, v1)
            value = x.gather(-1, col).squeeze(-1)
            picked[t0:t1] = torch.where(inside, value, picked[t0:t1])
            online_lse(x, running_max, running_sum)
        lse[t0:t1] = running_max.add_(running_sum.log_())
    return picked - lse, lse


def linear_logps_backward(
    p: LogpsProblem,
    lse: Tensor,
    grad: Tensor,
    *,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``sum_i grad_i * logp_i`` for `linear_logps`: the tiles are recomputed and
    ``dz = grad_i (onehot(y_i) - softmax(z_i)) / tau`` back-propagated through the output layer
    (`GradAccumulator`). Returns ``(d hidden, d weight, d bias)``."""
    dtype = p.compute_dtype
    N, V = int(p.hs.shape[0]), int(p.weight.shape[0])
    n, vc = p.chunks()
    grads = GradAccumulator(
        p.hs,
        p.weight,
        p.bias,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        dtype=dtype,
        token_chunks=-(-N // n),
    )
    coef_all = grad.to(dtype) / p.temperature
    for t0 in range(0, N, n):
        t1 = min(t0 + n, N)
        coef = coef_all[t0:t1]
        if not bool((coef != 0).any()):
            continue
        h, ids, row_lse = p.hs[t0:t1], p.ids[t0:t1], lse[t0:t1].unsqueeze(-1)
        for v0, v1 in _vocab_chunks(V, vc):
            x = _logits_tile(p, h, v0, v1, dtype)
            g = x.sub_(row_lse).exp_().mul_(-coef.unsqueeze(-1))  # -coef * softmax
            inside, col = _in_chunk(ids, v0, v1)
            g.scatter_add_(-1, col, (coef * inside).unsqueeze(-1))  # + coef at the token
            grads.add(t0, t1, v0, v1, g.to(grads.grad_dtype), h)
    return grads.result()
